"""The training engine: one function, :func:`train_and_evaluate`, readable top to bottom.

    config -> validate -> mesh -> data -> model + optimizer -> sharded init (or restore)
           -> jitted train step -> loop { step, log, eval, checkpoint } -> metrics + checkpoints

What is trained is chosen by ``config.task`` (:mod:`goat_jax.train.tasks`): the task supplies the
model, the data, the loss and its config schema; this file never imports a model or a dataset.
Helpers live in their own modules: :mod:`~goat_jax.train.sharding` (mesh, logical rules),
:mod:`~goat_jax.train.optim` (AdamW, schedule, accumulation), :mod:`~goat_jax.train.checkpoint`,
:mod:`~goat_jax.train.metrics`.

Workdir layout: ``config.json`` (the resolved config), ``metrics.jsonl``, ``tensorboard/``,
``checkpoints/<step>/``. Re-running the same command resumes from the latest checkpoint and
reproduces the uninterrupted run's per-step losses (data-iterator state is checkpointed too).

Engine config fields (the task adds ``model.*``, ``data.*`` and its own, e.g. ``seq_len``):
  seed, task, num_train_steps, global_batch_size | per_device_batch_size (exactly one),
  grad_accum_steps, log_every_steps, eval_every_steps (0: never), checkpoint_every_steps,
  keep_checkpoints, mesh.{data,fsdp,tensor} (-1: the rest), sharding_rules, optimizer.{
  learning_rate, warmup_steps, min_lr_ratio, b1, b2, eps, weight_decay, grad_clip},
  distributed, progress_bar, peak_flops_per_device (0: look up by device kind).
"""

from __future__ import annotations

import difflib
import json
import logging
import math
import os
import signal
import threading
from typing import Any, Dict

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import struct

from goat_jax.train import checkpoint as checkpoint_lib
from goat_jax.train import metrics as metrics_lib
from goat_jax.train import optim
from goat_jax.train import sharding as sharding_lib
from goat_jax.train import tasks as tasks_lib
from goat_jax.train import validation

# ----------------------------------------------------------------------------------------------
# Config validation: every check names the field and the fix, and runs before any work
# ----------------------------------------------------------------------------------------------

ENGINE_SCHEMA = {
    "": {"seed", "task", "num_train_steps", "global_batch_size", "per_device_batch_size",
         "grad_accum_steps", "log_every_steps", "eval_every_steps", "checkpoint_every_steps",
         "keep_checkpoints", "mesh", "sharding_rules", "optimizer", "distributed", "progress_bar",
         "peak_flops_per_device", "model", "data"},
    "mesh": set(sharding_lib.MESH_AXES),
    "optimizer": {"learning_rate", "warmup_steps", "min_lr_ratio", "b1", "b2", "eps",
                  "weight_decay", "grad_clip"},
}


def _check_fields(section: str, present: set, allowed: set, required: bool) -> None:
    prefix = f"{section}." if section else ""
    for name in sorted(present - allowed):
        close = difflib.get_close_matches(name, sorted(allowed), n=1)
        hint = f" Did you mean {prefix}{close[0]}?" if close else ""
        raise ValueError(f"Unknown config field {prefix}{name}.{hint} Known fields of "
                         f"{section or 'the top level'}: {sorted(allowed)}.")
    if required and allowed - present:
        missing = sorted(allowed - present)
        raise ValueError(f"Config is missing field(s) {[prefix + m for m in missing]}; add them "
                         "to the config file (see goat_jax/train/trainer.py for their meaning).")


