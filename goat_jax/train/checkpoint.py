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

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
from typing import Any, Dict, Iterable, Iterator, Optional, Tuple

import jax

from goat_jax import _extras
from goat_jax.config.fields import RESUME_ADJUSTABLE, RESUME_SAFE
from goat_jax.train import validation
with _extras.imports(__name__):  # optional packages: one-line error naming the extra
    import orbax.checkpoint as ocp
    from etils import epath

# Engine fields that may change between a run and its resumption without changing what is
# computed, and those that may change only when asked for (``--resume_with_changes``, i.e.
# ``train_and_evaluate(..., resume_with_changes=True)``; the change is logged and appended to
# WORKDIR/config_changes.jsonl): each engine field declares which, where it is declared
# (``resume=`` in goat_jax/train/validation.py, whose comment says why each kind is safe). A task
# adds its own safe fields (``Task.resume_safe_fields``, e.g. kernels and rematerialization).
RESUME_SAFE_FIELDS = validation.resume_fields(RESUME_SAFE)
RESUME_ADJUSTABLE_FIELDS = validation.resume_fields(RESUME_ADJUSTABLE)


class IncompatibleCheckpointError(ValueError):
    """The workdir holds a checkpoint written under a different config."""


class CorruptCheckpointError(ValueError):
    """A checkpoint cannot be read (a missing or truncated file), or none in a workdir can."""


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


def config_changes(saved: Dict[str, Any], new: Dict[str, Any],
                   field_defaults: Optional[Dict[str, Any]] = None) -> Dict[str, Tuple[Any, Any]]:
    """``{field: (saved value, new value)}`` of the fields that differ between two
    :func:`fingerprint_fields` dicts (``'<absent>'`` for a field one of them lacks), leaving out
    a field added to the config after ``saved`` was written at its default value, or one
    dropped while at its default (``field_defaults``: ``{'a.b': default}``, JSON-normalized):
    such a config computes the same run. What a resumed checkpoint and a reused run record
    are both checked with."""
    defaults = field_defaults or {}
    keys = sorted(set(saved) | set(new))
    changed = {k: (saved.get(k, "<absent>"), new.get(k, "<absent>")) for k in keys
               if saved.get(k, "<absent>") != new.get(k, "<absent>")}
    return {k: v for k, v in changed.items() if not ("<absent>" in v and k in defaults and defaults[k] in v)}


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
            counts = sorted({p.name.rsplit("-of-", 1)[-1][:-len(".json")]
                             for p in directory.glob("process_*-of-*.json")})
            if counts and str(jax.process_count()) not in counts:
                raise IncompatibleCheckpointError(
                    f"{directory} was written by {' or '.join(counts)} process(es), not the "
                    f"{jax.process_count()} now running; resume with the same process count.")
            raise CorruptCheckpointError(f"{path} is missing (the checkpoint is incomplete or damaged)")
        try:
            return json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise CorruptCheckpointError(f"{path} is not valid JSON ({e})") from e

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


class _ReadOnlyNotice(logging.Filter):
    """Drops orbax's "Given directory is read only=<directory>" warning for one directory."""

    def __init__(self, directory: str):
        super().__init__()
        self._directory = os.path.abspath(directory)

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.msg == "Given directory is read only=%s" and len(record.args or ()) == 1
                    and os.path.abspath(str(record.args[0])) == self._directory)


@contextlib.contextmanager
def _without_read_only_notice(directory: str) -> Iterator[None]:
    """While a read-only manager of ``directory`` is built: orbax warns, on every construction,
    that the directory it was asked to open read-only is read-only (an evaluation printed it
    once per run). Only that record, for that directory, is dropped; orbax logs through absl's
    logger."""
    notice = _ReadOnlyNotice(directory)
    logger = logging.getLogger("absl")
    logger.addFilter(notice)
    try:
        yield
    finally:
        logger.removeFilter(notice)


