"""Two harnesses must not fight: one report harness at a time per runs root and per
report folder, and a report that lacks runs an earlier one reported never replaces it.

* :func:`hold_harness`: a training harness (``experiments.reproduce`` without ``--status``,
  ``--dry_run`` or ``--report_only``) locks ``<workdir>/.reproduce.lock`` and
  ``<out>/.reproduce.lock`` for its whole run (``flock``: released by the kernel when the process
  ends in any way). A second one refuses at the start in one line naming the holder. Before this,
  both ran: each printed a traceback for every run the other's trainers held, marked it FAILED,
  exited 1, and each wrote REPORT.md and results.json over the other's. ``--report_only`` (the
  verdicts of a suite still running) and ``--status`` take no harness lock.
* :func:`report_writing`: every report write (a training harness's or ``--report_only``'s) holds
  ``<out>/.report.lock`` while it writes, waiting for another writer to finish, so the files of
  two reports are never mixed.
* :func:`lacking_runs`: the runs the report in ``out`` (its ``results.json``) has for the
  families about to be written, that are still planned, and that this invocation has no result
  for. When there are any, the runner writes its report to ``<out>/partial/`` and keeps the fuller
  one (a sitting on a machine without the runs or records, runs held by another process).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator

from goat_jax import files
from goat_jax.train import lock as lock_lib

HARNESS_LOCK = ".reproduce.lock"
REPORT_LOCK = ".report.lock"
PARTIAL = "partial"  # <out>/partial/: a report that would have replaced a fuller one


class HarnessLockedError(ValueError):
    """Another live report harness holds the runs root or the report folder (the message names
    it). A ValueError, so the command line prints it as one line; ``keeps_workdir``: nothing it
    names is removed."""

    keeps_workdir = True


@contextlib.contextmanager
def hold_harness(root: str, out: str) -> Iterator[None]:
    """Holds the harness locks of the runs root ``root`` (``--workdir``) and the report folder
    ``out`` (``--out``) while the block runs (both folders are created); raises
    :class:`HarnessLockedError` at once when another harness holds either."""
    fds, seen = [], set()
    try:
        for folder, flag in ((root, "--workdir"), (out, "--out")):
            folder = os.path.abspath(folder)
            if folder in seen:
                continue
            seen.add(folder)
            os.makedirs(folder, exist_ok=True)
            path = os.path.join(folder, HARNESS_LOCK)
            fds.append(lock_lib.acquire_file(path, lambda holder, flag=flag, folder=folder, path=path: HarnessLockedError(
                f"{flag} {folder} is in use by another experiments.reproduce: {holder} (lock {path}). Wait for it "
                "to finish (--status shows where it stands; --report_only writes the verdicts so far), stop it "
                "(kill PID: its trainers save a checkpoint), or give another " + flag + "."), what="harness"))
        yield
    finally:
        for fd in fds:
            lock_lib.release(fd)


@contextlib.contextmanager
def report_writing(out: str) -> Iterator[None]:
    """Holds ``<out>/.report.lock`` (created with ``out``) while the block writes a report,
    waiting for another writer's to end."""
    os.makedirs(out, exist_ok=True)
    fd = lock_lib.acquire_file(os.path.join(out, REPORT_LOCK), lambda holder: RuntimeError(holder),
                               what="report", blocking=True)
    try:
        yield
    finally:
        lock_lib.release(fd)


def _family_of(name: str) -> str:
    from goat_jax.reproduce.report import _family_of as family_of  # pylint: disable=g-import-not-at-top
    return family_of(name)


def reported_runs(out: str, families: Iterable[str]) -> set[str]:
    """The run names (seed 0's is the row's name, seed k's ``<row>@seed<k>``) the report in
    ``out`` holds for ``families`` (its ``results.json``: each row's ``seeds``); an empty set
    when there is none. Raises ValueError naming ``results.json`` when it cannot be read."""
    path = os.path.join(out, "results.json")
    if not os.path.exists(path):
        return set()
    try:
        old = files.read_json_object(path)
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ValueError(f"{path} is unreadable ({e})") from None
    families = set(families)
    runs = set()
    for row, value in old.items():
        if _family_of(row) in families:
            seeds = value.get("seeds") if isinstance(value, dict) else None
            runs |= set(seeds) if isinstance(seeds, dict) and seeds else {row}
    return runs


def lacking_runs(out: str, families: Iterable[str], planned: Iterable[str], have: Iterable[str]) -> list[str]:
    """The runs of ``planned`` that the report in ``out`` holds for ``families`` and ``have``
    (this invocation's results) lacks, sorted: when non-empty, this invocation's report is
    partial next to that one. A ``results.json`` that cannot be read counts as fuller
    (ValueError from :func:`reported_runs`, re-raised for the caller to name)."""
    return sorted((reported_runs(out, families) & set(planned)) - set(have))