def validate_config(config: ml_collections.ConfigDict, num_devices: int, process_count: int = 1) -> int:
    """Checks ``config`` against the engine's and the task's schema and the device layout.

    Returns the resolved global batch size. Raises ValueError naming the offending field (unknown
    fields, mesh vs device count, batch divisibility, sequence length vs model limits).
    """
    task = tasks_lib.get_task(config.get("task"))
    top = set(config.keys())
    _check_fields("", top, ENGINE_SCHEMA[""] | set(task.top_level_fields), required=True)
    for section in ("mesh", "optimizer"):
        _check_fields(section, set(config[section].keys()), ENGINE_SCHEMA[section], required=True)
    for section, allowed in task.schema().items():
        _check_fields(section, set(config[section].keys()), allowed, required=False)

    # Type and range of every field the engine and the task declare (goat_jax/train/validation.py).
    validation.check_config(config, validation.ENGINE_FIELDS)
    validation.check_config(config, task.field_specs(config))

    mesh_shape = sharding_lib.mesh_shape(config.mesh, num_devices)  # raises naming mesh.*
    sharding_lib.rules_from_config(config.sharding_rules)
    batch_shards = mesh_shape[0] * mesh_shape[1]

    gbs, pdbs = config.global_batch_size, config.per_device_batch_size
    if (gbs is None) == (pdbs is None):
        raise ValueError("Set exactly one of global_batch_size and per_device_batch_size (the other "
                         f"None); got global_batch_size={gbs}, per_device_batch_size={pdbs}.")
    field = "global_batch_size" if gbs is not None else "per_device_batch_size"
    if int(config[field]) < 1:
        raise ValueError(f"{field}={config[field]} must be >= 1.")
    global_batch = int(gbs) if gbs is not None else int(pdbs) * num_devices
    accum = config.grad_accum_steps
    if global_batch % (batch_shards * accum):
        raise ValueError(
            f"{field}={config[field]} gives a global batch of {global_batch}, which must be "
            f"divisible by mesh.data * mesh.fsdp * grad_accum_steps = {mesh_shape[0]} * "
            f"{mesh_shape[1]} * {accum} = {batch_shards * accum} (each microbatch is split over the "
            f"data and fsdp axes). Change {field}, grad_accum_steps or the mesh.")
    if global_batch % process_count:
        raise ValueError(f"{field}: global batch {global_batch} must be divisible by the "
                         f"{process_count} processes.")
    task.validate(config)
    return global_batch


# ----------------------------------------------------------------------------------------------
# Train state and steps
# ----------------------------------------------------------------------------------------------


@struct.dataclass
class TrainState:
    """Everything a step updates: the update count, the parameters and the optimizer state."""

    step: jax.Array
    params: Any
    opt_state: Any


def make_train_step(task: tasks_lib.Task, model: nn.Module, tx: optax.GradientTransformation,
                    schedule: optax.Schedule, grad_accum_steps: int):
    """``train_step(state, batch) -> (state, metrics)``: loss normalized by the total weight of
    the whole global batch (exact under gradient accumulation), AdamW update, and the metrics
    ``train_loss``, ``grad_norm`` (before clipping), ``learning_rate`` (of this update)."""
    def loss_fn(params, batch):
        return task.loss(model.apply, params, batch)

    def train_step(state: TrainState, batch):
        loss_sum, weight_sum, grads = optim.accumulate_gradients(loss_fn, state.params, batch, grad_accum_steps)
        denom = jnp.where(weight_sum > 0, weight_sum, 1.0)
        grads = jax.tree.map(lambda g: g / denom.astype(g.dtype), grads)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {"train_loss": loss_sum / denom, "grad_norm": optax.global_norm(grads),
                   "learning_rate": schedule(state.step)}
        return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics

    return train_step


def make_eval_step(task: tasks_lib.Task, model: nn.Module, num_microbatches: int):
    """``eval_step(params, batch) -> (loss_sum, weight_sum)``, over microbatches like training
    so that eval never needs more activation memory than a training microbatch."""
    def eval_step(params, batch):
        def one(carry, mb):
            loss, (weight, _) = task.loss(model.apply, params, mb)
            return (carry[0] + loss, carry[1] + weight), None
        micro = jax.tree.map(lambda x: optim.split_microbatches(x, num_microbatches), batch)
        zero = jnp.zeros((), jnp.float32)
        return jax.lax.scan(one, (zero, zero), micro)[0]
    return eval_step


# ----------------------------------------------------------------------------------------------
# Preemption: SIGTERM -> checkpoint at the end of the current step, then exit cleanly
# ----------------------------------------------------------------------------------------------


class _Preemption:
    """Notices SIGTERM. Single process: our own handler. Multi-process: JAX's coordination
    service (installed by ``jax.distributed.initialize``) so that all hosts stop at the same
    step."""

    def __init__(self):
        self.requested = False
        self._multi = jax.process_count() > 1
        self._previous = None
        # Python delivers signals to the main thread only (a trainer run from a worker thread
        # keeps the default SIGTERM behaviour; the last checkpoint is then the resume point).
        if not self._multi and threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame):  # pylint: disable=unused-argument
        self.requested = True

    def reached(self, step: int) -> bool:
        """Whether to checkpoint and stop after ``step``."""
        if self._multi:
            from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
            return bool(multihost_utils.reached_preemption_sync_point(step))
        return self.requested

    def restore(self) -> None:
        """Reinstalls the previous SIGTERM handler."""
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)


