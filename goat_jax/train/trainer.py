"""The training engine: one function, :func:`train_and_evaluate`, readable top to bottom.

    config -> validate -> mesh -> data -> model + optimizer -> sharded init (or restore)
           -> jitted train step -> loop { step, log, eval, checkpoint } -> metrics + checkpoints

What is trained is chosen by ``config.task`` (:mod:`goat_jax.train.tasks`, e.g.
``goat_jax/tasks/lm.py``): the task supplies the model, the data, the loss, its eval metrics and
its config schema; this file never imports a model or a dataset. Helpers live in their own modules:
:mod:`~goat_jax.train.steps` (the jitted train and eval steps, sharded, and their compile),
:mod:`~goat_jax.train.sharding` (mesh, logical rules), :mod:`~goat_jax.train.optim` (AdamW, schedule,
accumulation), checkpoint, metrics, :mod:`~goat_jax.train.run` (workdir layout, train state).

Re-running the same command resumes from the latest checkpoint and reproduces the uninterrupted
run's per-step losses (the data iterator's state is checkpointed; the step's PRNG key is
``fold_in(key(config.seed), step)``, so dropout masks repeat too).

The engine's config fields, each with its default, type, range and meaning, are declared once
in :data:`goat_jax.train.validation.ENGINE`; a config leaves out any it does not change (the
task adds ``model.*``, ``data.*`` and its own, e.g. ``seq_len``: :class:`goat_jax.train.tasks.TaskFields`).
The resolved config written to ``WORKDIR/config.json`` shows every value.
"""

from __future__ import annotations

import difflib
import json
import logging
import math
import os
import signal
from typing import Any, Dict, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from goat_jax import _extras, files
from goat_jax.config.fields import check_config
from goat_jax.kernels import strategies
from goat_jax.kernels.plan import AttentionPlan
from goat_jax.positional import ENCODINGS
with _extras.imports(__name__):  # optional packages: one-line error naming the extra
    import ml_collections
    import optax  # noqa: F401  # the engine needs it (train/steps.py, optim.py): named for the trainer

from goat_jax.train import checkpoint as checkpoint_lib
from goat_jax.train import failures as failures_lib
from goat_jax.train import interrupts
from goat_jax.train import lock as lock_lib
from goat_jax.train import metrics as metrics_lib
from goat_jax.train import profiling
from goat_jax.train import run as run_lib
from goat_jax.train import steps as steps_lib
# The train state and steps live in goat_jax/train/steps.py; their names stay importable from here.
from goat_jax.train.steps import (ShardedSteps, TrainState, global_abstract_batch, make_eval_step,  # noqa: F401
                                  make_sharded_steps, make_train_step, step_key)
from goat_jax.train import sharding as sharding_lib
from goat_jax.train import tasks as tasks_lib
from goat_jax.train import validation
from goat_jax.train import wandb_logger

# ----------------------------------------------------------------------------------------------
# Config validation: every check names the field and the fix, and runs before any work
# ----------------------------------------------------------------------------------------------

def _check_fields(section: str, present: set, allowed: set, required: set) -> None:
    prefix = f"{section}." if section else ""
    for name in sorted(present - allowed):
        close = difflib.get_close_matches(name, sorted(allowed), n=1)
        hint = f" Did you mean {prefix}{close[0]}?" if close else ""
        raise ValueError(f"Unknown config field {prefix}{name}.{hint} Known fields of "
                         f"{section or 'the top level'}: {sorted(allowed)}.")
    if required - present:
        missing = sorted(required - present)
        raise ValueError(f"Config is missing field(s) {[prefix + m for m in missing]}, which have no "
                         "default; set them in the config file or with --config.<field>=... "
                         "(goat_jax/train/validation.py and the task's fields say what each means).")


class Validated(NamedTuple):
    """What :func:`validate_config` found a valid config computes with."""

    global_batch: int  # the global batch size, resolved
    plan: AttentionPlan  # the run's attention plan: built here, once, and handed to the model and the engine


