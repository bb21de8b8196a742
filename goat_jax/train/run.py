"""A run on disk: the workdir layout, the train state, and reading a run back (:func:`load_run`,
:func:`read_config`, :func:`read_metrics`).

The one place that knows the workdir layout (the trainer writes it, evaluations read it)::

    WORKDIR/config.json       the resolved config (CONFIG_FILE)
    WORKDIR/metrics.jsonl     one JSON row per logged step (METRICS_FILE)
    WORKDIR/tensorboard/      TensorBoard events (TENSORBOARD_DIR)
    WORKDIR/checkpoints/<N>/  orbax checkpoints: state, data-iterator state, meta (CHECKPOINT_DIR)

and, written by the checkpointer next to its directory (goat_jax/train/checkpoint.py, which
this module builds on and so cannot import the names from here)::

    WORKDIR/config_changes.jsonl    what --resume_with_changes changed, one row per resume
    WORKDIR/corrupt_checkpoints/N/  checkpoints that failed to restore, set aside (never deleted)

Reading never writes: :func:`load_run` opens the checkpoints read-only, so it is safe to
evaluate a run while it is still training (it never creates, cleans up or locks anything in
the workdir, and never touches the trainer's in-progress checkpoint).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import warnings
from typing import Any, Callable, Optional, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from goat_jax import _extras
from goat_jax.kernels.plan import AttentionPlan
with _extras.imports(__name__):  # optional packages: one-line error naming the extra
    import ml_collections
    import optax
from flax import struct

from goat_jax.train import checkpoint as checkpoint_lib
from goat_jax.train import optim
from goat_jax.train import tasks as tasks_lib
from goat_jax.train import validation

CONFIG_FILE = "config.json"
METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
CHECKPOINT_DIR = "checkpoints"


def config_path(workdir: str) -> str:
    """``WORKDIR/config.json``."""
    return os.path.join(workdir, CONFIG_FILE)


def metrics_path(workdir: str) -> str:
    """``WORKDIR/metrics.jsonl``."""
    return os.path.join(workdir, METRICS_FILE)


def tensorboard_dir(workdir: str) -> str:
    """``WORKDIR/tensorboard``."""
    return os.path.join(workdir, TENSORBOARD_DIR)


def checkpoint_dir(workdir: str) -> str:
    """``WORKDIR/checkpoints``."""
    return os.path.join(workdir, CHECKPOINT_DIR)


def is_run_dir(path: str) -> bool:
    """Whether ``path`` is a trainer's workdir: its ``config.json`` names a task, or its
    ``checkpoints/`` holds a step (a stray config.json of another tool does not count)."""
    try:
        with open(config_path(path)) as f:
            if "task" in json.load(f):
                return True
    except (OSError, ValueError, TypeError):
        pass
    directory = checkpoint_dir(path)
    return os.path.isdir(directory) and any(d.isdigit() for d in os.listdir(directory))


def check_output_dir(out: str, writer: str, suffix: str) -> None:
    """Refuses, before any work, an ``--out`` folder that cannot take a tool's results: an
    existing path that is not a directory, a directory (or its nearest existing parent) that is
    not writable, or a place inside a run's workdir (:func:`is_run_dir`, or any folder below one:
    no tool writes into a run, which may still be training, beside its checkpoints). The one
    check of ``experiments.evaluate``, ``experiments.compile`` and ``experiments.probe_extrapolation``.

    Args:
      out: the ``--out`` folder (created later if missing).
      writer: what would write there, for the message (e.g. ``'evaluation'``).
      suffix: appended to the run's path in the suggested ``--out`` (e.g. ``'_eval'``).

    Raises:
      ValueError: naming ``--out`` and the fix.
    """
    from goat_jax import files  # pylint: disable=g-import-not-at-top  # on use only

    path = os.path.abspath(out)
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"--out {out} exists and is not a directory; give a directory (it is "
                         f"created if missing), e.g. --out {out}{suffix}.")
    probe = path
    while True:
        if is_run_dir(probe):
            raise ValueError(f"--out {out} is inside the run workdir {probe}; {writer} never "
                             "writes into a run (it may still be training). Use a directory "
                             f"outside it, e.g. --out {os.path.normpath(probe)}{suffix}.")
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    files.check_writable(out, "--out")  # a real write probe: permission bits say nothing for root


# ----------------------------------------------------------------------------------------------
# Train state
# ----------------------------------------------------------------------------------------------


@struct.dataclass
class TrainState:
    """Everything a step updates: the update count, the parameters and the optimizer state."""

    step: jax.Array
    params: Any
    opt_state: Any


# ``config.optimizer.decay_grouping`` meaning "the task's no_decay_names rule": the schema's
# default (goat_jax/train/validation.py), so also what a config without the field means.
DEFAULT_DECAY_GROUPING = validation.ENGINE["optimizer"].default("decay_grouping")


def make_optimizer(task: tasks_lib.Task, config: Any) -> Tuple[optax.GradientTransformation, optax.Schedule]:
    """``(tx, schedule)`` of ``config.optimizer`` over ``config.num_train_steps``, with the
    task's weight-decay exclusions, or the task's grouping named by the optional
    ``config.optimizer.decay_grouping``."""
    grouping = validation.ENGINE["optimizer"].value(config.optimizer, "decay_grouping")
    mask = None if grouping == DEFAULT_DECAY_GROUPING else task.decay_groupings[grouping]
    return optim.make_optimizer(config.optimizer, config.num_train_steps, task.no_decay_names,
                                mask=mask)


def make_init_fns(task: tasks_lib.Task, model: nn.Module, tx: optax.GradientTransformation, config: Any,
                  batch_size: int) -> Tuple[Callable[[jax.Array], Any], Callable[[jax.Array], TrainState]]:
    """``(init_params, init_state)``, both ``rng -> ...``.

    ``init_params`` returns the *boxed* params (logical names kept, for
    :func:`goat_jax.train.sharding.logical_shardings`); ``init_state`` the unboxed
    :class:`TrainState` at step 0. Both trace the model on a dummy batch of ``batch_size`` rows
    (pick one that splits evenly over the batch shards); XLA drops the forward pass since only
    the parameters are returned. The model carries the run's attention plan (its task built it
    from ``config``), so its attention is traced (and its kernel chosen) as in the train step: at
    a million tokens over a TPU slice, an all-gather trace with splash would process T x S masks
    for nothing.
    """
    inputs = task.model_inputs(task.dummy_batch(config, batch_size))

    def init_params(rng):
        return model.init(rng, *inputs)["params"]

    def init_state(rng):
        params = nn.unbox(init_params(rng))
        return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))

    return init_params, init_state


# ----------------------------------------------------------------------------------------------
# Reading a run back
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Run:
    """A trained model read back from its workdir."""

    workdir: str
    config: ml_collections.ConfigDict  # the resolved config the run wrote (config.json)
    task: tasks_lib.Task  # config.task, loaded
    model: Any  # the Linen model
    params: Any  # the 'params' collection, unboxed, on the default device
    step: int  # the checkpoint's step
    plan: AttentionPlan  # the run's attention plan (the model's), built once by load_run


def read_config(workdir: str) -> ml_collections.ConfigDict:
    """The resolved config a run wrote; FileNotFoundError if ``workdir`` is not a run, ValueError
    naming the file when it is there but not a JSON object."""
    path = config_path(workdir)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} not found: {workdir} is not a run of experiments.train.")
    try:
        with open(path, encoding="utf-8") as f:
            values = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is unreadable ({type(e).__name__}: {e}): the run's resolved config "
                         "(the trainer writes it whole at the start of every run; the same train "
                         "command rewrites it).") from None
    if not isinstance(values, dict):
        raise ValueError(f"{path} holds a JSON {type(values).__name__}, not the run's config.")
    return ml_collections.ConfigDict(values)


def read_metrics(workdir: str) -> list[dict]:
    """The rows of a run's ``metrics.jsonl`` (training rows, eval rows), in order. Safe while the
    run is training: the trainer flushes each row. A last line torn by a kill mid-write (or still
    being written) is skipped; an unreadable line before it is skipped with a warning naming the
    file and the line."""
    rows, path = [], metrics_path(workdir)
    with open(path) as f:
        lines = [line for line in f if line.strip()]
    for number, line in enumerate(lines, 1):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if number < len(lines):
                warnings.warn(f"{path}: line {number} of {len(lines)} is not JSON and is skipped.",
                              UserWarning, stacklevel=2)
    return rows


def training_seconds(workdir: str) -> float:
    """Wall time of a run's training: the largest ``elapsed_s`` in its metrics (0.0 if none),
    so a report regenerated later from the workdir still shows the original time."""
    return max((float(row.get("elapsed_s") or 0.0) for row in read_metrics(workdir)), default=0.0)


def last_logged(workdir: str, key: str) -> Optional[float]:
    """The value of ``key`` (e.g. ``'eval_loss'``) in the last row of a run's metrics that has
    it, or None when no row has it (or the run has no metrics yet)."""
    if not os.path.exists(metrics_path(workdir)):
        return None
    values = [float(row[key]) for row in read_metrics(workdir) if row.get(key) is not None]
    return values[-1] if values else None


def median_throughput(workdir: str) -> Optional[float]:
    """Median ``tokens_per_sec`` over a run's training rows (tokens/s for language and genome
    models, images/s for ViTs), or None when no row has it."""
    rates = sorted(float(r["tokens_per_sec"]) for r in read_metrics(workdir) if r.get("tokens_per_sec"))
    return rates[len(rates) // 2] if rates else None


def checkpoint_steps(workdir: str) -> tuple[int, ...]:
    """The steps of ``workdir``'s complete checkpoints, ascending (read-only; () if none)."""
    directory = checkpoint_dir(workdir)
    if not os.path.isdir(directory):
        return ()
    config = read_config(workdir)
    task = tasks_lib.get_task(config.task)
    ckpt = checkpoint_lib.Checkpointer(directory, config.to_dict(), keep=int(config.keep_checkpoints),
                                       async_save=False, resume_safe_fields=task.resume_safe_fields,
                                       field_defaults=tasks_lib.field_defaults(task), read_only=True)
    try:
        return ckpt.all_steps()
    finally:
        ckpt.close()


