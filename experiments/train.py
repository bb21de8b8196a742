"""Train (or resume) a model from a config file.

    python -m experiments.train --config configs/lm_tiny.py[:arg] --workdir DIR [--config.x=y ...]

Re-running the same command resumes from DIR's latest checkpoint. See goat_jax/train/trainer.py.
SIGTERM, Ctrl-C and SIGHUP save a checkpoint at the end of the current step and stop, with one
line (exit 0 for SIGTERM, 130 for Ctrl-C, 129 for SIGHUP); a second Ctrl-C exits at once without
saving (docs/training.md, "Stopping a run").
``--resume_with_changes`` lets the optimizer fields and ``num_train_steps`` differ from the
checkpoint's (e.g. a lower learning rate after a non-finite loss); the change is recorded in
DIR/config_changes.jsonl. Errors in the config or inputs print one line (``GOAT_DEBUG=1``: the
traceback) and leave no new DIR behind.

Multi-process (one process per host, every process runs the same command):

    # TPU pod slice / SLURM: the cluster is detected
    python -m experiments.train --config ... --workdir gs://bucket/run --config.distributed=True
    # explicit (e.g. two CPU processes on one machine)
    python -m experiments.train --config ... --workdir DIR --coordinator_address host0:12345 \
        --num_processes 2 --process_id {0,1}

The workdir must be one shared directory (a bucket or a shared filesystem): every process
writes its part of each checkpoint there.
"""

import logging as py_logging
import os
import signal
import sys

from goat_jax import _extras
with _extras.imports(__name__):  # the 'train' extra: one line naming it if absent
    from absl import app
    from absl import flags
    from absl import logging
from goat_jax import cli
from goat_jax.config import files as config_files
from goat_jax.train import interrupts
from goat_jax.train import sharding
from goat_jax.train import trainer

_CONFIG = config_files.define_config_flag("config", None, "Config file, e.g. configs/lm_tiny.py:rope.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory (checkpoints, metrics, config.json).")
_RESUME_WITH_CHANGES = flags.DEFINE_bool(
    "resume_with_changes", False, "Resume although optimizer.* or num_train_steps differ from the "
    "checkpoint's (recorded in WORKDIR/config_changes.jsonl).")
_COORDINATOR = flags.DEFINE_string(
    "coordinator_address", None, "host:port of process 0 for jax.distributed.initialize (multi-process); "
    "omit to let JAX detect the cluster (TPU pods, SLURM) when --config.distributed=True.")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Number of processes (with --coordinator_address).")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's index in [0, num_processes).")
flags.mark_flags_as_required(["config", "workdir"])


class _QuietLibraries(py_logging.Filter):
    """Drops INFO records of orbax and etils (dozens per checkpoint) so the progress bar and the
    trainer's own messages stay readable; their warnings and errors pass."""

    def filter(self, record: py_logging.LogRecord) -> bool:
        path = record.pathname.replace(os.sep, "/")
        return record.levelno >= py_logging.WARNING or not ("/orbax/" in path or "/etils/" in path)


def main(argv):
    """Entry point: trains ``--config`` in ``--workdir``."""
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    logging.get_absl_handler().addFilter(_QuietLibraries())
    explicit = (_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value)
    if any(v is not None for v in explicit) or _CONFIG.value.distributed:
        # Before anything touches a device: the backends are created by initialize.
        sharding.initialize_distributed(*explicit)
    with cli.workdir_cleanup(_WORKDIR.value):  # the trainer creates it once the config is valid
        summary = trainer.train_and_evaluate(_CONFIG.value, _WORKDIR.value,
                                             resume_with_changes=_RESUME_WITH_CHANGES.value)
    logging.info("done: %s", summary)
    stopped = summary.get("stopped_by")
    if stopped in ("SIGINT", "SIGHUP"):  # saved (one line logged); a shell's status for the signal
        sys.exit(interrupts.exit_code(signal.Signals[stopped]))


if __name__ == "__main__":
    from goat_jax import platforms  # pylint: disable=g-import-not-at-top
    platforms.avoid_libtpu_without_tpu()  # before any JAX backend starts (goat_jax/platforms.py)
    cli.run_absl(main)