def validate_config(config: ml_collections.ConfigDict, num_devices: int, process_count: int = 1,
                    platform: Optional[str] = None) -> Validated:
    """Checks ``config`` against the engine's and the task's schema and the device layout
    (``platform``: 'cpu', 'gpu' or 'tpu' of the devices the run will use, when known: a kernel
    named in the config that cannot run there is refused first).

    Returns the resolved global batch size and the run's attention plan (:class:`Validated`:
    the plan is built here once, from the checked fields, for the entry point to hand to
    ``task.build_model`` and the engine). Raises ValueError naming the offending field (unknown
    fields, mesh vs device count, batch divisibility, sequence length vs model limits).
    """
    task = tasks_lib.get_task(config.get("task"))
    # Engine fields left out take the schema's defaults (train/validation.py): read below without fallbacks.
    config = validation.with_engine_defaults(config)
    engine = validation.ENGINE
    top_allowed = set(engine[""].specs) | set(validation.ENGINE_SECTIONS) | set(task.fields.top_level) | {"model", "data"}
    top_required = set(engine[""].required) | set(task.fields.top_level) | {"model", "data"}
    _check_fields("", set(config.keys()), top_allowed, top_required)
    for section in validation.ENGINE_SECTIONS:
        _check_fields(section, set(config[section].keys()), set(engine[section].specs), set(engine[section].required))
    for section, allowed in task.fields.schema().items():
        _check_fields(section, set(config[section].keys()), allowed, set())

    # Type and range of every field the engine and the task declare.
    check_config(config, validation.engine_specs())
    check_config(config, task.fields.specs(config))
    profiling.check_profile_steps(config.profile_steps, config.num_train_steps)
    wandb_logger.check_config(config.wandb)

    mesh_shape = sharding_lib.mesh_shape(config.mesh, num_devices)  # raises naming mesh.*
    sharding_lib.rules_from_config(config.sharding_rules)
    plan = AttentionPlan.from_config(config)  # the run's one plan: the task's model and the engine run under it
    # The run's strategy states its own checks (kernels/strategies.py); the encodings that add a
    # materialized bias come from the registry (the kernels floor imports no encoding).
    strategies.check_config(config, mesh_shape[sharding_lib.MESH_AXES.index(plan.context_axis)], task.name, platform,
                            plan, bias_encodings=frozenset(e.name for e in ENCODINGS if e.materialized_bias))
    batch_shards = mesh_shape[0] * mesh_shape[1]

    gbs, pdbs = config.global_batch_size, config.per_device_batch_size
    if (gbs is None) == (pdbs is None):
        raise ValueError("Set exactly one of global_batch_size and per_device_batch_size (the other "
                         f"None); got global_batch_size={gbs}, per_device_batch_size={pdbs}.")
    field = "global_batch_size" if gbs is not None else "per_device_batch_size"  # >= 1: ENGINE_FIELDS
    global_batch = int(gbs) if gbs is not None else int(pdbs) * num_devices
    accum = config.grad_accum_steps
    if global_batch % (batch_shards * accum):
        raise ValueError(
            f"{field}={config[field]} gives a global batch of {global_batch}, which must be "
            f"divisible by mesh.data * mesh.fsdp * grad_accum_steps = {mesh_shape[0]} * "
            f"{mesh_shape[1]} * {accum} = {batch_shards * accum} (each microbatch is split over the "
            f"data and fsdp axes). Change {field}, grad_accum_steps or the mesh.")
    # Processes feed distinct rows only up to the number of batch shards (beyond, a context or
    # tensor group spans hosts and its processes read the same rows: sharding.batch_groups).
    feeding = min(process_count, batch_shards)
    if global_batch % feeding:
        raise ValueError(f"{field}: global batch {global_batch} must be divisible by the "
                         f"{feeding} processes that feed distinct rows.")
    grouping = config.optimizer.decay_grouping
    if grouping != run_lib.DEFAULT_DECAY_GROUPING and grouping not in task.decay_groupings:
        allowed = (run_lib.DEFAULT_DECAY_GROUPING, *sorted(task.decay_groupings))
        raise ValueError(f"optimizer.decay_grouping={grouping!r} is not a grouping of the "
                         f"{task.name!r} task: use one of {allowed}.")
    task.validate(config)
    return Validated(global_batch, plan)


# ----------------------------------------------------------------------------------------------
# The run
# ----------------------------------------------------------------------------------------------


def _fingerprinted(config: ml_collections.ConfigDict, global_batch: int) -> Dict[str, Any]:
    """The config dict a run's checkpoints are fingerprinted with: references resolved, the
    global batch as validated."""
    resolved = ml_collections.ConfigDict(config.to_dict())  # resolves FieldReferences
    resolved.global_batch_size = global_batch
    return resolved.to_dict()