def load_run(workdir: str, step: Optional[int] = None) -> Run:
    """Restores the params of ``workdir``'s checkpoint at ``step`` (default: the newest one
    that restores: a damaged newer one is skipped with a warning, as the trainer does on
    resume, and left in place), read-only.

    The abstract train state is built exactly as the trainer builds it (task model, optimizer,
    :class:`TrainState`) so the checkpoint restores onto the default device; the optimizer state
    is read too and dropped. Safe while the run is still training (nothing in ``workdir`` is
    written, removed or locked). Raises FileNotFoundError if there is no config or no complete
    checkpoint.
    """
    config = read_config(workdir)
    task = tasks_lib.get_task(config.task)
    config = tasks_lib.with_field_defaults(config, task)  # an older run lacks newer fields
    plan = AttentionPlan.from_config(config)  # the evaluation's one plan: the model's, kept on the Run
    model = task.build_model(config, plan)
    tx, _ = make_optimizer(task, config)
    _, init_state = make_init_fns(task, model, tx, config, batch_size=1)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device),
                            jax.eval_shape(init_state, jax.random.PRNGKey(0)))
    directory = checkpoint_dir(workdir)
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"{directory} does not exist: the run has not saved a checkpoint yet.")
    ckpt = checkpoint_lib.Checkpointer(directory, config.to_dict(), keep=int(config.keep_checkpoints),
                                       async_save=False, resume_safe_fields=task.resume_safe_fields,
                                       field_defaults=tasks_lib.field_defaults(task), read_only=True)
    try:
        if step is not None:
            state, _ = ckpt.restore(step, abstract)
        else:  # the newest that restores, damaged newer ones skipped with a warning and left in place
            newest = ckpt.latest_step()
            step, state, _ = ckpt.restore_latest(abstract)
            if step is None:
                raise FileNotFoundError(f"{directory} holds no complete checkpoint yet.")
            if step != newest:
                logging.warning("evaluating step %d, the newest checkpoint in %s that restores (skipped: "
                                "newer ones up to step %s).", step, directory, newest)
    finally:
        ckpt.close()
    return Run(workdir=workdir, config=config, task=task, model=model, params=state.params, step=int(step), plan=plan)
