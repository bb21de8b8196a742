"""Run records: what the report reads of each finished run, kept beside the report.

A run's workdir holds its checkpoints (megabytes each, the bulk of a suite's disk) and a few
small files the report reads: its evaluations, its config, a ViT's drawn arrays, the toy's
figures. A *record* is those small files plus the run's training seconds and final held-out
loss, written under ``RECORDS/<the run's path under the runs root>/`` as soon as the run is
evaluated (``--records``, default ``<out>/runs``: ``reports/tiny/runs`` for the tiny suite).

Two uses:

* **Evidence**: every seed's numbers, as evaluated, sit beside the report that aggregates them
  (``record.json`` per run; an evaluated-with row's is ``record_<label>.json`` in the run it
  reads), small enough to commit.
* **Resuming without the runs**: a suite spread over sittings on machines that do not keep
  their scratch disk (a preemptible node, a fresh CI box, a new session) reuses a run from its
  record when its workdir has no finished run. A record is reused only if it was made by the
  config the job trains with now and with the suite's evaluation settings now; otherwise the
  run trains and evaluates again and its record is rewritten.

What a record cannot stand in for is a checkpoint: an evaluated-with row (another row's run
evaluated with changed settings) whose own record is missing needs its run's weights, so that
run is trained again and its record rewritten (retraining is bit-identical on one machine, not
across machines: docs/experiments.md, "Run records"). This
module reads and writes files only; :mod:`goat_jax.reproduce.jobs` decides when.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import subprocess
from collections.abc import Iterable, Sequence
from typing import Optional

from goat_jax import files
from goat_jax.reproduce.suites import ROOT, Job
from goat_jax.train import checkpoint as checkpoint_lib
from goat_jax.train import run as run_lib

# The workdir files the report reads besides the evaluation (config: the Setup section; the
# ViT's drawn arrays: its prior and CLS-attention figures; the toy run's prior figures).
SIDE_FILES = ("config.json", "reproduce_vision.npz", "toy_prior.png", "toy_prior_all_heads.png")
MEMORY_FILE = "reproduce_memory.json"  # the DNA family's compiled-memory rows (one per suite)


def attach(jobs: Sequence[Job], runs_root: str, records_root: Optional[str]) -> list[Job]:
    """``jobs`` with :attr:`Job.record` set to their record folder under ``records_root``
    (the workdir's path relative to ``runs_root``); unchanged when ``records_root`` is None
    (records off). ValueError for a workdir outside ``runs_root``."""
    if not records_root:
        return list(jobs)
    out = []
    for job in jobs:
        rel = os.path.relpath(job.workdir, runs_root)
        if rel.startswith(".."):
            raise ValueError(f"{job.run_name}: workdir {job.workdir} is not under the runs root {runs_root}")
        out.append(dataclasses.replace(job, record=os.path.join(records_root, rel)))
    return out


def record_path(job: Job) -> Optional[str]:
    """The record file of ``job`` (None when records are off): ``record.json`` in its record
    folder, ``record_<label>.json`` for an evaluated-with row (it shares its run's folder)."""
    if not job.record:
        return None
    return os.path.join(job.record, "record.json" if job.trains else f"record_{job.label}.json")


def normalized(value) -> object:
    """``value`` as JSON reads it back (tuples as lists, string keys): what a record compares."""
    return json.loads(json.dumps(value, default=list, sort_keys=True))


def _commit() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "HEAD"], cwd=ROOT, stderr=subprocess.DEVNULL,
                                       text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def write(job: Job, config: dict, entry: dict, replace_unreadable: bool = False) -> bool:
    """Writes ``job``'s record: ``entry`` (``{'train_seconds', 'result'}``, the harness's
    result of the run) with the ``config`` it trained with, the code revision and the date, and
    copies of the run's :data:`SIDE_FILES` that exist. Each file is written whole
    (:func:`goat_jax.files.write_whole`). Nothing is rewritten when the record holds these
    numbers already; returns whether anything was written (False too when records are off).
    An unreadable record in the way raises :class:`UnreadableRecord` unless
    ``replace_unreadable`` (the caller has said so: the entry is the run's own evaluation)."""
    path = record_path(job)
    if path is None:
        return False
    body = {"run_name": job.run_name, "config": normalized(config),
            "train_seconds": float(entry["train_seconds"]), "result": normalized(entry["result"])}
    try:
        old = _load(path)
    except UnreadableRecord:
        if not replace_unreadable:
            raise
        old = None
    if old is not None and {k: old.get(k) for k in body} == body:
        return False
    os.makedirs(job.record, exist_ok=True)
    if job.trains:
        for name in SIDE_FILES:
            copy_into(os.path.join(job.workdir, name), os.path.join(job.record, name))
    stamp = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    files.write_whole(path, json.dumps({**body, "commit": _commit(), "written": stamp}, indent=1,
                                       sort_keys=True) + "\n")
    return True


class UnreadableRecord(ValueError):
    """A run record that exists but cannot be read (not JSON, not UTF-8, not a JSON object: torn
    by a kill before writes were whole, or a merge conflict in a committed one). It is neither
    reused nor overwritten silently: the message names the file and the ways forward.
    ``path``: the file; ``reason``: what is wrong with it."""

    def __init__(self, path: str, reason: str):
        self.path, self.reason = path, reason
        super().__init__(f"run record {path} is unreadable ({reason}); it is neither reused nor overwritten. "
                         f"Restore it (e.g. `git checkout -- {path}` for a committed one), or move it aside to "
                         "train and evaluate the run again.")


def _load(path: str) -> Optional[dict]:
    """The record at ``path``, None when there is none; :class:`UnreadableRecord` when the file
    exists but is not a readable JSON object (it used to count as "no record", so a torn record
    was retrained and overwritten without a word)."""
    try:
        return files.read_json_object(path)
    except FileNotFoundError:
        return None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UnreadableRecord(path, f"{type(e).__name__}: {e}") from None
    except ValueError as e:  # another JSON value than an object
        raise UnreadableRecord(path, str(e)) from None


def check_readable(job: Job) -> None:
    """Raises :class:`UnreadableRecord` when ``job``'s record exists and cannot be read; nothing
    when it reads, is absent, or records are off."""
    path = record_path(job)
    if path:
        _load(path)


def read(job: Job, config: dict, settings: dict, resume_safe_fields: Iterable[str] = (),
         field_defaults: Optional[dict] = None) -> Optional[dict]:
    """``job``'s recorded result, ``{'train_seconds', 'result', 'wall_seconds': 0.0,
    'from_record': True}``, if its record was made by ``config`` (the config the job trains with
    now) and its evaluation with ``settings`` (the suite's evaluation settings for the job);
    None when there is no record, or one made otherwise. "Made by ``config``" is the test a
    resumed checkpoint passes (:func:`goat_jax.train.checkpoint.config_changes`): the task's
    ``resume_safe_fields`` (cadences, kernels, layout) may differ, and a field added to the
    config since, at its default (``field_defaults``), is no change. Raises
    :class:`UnreadableRecord` for a record file that cannot be read."""
    path = record_path(job)
    rec = _load(path) if path else None
    if rec is None or not isinstance(rec.get("config"), dict):
        return None
    defaults = normalized(field_defaults or {})
    if checkpoint_lib.config_changes(checkpoint_lib.fingerprint_fields(rec["config"], resume_safe_fields),
                                     checkpoint_lib.fingerprint_fields(normalized(config), resume_safe_fields),
                                     defaults):
        return None
    result = rec.get("result") or {}
    if result.get("eval_settings") != normalized(settings):
        return None
    return {"train_seconds": float(rec["train_seconds"]), "result": result, "wall_seconds": 0.0,
            "from_record": True}


def run_file(job: Job, name: str) -> str:
    """Where the report reads ``job``'s file ``name`` (one of :data:`SIDE_FILES`): the run's
    workdir when the file is there, else its record's copy when that exists, else the workdir
    path (so a caller's "missing" message names the workdir)."""
    local = os.path.join(job.workdir, name)
    if os.path.exists(local) or not job.record:
        return local
    kept = os.path.join(job.record, name)
    return kept if os.path.exists(kept) else local


def read_config(job: Job):
    """The resolved config ``job``'s run wrote (its ``config.json``, from the workdir or the
    record: :func:`run_file`); FileNotFoundError when neither has it."""
    return run_lib.read_config(os.path.dirname(run_file(job, "config.json")))


def family_file(job: Job, name: str) -> tuple[str, Optional[str]]:
    """``(workdir path, record path or None)`` of a file kept once per family beside its runs
    (e.g. :data:`MEMORY_FILE` next to the DNA runs): the folder above ``job``'s workdir and
    above its record folder."""
    local = os.path.join(os.path.dirname(job.workdir), name)
    return local, (os.path.join(os.path.dirname(job.record), name) if job.record else None)


def copy_into(src: str, dst: Optional[str]) -> None:
    """Copies file ``src`` to ``dst`` (made whole; its folder created); nothing when ``dst`` is
    None or ``src`` is missing."""
    if dst and os.path.exists(src):
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        with open(src, "rb") as f:
            files.write_whole(dst, f.read())