def is_finished(config: ml_collections.ConfigDict, workdir: str) -> bool:
    """Whether :func:`train_and_evaluate` of ``config`` in ``workdir`` would train nothing: the
    newest checkpoint is at ``num_train_steps`` or later and was written by a compatible config
    (the same check the trainer makes before resuming). Read-only, compiles nothing; False for
    an invalid config, a workdir without checkpoints or an incompatible one (the trainer then
    says why). For callers that skip a finished run without starting a trainer for it."""
    try:
        global_batch = validate_config(config, jax.device_count(), jax.process_count()).global_batch
    except ValueError:
        return False
    task = tasks_lib.get_task(config.task)
    config = tasks_lib.with_field_defaults(config, task)
    directory = run_lib.checkpoint_dir(workdir)
    if not os.path.isdir(directory):
        return False
    checkpointer = checkpoint_lib.Checkpointer(directory, _fingerprinted(config, global_batch),
                                               keep=config.keep_checkpoints, async_save=False,
                                               resume_safe_fields=task.resume_safe_fields,
                                               field_defaults=tasks_lib.field_defaults(task), read_only=True)
    try:
        steps = checkpointer.all_steps()
        if not steps or steps[-1] < int(config.num_train_steps):
            return False
        checkpointer.check_compatible()
        return True
    except checkpoint_lib.IncompatibleCheckpointError:
        return False
    finally:
        checkpointer.close()


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str, *,
                       resume_with_changes: bool = False) -> Dict[str, Any]:
    """Trains (or resumes) ``config`` in ``workdir``; returns a summary dict with the last step,
    ``train_loss``, ``eval_loss`` (if evaluated), ``preempted`` and, when a signal stopped it,
    ``stopped_by`` ('SIGTERM', 'SIGINT' for Ctrl-C, 'SIGHUP'): the run saved a checkpoint at
    the step it was on and returned (:mod:`goat_jax.train.interrupts`).

    ``resume_with_changes``: resume even if the fields of
    ``checkpoint.RESUME_ADJUSTABLE_FIELDS`` (the optimizer's, ``num_train_steps``) differ from
    the checkpoint's; the change is recorded in ``workdir/config_changes.jsonl``.

    Only one trainer at a time may use ``workdir`` (:mod:`goat_jax.train.lock`): another live
    one holding it raises WorkdirLockedError before anything is written.

    A full disk raises :class:`~goat_jax.train.failures.DiskFullError` and a dead peer of a
    multi-host run :class:`~goat_jax.train.failures.PeerFailedError`, one line each naming the
    step, the last complete checkpoint and what to do.

    Raises ValueError on an invalid config (before any work), IncompatibleCheckpointError when the
    workdir holds another config's checkpoint, FloatingPointError on a non-finite loss, gradient
    or state (only finite states are saved; the last one is kept).
    """
    # --- Setup ----------------------------------------------------------------------------------
    config = validation.with_engine_defaults(config)  # fields left out: their declared defaults
    if config.distributed:
        sharding_lib.initialize_distributed()  # no-op if the entry point already did
    global_batch, plan = validate_config(config, jax.device_count(), jax.process_count(), jax.devices()[0].platform)
    # A config written before a field existed (e.g. data.packing) gets the field's default.
    config = tasks_lib.with_field_defaults(config, tasks_lib.get_task(config.task))
    if jax.process_index() == 0:  # the process that logs: W&B online needs credentials, network
        wandb_logger.preflight(config.wandb)
    os.makedirs(workdir, exist_ok=True)  # only now that the config is valid
    # One trainer per workdir (goat_jax/train/lock.py): taken before anything is written there.
    # SIGTERM, Ctrl-C, SIGHUP: a checkpoint at the end of the current step, then return (interrupts.py).
    with lock_lib.hold(workdir, jax.process_index()), interrupts.stop_signals() as stop:
        progress = {"step": 0}  # the step being run, for the failure message
        try:
            return _train_locked(config, workdir, global_batch, plan, resume_with_changes, progress, stop)
        except Exception as e:  # pylint: disable=broad-except
            # A full disk or a dead peer, buried in orbax/JAX errors: one line that says so.
            explained = failures_lib.explain(
                e, step=progress["step"], checkpoint_dir=run_lib.checkpoint_dir(workdir),
                process_count=jax.process_count(), process_index=jax.process_index())
            if explained is None:
                raise
            raise explained from e


