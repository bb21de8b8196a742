"""Job processes for the harness's ``--jobs J``: every job runs in a fresh process of its own
(spawned: a new JAX per job), at most J at once, and a stop request reaches the running jobs
alone.

Why not :class:`concurrent.futures.ProcessPoolExecutor`: stopping it cleanly is racy. With
``max_tasks_per_child=1`` it starts a spare worker whenever one exits, and the harness's stopper
had to SIGTERM "every live worker" each second; a worker killed outside its trainer (the spare
one while it starts, or a worker whose trainer had saved and restored the default handler)
breaks the pool, and on Python 3.11 the pool's manager thread then dies on a queued future the
harness had cancelled (``InvalidStateError`` in ``terminate_broken``), so the running jobs'
futures never complete and the harness waits forever (seen on the tiny suite: 2 jobs running,
77 queued, ``kill PID``). Here a process exists only while it runs a job, is sent SIGTERM at
most once, a job never started never starts, and a process that dies is an outcome like any other.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Iterator
from multiprocessing import connection
from typing import Any, NamedTuple, Optional


class WorkerDied(RuntimeError):
    """A job's process ended without sending a result back (killed by a signal, out of memory);
    the message has its exit code (negative: the signal's number)."""


class Outcome(NamedTuple):
    """What one job came to: ``result`` (the target's return value) when ``error`` is None,
    else ``error`` (the exception the target raised, or :class:`WorkerDied`)."""
    key: Any
    result: Any
    error: Optional[BaseException]


def _child(conn, target: Callable, args: tuple) -> None:
    """A job process's body: runs ``target(*args)`` and sends ``(result, error)`` back once."""
    try:
        outcome = (target(*args), None)
    except (Exception, KeyboardInterrupt) as e:  # pylint: disable=broad-except  # sent back: the harness records it
        if getattr(e, "keeps_workdir", False) or isinstance(e, KeyboardInterrupt):
            # Another process holds the run (its workdir lock), or Ctrl-C reached the job too: one line.
            print(f"{type(e).__name__}: {e}", file=sys.stderr, flush=True)
        else:
            traceback.print_exc()  # into the job's log when the target redirected stderr there
        outcome = (None, e)
    try:
        conn.send(outcome)
    except Exception:  # pylint: disable=broad-except  # a result or exception that does not pickle
        conn.send((None, RuntimeError(f"{type(outcome[1]).__name__}: {outcome[1]}" if outcome[1] is not None
                                      else f"the job's result could not be sent back: {outcome[0]!r:.200}")))
    conn.close()


class _Running(NamedTuple):
    key: Any
    process: multiprocessing.process.BaseProcess
    conn: connection.Connection


class JobProcesses:
    """Runs ``target(*args)`` for each submitted job in a process of its own, ``slots`` at once,
    in submission order. :meth:`outcomes` yields each job's :class:`Outcome` as it ends; jobs
    may be submitted while it runs. Once ``stop`` (a :class:`threading.Event`, e.g. set by a
    SIGTERM handler) is set, no queued job starts and every running job's process is sent
    SIGTERM once (a trainer then saves a checkpoint and returns; a process still starting ends):
    the outcomes of the running jobs still come, then the iteration ends."""

    def __init__(self, slots: int, target: Callable, stop: Optional[threading.Event] = None):
        if slots < 1:
            raise ValueError(f"slots={slots}: give at least 1 job process at once.")
        self.slots, self.target = slots, target
        self.stop = stop if stop is not None else threading.Event()
        self._context = multiprocessing.get_context("spawn")  # fork would copy JAX's threads
        self._queue: list[tuple[Any, tuple]] = []
        self._running: list[_Running] = []
        self._signalled: set[int] = set()  # pids sent SIGTERM

    def submit(self, key: Any, *args) -> None:
        """Queues ``target(*args)``; its outcome will carry ``key`` (any object: it is never
        hashed nor sent to the job's process)."""
        self._queue.append((key, args))

    def _start(self, key: Any, args: tuple) -> None:
        reader, writer = self._context.Pipe(duplex=False)
        process = self._context.Process(target=_child, args=(writer, self.target, args), daemon=False)
        process.start()
        writer.close()  # the child holds its own copy: a child that dies leaves the pipe at EOF
        self._running.append(_Running(key, process, reader))

    def _terminate_running(self) -> None:
        for run in self._running:
            if run.process.pid not in self._signalled and run.process.is_alive():
                self._signalled.add(run.process.pid)
                try:
                    os.kill(run.process.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass

    def _finish(self, run: _Running) -> Outcome:
        """Reads ``run``'s result (or notes its death) and reaps its process."""
        try:
            (result, error), sent = run.conn.recv(), True  # before join: a large result is read as the child sends it
        except (EOFError, OSError):
            result, error, sent = None, None, False
        run.process.join()
        run.conn.close()
        if not sent:
            error = WorkerDied(f"the job's process exited with code {run.process.exitcode} and sent no result")
        self._running.remove(run)
        return Outcome(run.key, result, error)

    def outcomes(self, poll_seconds: float = 0.2) -> Iterator[Outcome]:
        """Starts queued jobs as slots free up and yields each job's outcome as it ends, until
        nothing is queued or running (or, after ``stop``, nothing is running). Leaving the loop
        early (an exception in the caller) stops the running jobs as ``stop`` would and waits for them."""
        try:
            while self._queue or self._running:
                if self.stop.is_set():
                    self._queue.clear()
                    self._terminate_running()
                while self._queue and len(self._running) < self.slots:
                    self._start(*self._queue.pop(0))
                if not self._running:
                    continue
                waits = [r.conn for r in self._running] + [r.process.sentinel for r in self._running]
                ready = set(connection.wait(waits, timeout=poll_seconds))
                for run in list(self._running):
                    if run.conn in ready or run.process.sentinel in ready:
                        yield self._finish(run)
        finally:
            if self._running:
                self.stop.set()
                self._terminate_running()
                for run in list(self._running):
                    run.process.join()
                    run.conn.close()
                self._running.clear()
