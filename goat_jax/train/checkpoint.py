"""Checkpoints: train state + data-iterator state + step, with a config fingerprint.

One orbax ``CheckpointManager`` under ``WORKDIR/checkpoints`` with three items per step:

* ``state``  -- the (sharded) train state, saved asynchronously: training continues while it is
  written; restored straight onto the current mesh, which may differ from the saving one.
* ``data``   -- each host's data-iterator state (JSON), one file per process, captured when the
  step's batch was drawn, so a resumed run sees exactly the batches an uninterrupted one would.
* ``meta``   -- the step, the config fingerprint and the fingerprinted config.

Orbax writes each step into a temporary directory and renames it when complete, so a run
killed mid-save (even by SIGKILL) leaves the previous checkpoints intact; leftovers are
removed at the next start. The fingerprint is checked before anything is written: a workdir
whose checkpoint came from an incompatible config raises :class:`IncompatibleCheckpointError`
naming the differing fields, instead of silently resuming (or overwriting) someone else's run.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from typing import Any, Dict, Iterable, Optional, Tuple

import jax
import orbax.checkpoint as ocp
from etils import epath

# Engine fields that may change between a run and its resumption without changing what is
# computed: cadences, the device layout (the state is resharded on restore) and the batch split
# over devices (the resolved global_batch_size is what is fingerprinted). A task adds its own
# (``Task.resume_safe_fields``, e.g. kernels and rematerialization).
RESUME_SAFE_FIELDS = frozenset({
    "checkpoint_every_steps", "eval_every_steps", "log_every_steps", "keep_checkpoints", "mesh",
    "sharding_rules", "distributed", "progress_bar", "peak_flops_per_device",
    "per_device_batch_size",
})


class IncompatibleCheckpointError(ValueError):
    """The workdir holds a checkpoint written under a different config."""


# ----------------------------------------------------------------------------------------------
# Config fingerprint
# ----------------------------------------------------------------------------------------------


def _flatten(tree: Dict[str, Any], prefix: str = "") -> Dict[str, Any]:
    out = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flatten(value, name + "."))
        else:
            out[name] = value
    return out


def fingerprint_fields(config_dict: Dict[str, Any], resume_safe_fields: Iterable[str] = ()) -> Dict[str, Any]:
    """The flattened ``{'a.b': value}`` fields of a resolved config that a checkpoint depends
    on (everything except :data:`RESUME_SAFE_FIELDS` and the task's ``resume_safe_fields``),
    JSON-normalized (tuples -> lists)."""
    safe = RESUME_SAFE_FIELDS | frozenset(resume_safe_fields)
    flat = _flatten(json.loads(json.dumps(config_dict, default=str)))
    return {k: v for k, v in sorted(flat.items()) if k not in safe and k.split(".")[0] not in safe}


def config_fingerprint(config_dict: Dict[str, Any], resume_safe_fields: Iterable[str] = ()) -> str:
    """A short hash of :func:`fingerprint_fields`."""
    blob = json.dumps(fingerprint_fields(config_dict, resume_safe_fields), sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


# ----------------------------------------------------------------------------------------------
# Data-iterator state: one JSON file per process (orbax's JsonSave writes on the primary only)
# ----------------------------------------------------------------------------------------------


class _DataStateHandler(ocp.CheckpointHandler):
    """Writes/reads ``process_{i}-of-{n}.json`` holding this host's iterator state."""

    def _file(self, directory: epath.Path) -> epath.Path:
        return directory / f"process_{jax.process_index()}-of-{jax.process_count()}.json"

    def save(self, directory: epath.Path, args: "DataStateSave"):
        directory.mkdir(parents=True, exist_ok=True)
        self._file(directory).write_text(json.dumps(args.state))

    def restore(self, directory: epath.Path, args: Optional["DataStateRestore"] = None) -> Any:
        path = self._file(directory)
        if not path.exists():
            raise IncompatibleCheckpointError(
                f"{path} is missing: the checkpoint was written by a different number of processes "
                f"than the {jax.process_count()} now running; resume with the same process count.")
        return json.loads(path.read_text())

    def metadata(self, directory: epath.Path) -> Any:
        return None

    def finalize(self, directory: epath.Path) -> None:
        pass

    def close(self) -> None:
        pass


@ocp.args.register_with_handler(_DataStateHandler, for_save=True)
@dataclasses.dataclass
class DataStateSave(ocp.args.CheckpointArgs):
    """Args saving one host's data-iterator state (any JSON-serializable value)."""
    state: Any


@ocp.args.register_with_handler(_DataStateHandler, for_restore=True)
@dataclasses.dataclass
class DataStateRestore(ocp.args.CheckpointArgs):
    """Args restoring one host's data-iterator state."""


# ----------------------------------------------------------------------------------------------
# The checkpointer
# ----------------------------------------------------------------------------------------------


class Checkpointer:
    """Saves and restores ``(state, data_state)`` at integer steps under ``directory``.

    Args:
      directory: where checkpoints live (created if needed, unless ``read_only``).
      config_dict: the resolved config (a plain dict); its fingerprint is stored with every
        checkpoint and compared with the latest one's by :meth:`check_compatible`.
      keep: keep the last ``keep`` checkpoints.
      async_save: write the train state in a background thread.
      resume_safe_fields: the task's fields left out of the fingerprint.
      read_only: for readers of a run that may still be training (evaluation): never creates,
        writes, deletes or cleans up anything under ``directory`` -- in particular not the
        trainer's in-progress temporary checkpoint -- and :meth:`save` raises. The directory
        must exist (FileNotFoundError otherwise).
    """

    def __init__(self, directory: str, config_dict: Dict[str, Any], *, keep: int = 3, async_save: bool = True,
                 resume_safe_fields: Iterable[str] = (), read_only: bool = False):
        self.directory = os.path.abspath(directory)
        self.read_only = read_only
        self.fields = fingerprint_fields(config_dict, resume_safe_fields)
        self.fingerprint = config_fingerprint(config_dict, resume_safe_fields)
        if read_only and not os.path.isdir(self.directory):
            raise FileNotFoundError(f"{self.directory} does not exist: no checkpoints to read.")
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max(int(keep), 1), create=not read_only,
            # Removing unfinished tmp checkpoints is the writer's job: a reader doing it would
            # delete the save a live trainer is writing (and make that trainer fail).
            cleanup_tmp_directories=not read_only, read_only=read_only,
            enable_async_checkpointing=async_save and not read_only)
        self._manager = ocp.CheckpointManager(self.directory, item_names=("state", "data", "meta"),
                                              options=options)

    def latest_step(self) -> Optional[int]:
        """The newest complete checkpoint's step, or None."""
        return self._manager.latest_step()

    def all_steps(self) -> Tuple[int, ...]:
        """Steps of all complete checkpoints, ascending."""
        return tuple(sorted(self._manager.all_steps()))

    def _meta(self, step: int) -> Dict[str, Any]:
        restored = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        return dict(restored["meta"])

    def check_compatible(self) -> None:
        """Raises :class:`IncompatibleCheckpointError` if the latest checkpoint was saved under a
        config whose fingerprinted fields differ from this one's (listing the fields)."""
        step = self.latest_step()
        if step is None:
            return
        meta = self._meta(step)
        if meta.get("fingerprint") == self.fingerprint:
            return
        saved = meta.get("config", {})
        keys = sorted(set(saved) | set(self.fields))
        diffs = [f"  {k}: checkpoint {saved.get(k, '<absent>')!r} vs now {self.fields.get(k, '<absent>')!r}"
                 for k in keys if saved.get(k, "<absent>") != self.fields.get(k, "<absent>")]
        raise IncompatibleCheckpointError(
            f"{self.directory} holds a checkpoint (step {step}) of a different config; refusing to "
            "resume or overwrite it. Differing fields:\n" + "\n".join(diffs[:40]) +
            "\nUse a fresh --workdir, or restore those field values to resume.")

    def save(self, step: int, state: Any, data_state: Any, *, wait: bool = False) -> bool:
        """Starts saving ``state`` (asynchronously) and ``data_state`` at ``step``; a step that
        already has a checkpoint is skipped. ``wait`` blocks until it is on disk. Returns
        whether a save was started."""
        if self.read_only:
            raise PermissionError(f"Checkpointer({self.directory}) is read-only; cannot save step {step}.")
        if step in self._manager.all_steps():
            if wait:
                self.wait()
            return False
        meta = {"step": int(step), "fingerprint": self.fingerprint, "config": self.fields}
        self._manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), data=DataStateSave(data_state),
            meta=ocp.args.JsonSave(meta)), force=True)
        if wait:
            self.wait()
        logging.info("checkpoint: saving step %d to %s", step, self.directory)
        return True

    def restore(self, step: int, abstract_state: Any) -> Tuple[Any, Any]:
        """Restores ``(state, data_state)`` at ``step``. ``abstract_state``: a tree of
        ``jax.ShapeDtypeStruct`` with the *current* shardings (the state is resharded to them)."""
        restored = self._manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state), data=DataStateRestore()))
        return restored["state"], restored["data"]

    def wait(self) -> None:
        """Blocks until pending asynchronous saves are complete."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        """Waits for pending saves and releases the manager."""
        self._manager.wait_until_finished()
        self._manager.close()