def _train_locked(config: ml_collections.ConfigDict, workdir: str, global_batch: int, plan: AttentionPlan,
                  resume_with_changes: bool, progress: Dict[str, Any],
                  preemption: interrupts.StopSignals) -> Dict[str, Any]:
    """The body of :func:`train_and_evaluate`, run holding the workdir lock; keeps
    ``progress['step']`` at the step being run; ``preemption``: the stop signals to heed."""
    task = tasks_lib.get_task(config.task)
    config_dict = _fingerprinted(config, global_batch)
    is_primary = jax.process_index() == 0

    checkpointer = checkpoint_lib.Checkpointer(run_lib.checkpoint_dir(workdir), config_dict,
                                               keep=config.keep_checkpoints,
                                               resume_safe_fields=task.resume_safe_fields,
                                               field_defaults=tasks_lib.field_defaults(task))
    changes = checkpointer.check_compatible(allow_changes=resume_with_changes)  # before writing
    if is_primary:
        # Written whole then renamed: a reader of the live run never sees a partial file.
        files.write_whole(run_lib.config_path(workdir), json.dumps(config_dict, indent=2, default=str))

    # --- Mesh -----------------------------------------------------------------------------------
    mesh = sharding_lib.make_mesh(config.mesh)
    rules = sharding_lib.rules_from_config(config.sharding_rules)
    logging.info("mesh %s over %d devices (%s)", dict(mesh.shape), mesh.size, jax.devices()[0].device_kind)

    # --- Data -----------------------------------------------------------------------------------
    # Processes holding the same rows (a context or tensor group across hosts) read the same data.
    group, groups = sharding_lib.batch_groups(mesh, global_batch)
    data = task.make_datasets(config, global_batch, group, groups, plan=plan)
    dummy = task.dummy_batch(config, global_batch // groups)
    batch_shardings = {k: sharding_lib.batch_sharding(mesh, np.ndim(v)) for k, v in dummy.items()}

    def to_device(local_batch):
        missing = set(task.batch_keys) - set(local_batch)
        if missing:
            raise ValueError(f"task {task.name!r} needs batch keys {sorted(missing)}; the data gave {sorted(local_batch)}.")
        return {k: jax.make_array_from_process_local_data(
                    batch_shardings[k], local_batch[k], (global_batch,) + np.shape(local_batch[k])[1:])
                for k in batch_shardings}

    # --- Model, optimizer, sharded init (or restore), jitted steps -------------------------------
    steps = steps_lib.make_sharded_steps(task, config, mesh, rules, batch_shardings, plan=plan)
    abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                            steps.abstract_state, steps.state_shardings)
    # Compiled ahead of the first step, so that a step that cannot fit in memory is refused
    # with XLA's estimate before any state is allocated (goat_jax/train/memory.py).
    compiled_step, abstract_batch = steps_lib.compile_and_check_memory(steps, abstract, dummy, batch_shardings, groups)
    start_step, state, data_state = checkpointer.restore_latest(abstract)  # skips damaged ones
    start_step = start_step or 0
    progress["step"] = start_step
    if start_step:
        data.train.set_state(data_state)
        logging.info("resumed from step %d", start_step)
        if changes and is_primary:
            path = checkpointer.record_changes(start_step, changes)
            logging.warning("resumed with changed %s (recorded in %s)", ", ".join(
                f"{k}: {old!r} -> {new!r}" for k, (old, new) in changes.items()), path)
    else:
        state = steps.init(jax.random.PRNGKey(config.seed))
    num_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(steps.abstract_state.params))
    logging.info("%s: %.2fM parameters", task.name, num_params / 1e6)
    eval_step = steps.eval_step

    def train_step(state, batch):
        # The ahead-of-time executable serves batches of the dummy batch's shapes and dtypes (all
        # of them, for the built-in tasks); any other batch goes through jit as before.
        if compiled_step is not None and all(
                (batch[k].shape, batch[k].dtype) == (a.shape, a.dtype) for k, a in abstract_batch.items()):
            return compiled_step(state, batch)
        return steps.train_step(state, batch)

    # One fused reduction on device, run only before a save; the host reads back a single bool.
    def all_finite(tree) -> jax.Array:
        leaves = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
        return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]))

    state_is_finite = jax.jit(all_finite, in_shardings=(steps.state_shardings,),
                              out_shardings=sharding_lib.replicated(mesh))

    # --- Eval: the task's loss and aux sums over the whole eval set, summarized by the task ------
    def evaluate(params) -> Dict[str, float]:
        if data.make_eval is None:
            return {}
        totals = None
        for batch in data.make_eval():
            sums = eval_step(params, to_device(batch))  # stays on device until the end
            totals = sums if totals is None else jax.tree.map(jnp.add, totals, sums)
        if totals is None:
            return {}
        totals = {k: float(v) for k, v in jax.device_get(totals).items()}
        if not totals["weight"]:
            return {}
        extra = task.eval_metrics(totals)
        return {"eval_loss": totals["loss"] / totals["weight"],
                **{f"eval_{k}": float(v) for k, v in extra.items()}}

    # --- Loop -------------------------------------------------------------------------------------
    # Step s uses the s-th batch and the params after s - 1 updates; a checkpoint at s holds
    # the state after s updates and the iterator state after the s-th batch. Metrics are read
    # back one step late, so the host never waits for the device except at checkpoints.
    wandb_run = wandb_logger.WandbLogger(config.wandb, config_dict, workdir, primary=is_primary)
    profiler = profiling.StepProfiler(config.profile_steps, workdir, start_step)
    writer = metrics_lib.MetricsWriter(workdir, total_steps=config.num_train_steps, initial_step=start_step,
                                       enabled=is_primary, progress_bar=config.progress_bar,
                                       sinks=[wandb_run.sink])
    devices = jax.devices()
    peak = metrics_lib.peak_flops_per_device(devices[0].device_kind, config.peak_flops_per_device)
    throughput = metrics_lib.Throughput(
        global_batch * task.tokens_per_example(config), task.flops_per_token(config),
        peak * len(devices) if peak else None)
    summary: Dict[str, Any] = {"step": start_step, "preempted": False, "num_params": num_params}
    last_saved = start_step if start_step else None

    def way_forward(loss_step: int = 0) -> str:
        if start_step and loss_step == start_step + 1:
            # The first loss of the restored state is non-finite: it is finite but diverged.
            return (f"The state restored from step {start_step} fails at once: that checkpoint "
                    f"has likely diverged already (or the next batch is bad). Move "
                    f"{checkpointer.directory}/{start_step} aside to resume from the checkpoint "
                    "before it (adding --resume_with_changes and a lower "
                    "--config.optimizer.learning_rate), or start in a fresh --workdir.")
        if last_saved:
            return (f"The last finite checkpoint (step {last_saved}) is kept in "
                    f"{checkpointer.directory}. To continue from it, rerun the same command adding "
                    "--resume_with_changes --config.optimizer.learning_rate=<lower> (other "
                    "optimizer.* fields, e.g. grad_clip, may change too; see docs/training.md, "
                    "'What happens when things go wrong').")
        return ("No checkpoint was saved; rerun the same command adding "
                "--config.optimizer.learning_rate=<lower> (or a positive optimizer.grad_clip).")

    def process(step: int, device_metrics) -> None:
        host = {k: float(v) for k, v in jax.device_get(device_metrics).items()}
        if not (math.isfinite(host["train_loss"]) and math.isfinite(host["grad_norm"])):
            writer.write(step, host)
            raise FloatingPointError(
                f"Non-finite training at step {step}: train_loss={host['train_loss']}, grad_norm="
                f"{host['grad_norm']}. Stopped without saving. " + way_forward(step))
        summary["train_loss"] = host["train_loss"]
        if step == start_step + 1:
            throughput.reset(step)  # exclude compilation from tokens/s
        logged = step % config.log_every_steps == 0 or step == config.num_train_steps
        if logged:
            host.update(throughput.update(step))
            writer.write(step, host)
        writer.progress(step, host["train_loss"] if logged else None, host["learning_rate"],
                        host.get("tokens_per_sec"))

    step, pending = start_step, None
    try:
        while step < config.num_train_steps:
            batch = next(data.train)
            data_state = data.train.get_state()
            step += 1
            progress["step"] = step
            with profiler.step(step):
                state, step_metrics = train_step(state, to_device(batch))
            profiler.after_step(step, state)
            if pending is not None:
                process(*pending)
            pending = (step, step_metrics)

            preempted = preemption.reached(step)
            final = step == config.num_train_steps
            if preempted or final or step % config.checkpoint_every_steps == 0:
                process(*pending)  # never checkpoint a non-finite state
                pending = None
                # A finite loss does not make the updated state finite (e.g. an overflowing step).
                if not bool(state_is_finite(state)):
                    raise FloatingPointError(
                        f"The parameters or optimizer state became non-finite in step {step} (its "
                        "loss and gradient were finite); stopped without saving. " + way_forward())
                checkpointer.save(step, state, data_state, wait=preempted or final)
                last_saved = step
            if config.eval_every_steps and (step % config.eval_every_steps == 0 or final):
                if pending is not None:
                    process(*pending)
                    pending = None
                eval_metrics = evaluate(state.params)
                if eval_metrics:
                    logging.info("step %d: %s", step, metrics_lib.describe(eval_metrics))  # eval_tokens too
                    writer.write(step, eval_metrics)
                    summary.update(eval_metrics)
                throughput.reset(step)
            if preempted:
                logging.warning(preemption.saved_line(step))
                summary.update(preempted=True, stopped_by=interrupts.name(preemption.signum or signal.SIGTERM))
                break
        if pending is not None:
            process(*pending)
    finally:
        profiler.close()
        try:
            writer.close()
            wandb_run.finish()
        finally:
            checkpointer.close()  # also when closing the writer failed (e.g. a full disk)
    summary["step"] = step
    return summary
