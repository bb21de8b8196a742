"""How the long-running commands stop on a signal: SIGTERM (a scheduler's preemption, ``kill``),
SIGINT (Ctrl-C) and SIGHUP (the terminal closed) all mean "save what you have and stop", and
the commands differ only in what they have to save (docs/training.md, "Stopping a run").

* The trainer (:class:`StopSignals`, installed by :func:`goat_jax.train.trainer.train_and_evaluate`
  for the whole run): the first of these signals is noted; the loop saves a checkpoint at the end
  of the step it is on and returns, and the command prints one line (``interrupted: saved a
  checkpoint at step k`` for Ctrl-C). A second Ctrl-C ends the process at once (exit 130) without
  saving, also while XLA compiles in C++ (a thread watches the signal's wakeup fd, since Python
  runs its handlers only between bytecodes). Ctrl-C used to raise ``KeyboardInterrupt`` mid-step:
  a 30-line traceback and nothing saved.
* Commands whose work is not a loop of steps (``experiments.evaluate``, the report harness between
  trainings) take :func:`raise_on_stop`: each of the signals raises :class:`Stopped` in the main
  thread, so the command writes what it has finished before it exits with one line.

SIGHUP is taken only while it is not ignored: under ``nohup`` it is ignored, and stays ignored. Exit codes: ``128 + signal number`` (130 Ctrl-C, 129 SIGHUP,
143 SIGTERM), except the trainer's SIGTERM, which keeps its exit 0 (a preempted run that saved).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from typing import Callable, Iterator, Optional

import jax

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def exit_code(signum: int) -> int:
    """What a shell reports for a process ended by ``signum``: 128 + its number."""
    return 128 + int(signum)


def name(signum: int) -> str:
    """'SIGINT' for Ctrl-C, 'SIGTERM', 'SIGHUP'."""
    return signal.Signals(signum).name


class Stopped(BaseException):
    """Raised in the main thread by :func:`raise_on_stop` when a stop signal arrives: a
    ``BaseException`` like ``KeyboardInterrupt``, so no ``except Exception`` of a job's own
    failure handling swallows it. ``signum``: the signal."""

    def __init__(self, signum: int):
        self.signum = int(signum)
        super().__init__(f"stopped by {name(signum)}")


def _taken(signum: int) -> bool:
    """Whether this process should handle ``signum`` itself: SIGHUP only while it is not ignored
    (``nohup`` ignores it, and that choice is kept; an outer handler, e.g. the report harness's
    around an in-process trainer, is taken over and restored after)."""
    return signum != signal.SIGHUP or signal.getsignal(signum) is not signal.SIG_IGN


def _second_ctrl_c_exits(message: str) -> Callable[[], None]:
    """Starts a thread that ends the process (exit 130, after printing ``message``) at the second
    SIGINT written to a new wakeup fd, even while the main thread is in C++ (an XLA compile, a
    long step); returns the function that stops watching and restores the previous wakeup fd."""
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    previous = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)

    def watch():
        seen = 0
        while True:
            data = os.read(read_fd, 64)
            if not data:  # the write end closed: watching is over
                os.close(read_fd)
                return
            seen += data.count(int(signal.SIGINT))
            if seen >= 2:
                print(message, file=sys.stderr, flush=True)
                os._exit(exit_code(signal.SIGINT))  # pylint: disable=protected-access  # at once

    threading.Thread(target=watch, name="second-ctrl-c", daemon=True).start()

    def stop():
        signal.set_wakeup_fd(previous)
        os.close(write_fd)
    return stop


class StopSignals:
    """The trainer's stop request: SIGTERM, SIGINT and (unless ignored) SIGHUP are noted
    (:attr:`signum`, the first one), and :meth:`reached` says whether to save and stop after a
    step. Single process, main thread: handlers of its own. Multi-process: SIGTERM is JAX's
    coordination service's (every host stops at the same step); SIGINT and SIGHUP are passed on
    to this process as SIGTERM, so they reach that service too. Off the main thread (a trainer
    run from a worker thread) nothing is installed. Use :meth:`restore` (or the context manager
    :func:`stop_signals`) to reinstall the previous handlers."""

    def __init__(self):
        self.signum: Optional[int] = None
        self._multi = jax.process_count() > 1
        self._previous: dict = {}
        self._unwatch: Optional[Callable[[], None]] = None
        if threading.current_thread() is not threading.main_thread():
            return
        for signum in STOP_SIGNALS:
            if self._multi and signum == signal.SIGTERM:
                continue  # jax.distributed's preemption notifier owns it
            if _taken(signum):
                self._previous[signum] = signal.signal(signum, self._handle)
        if signal.SIGINT in self._previous and not self._multi:
            self._unwatch = _second_ctrl_c_exits(
                "interrupted again (Ctrl-C): exiting at once without saving; the last checkpoint is the resume point")

    def _handle(self, signum, frame):  # pylint: disable=unused-argument
        if self._multi:
            if self.signum is None:
                self.signum = signum
                os.kill(os.getpid(), signal.SIGTERM)  # JAX's notifier: all hosts stop at one step
            return
        if self.signum is None:
            self.signum = signum

    @property
    def requested(self) -> bool:
        """Whether a stop signal has arrived (this process's own view)."""
        return self.signum is not None

    def reached(self, step: int) -> bool:
        """Whether to checkpoint and stop after ``step``."""
        if self._multi:
            from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
            return bool(multihost_utils.reached_preemption_sync_point(step))
        return self.requested

    def saved_line(self, step: int) -> str:
        """The one line the trainer logs after saving at ``step`` on the way out."""
        if self.signum == signal.SIGINT:
            return f"interrupted: saved a checkpoint at step {step}"
        return f"{name(self.signum or signal.SIGTERM)}: saved a checkpoint at step {step}; exiting."

    def restore(self) -> None:
        """Reinstalls the previous handlers (and wakeup fd)."""
        if self._unwatch is not None:
            self._unwatch()
            self._unwatch = None
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous = {}


@contextlib.contextmanager
def stop_signals() -> Iterator[StopSignals]:
    """``with stop_signals() as stop:`` the block runs with :class:`StopSignals` installed."""
    stop = StopSignals()
    try:
        yield stop
    finally:
        stop.restore()


@contextlib.contextmanager
def raise_on_stop() -> Iterator[None]:
    """While the block runs (main thread only), SIGTERM, SIGINT and SIGHUP (unless ignored) raise
    :class:`Stopped` in the main thread, once: the caller writes what it has finished and exits
    with :func:`exit_code`. A second Ctrl-C while it does ends the process at once (exit 130).
    The previous handlers are reinstalled after the block."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous, raised = {}, []

    def handle(signum, frame):  # pylint: disable=unused-argument
        if raised:
            if signum == signal.SIGINT:
                print("interrupted again (Ctrl-C): exiting at once", file=sys.stderr, flush=True)
                os._exit(exit_code(signum))  # pylint: disable=protected-access
            return  # a later SIGTERM / SIGHUP: the first one is being handled
        raised.append(signum)
        raise Stopped(signum)

    for signum in STOP_SIGNALS:
        if _taken(signum):
            previous[signum] = signal.signal(signum, handle)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