# ----------------------------------------------------------------------------------------------
# The run
# ----------------------------------------------------------------------------------------------


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str, *,
                       resume_with_changes: bool = False) -> Dict[str, Any]:
    """Trains (or resumes) ``config`` in ``workdir``; returns a summary dict with the last step,
    ``train_loss``, ``eval_loss`` (if evaluated) and ``preempted``.

    ``resume_with_changes``: resume even if the fields of
    ``checkpoint.RESUME_ADJUSTABLE_FIELDS`` (the optimizer's, ``num_train_steps``) differ from
    the checkpoint's; the change is recorded in ``workdir/config_changes.jsonl``.

    Raises ValueError on an invalid config (before any work), IncompatibleCheckpointError when the
    workdir holds another config's checkpoint, FloatingPointError on a non-finite loss, gradient
    or state (only finite states are saved; the last one is kept).
    """
    # --- Setup ----------------------------------------------------------------------------------
    if config.distributed:
        jax.distributed.initialize()
    global_batch = validate_config(config, jax.device_count(), jax.process_count())
    task = tasks_lib.get_task(config.task)
    resolved = ml_collections.ConfigDict(config.to_dict())  # resolves FieldReferences
    resolved.global_batch_size = global_batch
    config_dict = resolved.to_dict()
    is_primary = jax.process_index() == 0
    accum = config.grad_accum_steps

    os.makedirs(workdir, exist_ok=True)  # only now that the config is valid
    checkpointer = checkpoint_lib.Checkpointer(os.path.join(workdir, "checkpoints"), config_dict,
                                               keep=config.keep_checkpoints)
    changes = checkpointer.check_compatible(allow_changes=resume_with_changes)  # before writing
    if is_primary:
        with open(os.path.join(workdir, "config.json"), "w") as f:
            json.dump(config_dict, f, indent=2, default=str)

    # --- Mesh -----------------------------------------------------------------------------------
    mesh = sharding_lib.make_mesh(config.mesh)
    rules = sharding_lib.rules_from_config(config.sharding_rules)
    logging.info("mesh %s over %d devices (%s)", dict(mesh.shape), mesh.size, jax.devices()[0].device_kind)

    # --- Data -----------------------------------------------------------------------------------
    data = task.make_datasets(config, global_batch, jax.process_index(), jax.process_count())
    dummy = task.dummy_batch(config, global_batch // jax.process_count())
    batch_shardings = {k: sharding_lib.batch_sharding(mesh, np.ndim(v)) for k, v in dummy.items()}

    def to_device(local_batch):
        missing = set(task.batch_keys) - set(local_batch)
        if missing:
            raise ValueError(f"task {task.name!r} needs batch keys {sorted(missing)}; the data gave {sorted(local_batch)}.")
        return {k: jax.make_array_from_process_local_data(batch_shardings[k], local_batch[k])
                for k in batch_shardings}

    # --- Model + optimizer ----------------------------------------------------------------------
    model = task.build_model(config)
    tx, schedule = optim.make_optimizer(config.optimizer, config.num_train_steps)
    # Init traces the model on a batch that splits evenly over the batch shards; XLA drops the
    # forward pass since only the parameters are returned.
    init_inputs = task.model_inputs(task.dummy_batch(config, sharding_lib.data_parallel_size(mesh)))

    def init_params(rng):
        return model.init(rng, *init_inputs)["params"]

    def init_state(rng):
        params = nn.unbox(init_params(rng))
        return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))

    # --- Sharded init (or restore) ----------------------------------------------------------------
    # Shardings come from the boxes' logical names (sharding.logical_shardings) and are imposed by
    # jit's in/out_shardings; XLA propagates them to the activations. No global mesh is set, so
    # the model's nn.with_logical_constraint calls are no-ops: under a global mesh Flax also
    # constrains each boxed kernel while its initializer runs (in init and in apply's shape
    # check), which fails for DenseGeneral's flattened [E, N * H] init of the attention kernels.
    rng = jax.random.PRNGKey(config.seed)
    param_shardings = sharding_lib.logical_shardings(jax.eval_shape(init_params, rng), mesh, rules)
    abstract_state = jax.eval_shape(init_state, rng)
    state_shardings = TrainState(
        step=sharding_lib.replicated(mesh), params=param_shardings,
        opt_state=sharding_lib.optimizer_shardings(tx, abstract_state.opt_state, param_shardings, mesh))
    abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                            abstract_state, state_shardings)
    start_step, state, data_state = checkpointer.restore_latest(abstract)  # skips damaged ones
    start_step = start_step or 0
    if start_step:
        data.train.set_state(data_state)
        logging.info("resumed from step %d", start_step)
        if changes and is_primary:
            path = checkpointer.record_changes(start_step, changes)
            logging.warning("resumed with changed %s (recorded in %s)", ", ".join(
                f"{k}: {old!r} -> {new!r}" for k, (old, new) in changes.items()), path)
    else:
        state = jax.jit(init_state, out_shardings=state_shardings)(rng)
    num_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(abstract_state.params))
    logging.info("%s: %.2fM parameters", task.name, num_params / 1e6)

    # --- Train step: jitted with explicit shardings, the old state donated ------------------------
    replicated = sharding_lib.replicated(mesh)
    train_step = jax.jit(make_train_step(task, model, tx, schedule, accum),
                         in_shardings=(state_shardings, batch_shardings),
                         out_shardings=(state_shardings, replicated), donate_argnums=0)

    # One fused reduction on device, run only before a save; the host reads back a single bool.
    state_is_finite = jax.jit(lambda st: jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(st)
                                                           if jnp.issubdtype(x.dtype, jnp.inexact)])),
                              in_shardings=(state_shardings,), out_shardings=replicated)

    # --- Eval -------------------------------------------------------------------------------------
    eval_step = jax.jit(make_eval_step(task, model, accum),
                        in_shardings=(param_shardings, batch_shardings), out_shardings=replicated)

    def evaluate(params) -> Dict[str, float]:
        if data.make_eval is None:
            return {}
        loss_sum, weight_sum = 0.0, 0.0
        for batch in data.make_eval():
            l, w = eval_step(params, to_device(batch))
            loss_sum, weight_sum = loss_sum + l, weight_sum + w  # stays on device until the end
        loss_sum, weight_sum = float(loss_sum), float(weight_sum)
        if not weight_sum:
            return {}
        mean = loss_sum / weight_sum
        return {"eval_loss": mean, **task.eval_summary(mean)}

    # --- Loop -------------------------------------------------------------------------------------
    # Step s uses the s-th batch and the params after s - 1 updates; a checkpoint at s holds
    # the state after s updates and the iterator state after the s-th batch. Metrics are read
    # back one step late, so the host never waits for the device except at checkpoints.
    writer = metrics_lib.MetricsWriter(workdir, total_steps=config.num_train_steps, initial_step=start_step,
                                       enabled=is_primary, progress_bar=config.progress_bar)
    devices = jax.devices()
    peak = metrics_lib.peak_flops_per_device(devices[0].device_kind, config.peak_flops_per_device)
    throughput = metrics_lib.Throughput(
        global_batch * task.tokens_per_example(config), task.flops_per_token(config),
        peak * len(devices) if peak else None)
    preemption = _Preemption()
    summary: Dict[str, Any] = {"step": start_step, "preempted": False, "num_params": num_params}
    last_saved = start_step if start_step else None

    def way_forward() -> str:
        if last_saved:
            return (f"The last finite checkpoint (step {last_saved}) is kept in "
                    f"{checkpointer.directory}. To continue from it, rerun the same command adding "
                    "--resume_with_changes --config.optimizer.learning_rate=<lower> (other "
                    "optimizer.* fields, e.g. grad_clip, may change too; see README 'What happens "
                    "when things go wrong').")
        return ("No checkpoint was saved; rerun the same command adding "
                "--config.optimizer.learning_rate=<lower> (or a positive optimizer.grad_clip).")

    def process(step: int, device_metrics) -> None:
        host = {k: float(v) for k, v in jax.device_get(device_metrics).items()}
        if not (math.isfinite(host["train_loss"]) and math.isfinite(host["grad_norm"])):
            writer.write(step, host)
            raise FloatingPointError(
                f"Non-finite training at step {step}: train_loss={host['train_loss']}, grad_norm="
                f"{host['grad_norm']}. Stopped without saving. " + way_forward())
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
            state, step_metrics = train_step(state, to_device(batch))
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
                    writer.write(step, eval_metrics)
                    summary.update(eval_metrics)
                throughput.reset(step)
            if preempted:
                logging.warning("SIGTERM: saved a checkpoint at step %d; exiting.", step)
                summary["preempted"] = True
                break
        if pending is not None:
            process(*pending)
    finally:
        preemption.restore()
        writer.close()
        checkpointer.close()
    summary["step"] = step
    return summary
