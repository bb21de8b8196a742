"""Failures whose real cause is buried: a full disk and a dead peer, said in one line.

A full disk surfaces as ``OSError: [Errno 28] No space left on device`` deep inside orbax or a
file write (hundreds of traceback lines); a dead host in a multi-host run surfaces as a
barrier or collective timeout on its peers while JAX's own log says "Task 1 heartbeat
timeout". :func:`explain` finds either anywhere in an exception's chain (``__cause__`` and
``__context__``) and returns one error that says what failed, at which step, what is safe on
disk and what to do; the trainer raises it in place of the original (kept as its cause, shown
with ``GOAT_DEBUG=1``).

Where JAX does not raise but ends the process itself (its coordination service aborts the
survivors of a SIGKILLed process after the heartbeat timeout, logging "Terminating process
because the JAX distributed service detected fatal errors ... stopped sending heartbeats: 1"),
no Python code runs: that line is JAX's. JAX's client takes a ``missed_heartbeat_callback``,
but jaxlib 0.10 cannot pass the status to a Python one (it aborts with ``std::bad_cast``), so
it is not used. What is safe on disk is the same either way: every checkpoint directory
named by its step is complete on every host.
"""

from __future__ import annotations

import errno
import os
import re
import traceback
from typing import Iterator, Optional, Sequence


class DiskFullError(OSError):
    """The disk of the workdir filled up during a run (the message says what is safe)."""


class PeerFailedError(ConnectionError):
    """Another process of a multi-host run died or stopped responding."""


_DISK_FULL = ("No space left on device", "ENOSPC", "Disk quota exceeded")
# What a peer's death looks like on a survivor: JAX's coordination service (heartbeats, barriers,
# the preemption sync point), gloo/NCCL collectives and orbax's checkpoint barriers.
_PEER = re.compile(r"heartbeat|barrier|coordination service|DEADLINE_EXCEEDED|UNAVAILABLE|"
                   r"Connection reset by peer|connection closed|Gloo|NCCL .*(error|timeout)|"
                   r"distributed service detected fatal errors|task(s)? (has|have) (failed|died)",
                   re.IGNORECASE)
_TASK = re.compile(r"(?:/task:|\btask[ _:]?|\bprocess[ _:]?|\bnode[ _:]?)(\d+)", re.IGNORECASE)


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def is_disk_full(exc: BaseException) -> Optional[BaseException]:
    """The exception of ``exc``'s chain that says the disk is full (ENOSPC/EDQUOT), or None."""
    for e in _chain(exc):
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return e
        if any(s in str(e) for s in _DISK_FULL):
            return e
    return None


def _doing(exc: BaseException) -> str:
    """What the program was doing when ``exc`` was raised, from its traceback's files."""
    files = " ".join(f.filename.replace(os.sep, "/") for f in traceback.extract_tb(exc.__traceback__))
    if "orbax" in files or "train/checkpoint.py" in files:
        return "saving a checkpoint"
    if "tensorboard" in files.lower():
        return "writing the TensorBoard events"
    if "train/metrics.py" in files:
        return "writing metrics.jsonl"
    return "writing to the workdir"


def complete_checkpoints(checkpoint_dir: str) -> list:
    """The steps of the complete checkpoints on disk (orbax renames a checkpoint to its step
    only once every file is written: an interrupted save is a temporary folder)."""
    try:
        return sorted(int(d) for d in os.listdir(checkpoint_dir) if d.isdigit())
    except OSError:
        return []


def _safe(checkpoint_dir: str) -> tuple:
    steps = complete_checkpoints(checkpoint_dir)
    if steps:
        return steps[-1], (f"the last complete checkpoint on disk is step {steps[-1]} "
                           f"({os.path.join(checkpoint_dir, str(steps[-1]))})")
    return None, "no checkpoint is on disk yet"


# JAX's coordination service lists the dead tasks after "stopped sending heartbeats):".
_UNHEALTHY = re.compile(r"stopped sending heartbeats\)?:?\s*((?:\d+[\s,]*)+)")


def dead_tasks(exc: BaseException, process_count: int, own: int) -> Sequence[int]:
    """The other process indices named in ``exc``'s chain ("task 1", "/task:1", JAX's
    "unhealthy (stopped sending heartbeats): 1", ...)."""
    found = []
    for e in _chain(exc):
        text = str(e)
        numbers = [int(m.group(1)) for m in _TASK.finditer(text)]
        for m in _UNHEALTHY.finditer(text):
            numbers += [int(n) for n in re.findall(r"\d+", m.group(1))]
        for i in numbers:
            if i != own and 0 <= i < process_count and i not in found:
                found.append(i)
    return found


def explain(exc: BaseException, *, step: int, checkpoint_dir: str, process_count: int = 1,
            process_index: int = 0) -> Optional[Exception]:
    """A one-line :class:`DiskFullError` or :class:`PeerFailedError` for ``exc`` raised at
    ``step``, or None if it is neither (then raise the original)."""
    full = is_disk_full(exc)
    if full is not None:
        last, safe = _safe(checkpoint_dir)
        resume = (f"it resumes from step {last}" if last is not None else "it starts again")
        error = DiskFullError(
            f"disk full (No space left on device) while {_doing(full)} at step {step}; {safe} "
            "(an interrupted save is never used on resume). Free space on the disk of "
            f"{os.path.dirname(os.path.abspath(checkpoint_dir))} (or move the workdir to a larger "
            f"one) and rerun the same command: {resume}.")
        error.errno = errno.ENOSPC
        return error
    if process_count > 1 and any(_PEER.search(str(e)) for e in _chain(exc)):
        dead = dead_tasks(exc, process_count, process_index)
        who = (f"process(es) {', '.join(map(str, dead))} of {process_count}" if dead
               else f"another of the {process_count} processes")
        last, safe = _safe(checkpoint_dir)
        resume = f"all resume from step {last}" if last is not None else "they start again"
        first = " ".join(str(exc).split())[:160]
        return PeerFailedError(
            f"{who} died or stopped responding at step {step} (this is process {process_index}; "
            f"JAX: {first}); {safe}, complete on every host. Find why it died in its own log, then "
            f"restart all {process_count} processes with the same command: {resume}.")
    return None