class Checkpointer:
    """Saves and restores ``(state, data_state)`` at integer steps under ``directory``.

    Args:
      directory: where checkpoints live (created if needed, unless ``read_only``).
      config_dict: the resolved config (a plain dict); its fingerprint is stored with every
        checkpoint and compared with the latest one's by :meth:`check_compatible`.
      keep: keep the last ``keep`` checkpoints.
      async_save: write the train state in a background thread.
      resume_safe_fields: the task's fields left out of the fingerprint.
      field_defaults: ``{'a.b': default}`` (the task's :attr:`~goat_jax.train.tasks.Task.field_defaults`):
        a field missing from one config and at this value in the other is no difference, so
        runs written before a field was added resume.
      read_only: for readers of a run that may still be training (evaluation): never creates,
        writes, deletes or cleans up anything under ``directory`` -- in particular not the
        trainer's in-progress temporary checkpoint -- and :meth:`save` raises. The directory
        must exist (FileNotFoundError otherwise).
    """

    def __init__(self, directory: str, config_dict: Dict[str, Any], *, keep: int = 3, async_save: bool = True,
                 resume_safe_fields: Iterable[str] = (), field_defaults: Optional[Dict[str, Any]] = None,
                 read_only: bool = False):
        self.directory = os.path.abspath(directory)
        # JSON-normalized like the fingerprinted fields they are compared with (tuples -> lists).
        self.field_defaults = json.loads(json.dumps(field_defaults or {}, default=str))
        self.read_only = read_only
        self.fields = fingerprint_fields(config_dict, resume_safe_fields)
        self.fingerprint = config_fingerprint(config_dict, resume_safe_fields)
        if read_only and not os.path.isdir(self.directory):
            raise FileNotFoundError(f"{self.directory} does not exist: no checkpoints to read.")
        options = ocp.CheckpointManagerOptions(
            # A reader keeps and saves nothing: the values orbax would otherwise set itself for
            # read_only, warning once per field.
            max_to_keep=None if read_only else max(int(keep), 1), save_interval_steps=0 if read_only else 1,
            create=not read_only,
            # Removing unfinished tmp checkpoints is the writer's job: a reader doing it would
            # delete the save a live trainer is writing (and make that trainer fail).
            cleanup_tmp_directories=not read_only, read_only=read_only,
            enable_async_checkpointing=async_save and not read_only)
        with _without_read_only_notice(self.directory):
            self._manager = ocp.CheckpointManager(self.directory, item_names=("state", "data", "meta"),
                                                  options=options)
        # orbax removes leftover temporary directories in a background future; wait for it so
        # that nothing races with it (a damaged checkpoint moved aside, a rejected run's workdir
        # removed by goat_jax/cli.py). Quick: it only lists and deletes tmp directories.
        getattr(self._manager, "_maybe_await_cleanup_tmp_directory", lambda: None)()

    def latest_step(self) -> Optional[int]:
        """The newest complete checkpoint's step, or None."""
        return self._manager.latest_step()

    def all_steps(self) -> Tuple[int, ...]:
        """Steps of all complete checkpoints, ascending."""
        return tuple(sorted(self._manager.all_steps()))

    def _meta(self, step: int) -> Dict[str, Any]:
        restored = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        return dict(restored["meta"])

    def check_compatible(self, allow_changes: bool = False) -> Dict[str, Tuple[Any, Any]]:
        """Compares this config with the one of the newest checkpoint whose metadata reads.

        Returns ``{field: (checkpoint value, new value)}`` of the fields that differ, which is
        empty unless ``allow_changes`` admits changes of :data:`RESUME_ADJUSTABLE_FIELDS`.
        Raises :class:`IncompatibleCheckpointError` listing the differing fields otherwise.
        """
        meta, step = None, None
        for step in reversed(self.all_steps()):
            try:
                meta = self._meta(step)
                break
            except Exception:  # pylint: disable=broad-except
                continue  # a damaged checkpoint: restore_latest reports it and falls back
        if meta is None or meta.get("fingerprint") == self.fingerprint:
            return {}
        changed = config_changes(meta.get("config", {}), self.fields, self.field_defaults)
        if not changed:
            return {}
        adjustable = set(changed) <= RESUME_ADJUSTABLE_FIELDS
        wanted = changed.get("num_train_steps", (None, None))[1]
        if adjustable and isinstance(wanted, int) and wanted < step:
            # It would train nothing and re-record the run as a shorter one than it is.
            raise IncompatibleCheckpointError(
                f"num_train_steps={wanted} is below the run's current step {step} (the newest "
                f"checkpoint in {self.directory}); a resumed run cannot go back: give "
                f"--config.num_train_steps={step} or more, or a fresh --workdir to train "
                f"{wanted} steps from scratch.")
        if allow_changes and adjustable:
            return changed
        diffs = [f"  {k}: checkpoint {old!r} vs now {new!r}" for k, (old, new) in changed.items()]
        hint = ("These fields may change on resume: rerun with --resume_with_changes to continue "
                "from the checkpoint with the new values (recorded in config_changes.jsonl)."
                if adjustable else
                f"Use a fresh --workdir, or restore those field values to resume (only "
                f"{sorted(RESUME_ADJUSTABLE_FIELDS)} may change, with --resume_with_changes).")
        raise IncompatibleCheckpointError(
            f"{self.directory} holds a checkpoint (step {step}) of a different config; refusing to "
            "resume or overwrite it. Differing fields:\n" + "\n".join(diffs[:40]) + "\n" + hint)

    def record_changes(self, step: int, changes: Dict[str, Tuple[Any, Any]]) -> str:
        """Appends ``{"step", "changes": {field: [old, new]}}`` to ``config_changes.jsonl`` next
        to the checkpoints directory; returns its path."""
        path = os.path.join(os.path.dirname(self.directory), "config_changes.jsonl")
        with open(path, "a") as f:
            f.write(json.dumps({"step": int(step), "changes": {k: list(v) for k, v in changes.items()}},
                               default=str) + "\n")
        return path

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

    def restore_latest(self, abstract_state: Any) -> Tuple[Optional[int], Any, Any]:
        """Restores the newest checkpoint that reads: ``(step, state, data_state)``, or
        ``(None, None, None)`` if there is none.

        A checkpoint that fails to restore (a missing or truncated file) is skipped with a
        warning naming it and the reason, and moved to ``corrupt_checkpoints/<step>`` next to the
        checkpoints directory (never deleted; moved so that the resumed run can save that step
        again; a ``read_only`` checkpointer leaves it where it is). A process-count mismatch is
        not damage and raises. If no checkpoint restores,
        :class:`CorruptCheckpointError` lists each one's reason and nothing is moved.
        """
        failures = []
        for step in reversed(self.all_steps()):
            try:
                state, data_state = self.restore(step, abstract_state)
            except IncompatibleCheckpointError:
                raise
            except Exception as e:  # pylint: disable=broad-except
                reason = " ".join(f"{type(e).__name__}: {e}".split())[:300]
                failures.append((step, reason))
                logging.warning("checkpoint step %d in %s does not restore (%s); trying an older one.",
                                step, self.directory, reason)
                continue
            if failures and not self.read_only:  # a reader (evaluation) moves nothing
                for bad, reason in failures:
                    self._set_aside(bad, reason)
                logging.warning("resuming from step %d, the newest checkpoint that restores.", step)
                self._manager.reload()
            return step, state, data_state
        if failures:
            raise CorruptCheckpointError(
                f"no checkpoint in {self.directory} restores: " +
                "; ".join(f"step {s}: {r}" for s, r in failures) +
                ". Move the checkpoints directory aside to start afresh.")
        return None, None, None

    def _set_aside(self, step: int, reason: str) -> None:
        # Only the primary moves files; on several processes the others see the move.
        if jax.process_index() != 0:
            return
        target = os.path.join(os.path.dirname(self.directory), "corrupt_checkpoints", str(step))
        os.makedirs(os.path.dirname(target), exist_ok=True)
        suffix = 0
        while os.path.exists(target + (f".{suffix}" if suffix else "")):
            suffix += 1
        target += f".{suffix}" if suffix else ""
        os.rename(os.path.join(self.directory, str(step)), target)
        logging.warning("moved the unreadable checkpoint of step %d to %s (kept for inspection: %s).",
                        step, target, reason)

    def wait(self) -> None:
        """Blocks until pending asynchronous saves are complete."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        """Waits for pending saves and releases the manager."""
        self._manager.wait_until_finished()
        self._manager.close()
