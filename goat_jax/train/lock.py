"""One trainer per workdir: an OS-level lock on ``WORKDIR/.lock``, held for the whole run.

Two trainers on one workdir (a job resubmitted while the old one still runs) would truncate each
other's ``metrics.jsonl`` and delete each other's in-progress checkpoints, so the trainer takes
this lock before it writes anything into the workdir, and a second trainer stops at once with
:class:`WorkdirLockedError`, naming the workdir and the holder (pid, host, start time, which the
holder writes into the lock file).

* The lock is ``fcntl.flock`` on the open lock file: the kernel drops it when the holding
  process exits in any way, SIGKILL included, so a dead trainer never leaves a stale lock. The
  file itself stays (deleting it would let a third process lock a fresh inode while a second
  still holds the old one); its contents only describe the last holder.
* Multi-host: every process locks its own file, process 0 ``WORKDIR/.lock`` and process i > 0
  ``WORKDIR/.lock.<i>``, so every process of a second job stops at once instead of waiting on a
  peer that already exited; a 1-process job and process 0 of a multi-process job exclude each
  other.
* Shared filesystems: on NFS, Linux emulates ``flock`` with POSIX byte-range locks, which the
  server enforces across hosts (NFSv4, or NFSv3 with lockd); on a filesystem without lock
  support (``ENOLCK``/``EOPNOTSUPP``, e.g. Lustre mounted without ``-o flock``, some FUSE
  mounts) and on object-store paths (``gs://...``) there is no lock: the trainer logs a warning
  and runs unprotected.
* Reading a run (evaluation, :func:`goat_jax.train.run.load_run`) never takes the lock.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import json
import logging
import os
import socket
from typing import Callable, Iterator, Optional

LOCK_FILE = ".lock"


class WorkdirLockedError(OSError):
    """Another live process holds the workdir's lock (the message names it).

    ``keeps_workdir``: the command-line cleanup (:func:`goat_jax.cli.workdir_cleanup`) must not
    remove the workdir, which belongs to the holder."""

    keeps_workdir = True


def lock_path(workdir: str, process_index: int = 0) -> str:
    """``WORKDIR/.lock`` for process 0, ``WORKDIR/.lock.<i>`` for process i > 0."""
    name = LOCK_FILE if process_index == 0 else f"{LOCK_FILE}.{process_index}"
    return os.path.join(workdir, name)


def _holder(fd: int) -> str:
    """What the lock file says about its holder, as text for the error message."""
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        info = json.loads(os.read(fd, 4096).decode("utf-8") or "{}")
    except (OSError, ValueError):
        info = {}
    if not info.get("pid"):
        return "another process (it has not written its pid yet)"
    return f"pid {info['pid']} on host {info.get('host', '?')}, started {info.get('started', '?')}"


def acquire(workdir: str, process_index: int = 0) -> Optional[int]:
    """Locks ``workdir`` for this process; returns the lock file's descriptor (pass it to
    :func:`release`), or None where the filesystem cannot lock (a warning is logged).

    Raises:
      WorkdirLockedError: another live process holds the lock; the message names the workdir,
        the holder and what to do.
    """
    if "://" in workdir:
        logging.warning("workdir %s is not a local or mounted path: no workdir lock (two trainers "
                        "on it would overwrite each other).", workdir)
        return None
    path = lock_path(workdir, process_index)
    return acquire_file(path, lambda holder: WorkdirLockedError(
        f"workdir {workdir} is in use by another trainer: {holder} (lock {path}). Wait "
        "for it to finish, stop it (SIGTERM saves a checkpoint; the same command then "
        "resumes), or use another --workdir."), what="workdir", process_index=process_index)


def acquire_file(path: str, refusal: Callable[[str], BaseException], what: str = "folder",
                 process_index: int = 0, blocking: bool = False) -> Optional[int]:
    """Locks the file ``path`` (created if missing) for this process with ``flock`` and writes
    the holder (pid, host, start time) into it; returns the descriptor (pass it to
    :func:`release`), or None where the filesystem cannot lock (a warning naming ``what`` is
    logged). A lock another live process holds raises ``refusal(holder)`` (``holder``: what the
    file says about it), or, with ``blocking``, is waited for. The kernel drops the lock when the
    process exits in any way."""
    import fcntl  # pylint: disable=g-import-not-at-top  # POSIX only

    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            holder = _holder(fd)
            os.close(fd)
            raise refusal(holder) from None
        os.close(fd)
        if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            logging.warning("the filesystem of %s does not support locks (%s): no %s lock; "
                            "make sure no other process uses it.", path, e.strerror, what)
            return None
        raise
    info = {"pid": os.getpid(), "host": socket.gethostname(), "process_index": process_index,
            "started": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")}
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(info) + "\n").encode("utf-8"), 0)
    return fd


def release(fd: Optional[int]) -> None:
    """Drops a lock taken by :func:`acquire` (closing the descriptor releases the flock)."""
    if fd is not None:
        os.close(fd)


@contextlib.contextmanager
def hold(workdir: str, process_index: int = 0) -> Iterator[None]:
    """``with hold(workdir):`` the block runs holding the workdir lock (:func:`acquire`)."""
    fd = acquire(workdir, process_index)
    try:
        yield
    finally:
        release(fd)
