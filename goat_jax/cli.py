"""How the command-line entry points talk to the user: errors, and progress lines (:func:`log`).
Shared by train, evaluate, reproduce, toy_prior and the library code they run.

A config or input error (a bad value, a missing file, an incompatible workdir, a non-finite
loss) is the user's to fix, so it is printed as one line, ``error: <message>``, and the command
exits with status 1; the traceback appears only with ``GOAT_DEBUG=1`` in the environment.
Programming errors (anything else) keep their traceback. When the command fails that way before
saving a checkpoint, what it created is removed again (a new workdir with the parents made for
it, or the new entries of an existing one: :func:`workdir_cleanup`), so a rejected config leaves
nothing behind.

    if __name__ == "__main__":
        cli.run_absl(main)                 # absl.app entry points (config flags)
        sys.exit(cli.run(main))            # argparse entry points
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import signal
import sys
import threading
import time
from typing import Any, Callable, Iterator

from goat_jax import _extras
from goat_jax.train import interrupts
from goat_jax.train import lock as lock_lib
from goat_jax.train import run as run_lib

DEBUG_ENV = "GOAT_DEBUG"
# Exceptions that mean "the input is wrong": ValueError covers bad config values, unknown fields,
# incompatible checkpoints and bad data; OSError missing or unreadable files.
USER_ERRORS = (ValueError, OSError, FloatingPointError)


def log(msg: str) -> None:
    """A progress line ``[HH:MM:SS] msg`` on stdout, flushed: long jobs (the report harness, the
    evaluations) usually run under nohup into a log file, which must show where they are."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def debug() -> bool:
    """Whether ``GOAT_DEBUG`` asks for full tracebacks."""
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


def _fail(message: str) -> None:
    hint = "" if debug() else f" (set {DEBUG_ENV}=1 for the traceback)"
    print(f"error: {message}{hint}", file=sys.stderr, flush=True)
    sys.exit(1)


def report_errors(main: Callable[..., Any]) -> Callable[..., Any]:
    """Wraps ``main`` so that :data:`USER_ERRORS` end the process with one line and status 1,
    and a stop signal that reached it (Ctrl-C's ``KeyboardInterrupt``,
    :class:`goat_jax.train.interrupts.Stopped`) with one line and ``128 + signal`` (130 for
    Ctrl-C), never a traceback: what the command saves on the way out it has saved by then."""
    @functools.wraps(main)
    def wrapped(*args, **kwargs):
        try:
            if debug():
                return main(*args, **kwargs)
            try:
                return main(*args, **kwargs)
            except USER_ERRORS as e:
                _fail(str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}")
        except (KeyboardInterrupt, interrupts.Stopped) as e:
            signum = getattr(e, "signum", signal.SIGINT)
            how = "Ctrl-C" if signum == signal.SIGINT else interrupts.name(signum)
            print(f"interrupted ({how}): stopped", file=sys.stderr, flush=True)
            sys.exit(interrupts.exit_code(signum))
    return wrapped


def _parse_absl_flags(argv):
    with _extras.imports(__name__):
        from absl import flags  # pylint: disable=g-import-not-at-top
    from goat_jax.config import files as config_files  # pylint: disable=g-import-not-at-top
    absl_argv, nones = config_files.take_none_overrides(argv)  # --config.<field>=None
    try:
        rest = flags.FLAGS(absl_argv)
        config_files.finish_overrides(flags.FLAGS, nones)
        return rest
    except (AttributeError, KeyError) as e:
        # ml_collections looks the field of a --config.<field>=<value> flag up with getattr: a
        # field the config does not have (a typo) surfaces as its KeyError / AttributeError.
        if debug():
            raise
        inner = e
        while isinstance(inner, BaseException) and inner.args:  # AttributeError(KeyError(message))
            inner = inner.args[0]
        name, _, hint = str(inner).partition("\n")
        name = name.strip("'\"")
        flag_names = [a.split("=", 1)[0] for a in argv[1:] if a.startswith("--")]
        given = next((f for f in flag_names if name in f.lstrip("-").split(".")[1:]), None)
        if given is None:  # not a flag's field: e.g. a bug inside a config file's get_config
            raise
        _fail(f"{given}: the config has no field {name!r}" + (f" ({hint.strip()})" if hint else "")
              + "; the fields are the config file's, plus every model field of its task "
              "(docs/training.md, 'Configs').")
    except flags.Error as e:
        if debug():
            raise
        # ml_collections embeds the config file's whole traceback in the flag error: keep the
        # flag and the exception line.
        lines = [l.strip() for l in str(e).splitlines() if l.strip()]
        message = lines[0] if len(lines) < 3 else f"{lines[0]} {lines[-1]}"
        _fail(message)


def run_absl(main: Callable[[Any], Any]) -> None:
    """``absl.app.run(main)`` with one-line errors for bad flags, config files and inputs."""
    with _extras.imports(__name__):
        from absl import app  # pylint: disable=g-import-not-at-top
    app.run(report_errors(main), flags_parser=_parse_absl_flags)


def run(main: Callable[[], Any]) -> Any:
    """Calls an argparse ``main()`` with one-line errors; returns its result."""
    return report_errors(main)()


def _checkpoint_steps(workdir: str) -> set:
    directory = run_lib.checkpoint_dir(workdir)
    return {d for d in os.listdir(directory) if d.isdigit()} if os.path.isdir(directory) else set()


def _nearest_existing(path: str) -> str:
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return path


@contextlib.contextmanager
def workdir_cleanup(workdir: str) -> Iterator[None]:
    """Removes what the block created for ``workdir`` when it fails with a config or input error
    (not a non-finite loss: its metrics say what happened) and saved no new checkpoint: a
    workdir that did not exist, with the parent folders created for it; in a workdir that
    existed, exactly the entries that were not there before (``config.json``, an empty
    ``checkpoints/``, ``metrics.jsonl``, ``tensorboard/``, ...), never one that was, and never
    the lock files (``.lock``, ``.lock.<i>``): goat_jax/train/lock.py keeps them, since a lock
    file deleted after its lock is released lets two later trainers lock two different files. So
    a refused run leaves the disk as it found it but for the lock (docs/training.md). An error that says the
    workdir belongs to another process (``keeps_workdir``, e.g. the workdir lock's) removes
    nothing."""
    full = os.path.abspath(workdir)
    existed = os.path.isdir(full)
    before = set(os.listdir(full)) if existed else set()
    anchor = _nearest_existing(full)  # the folders below it, up to the workdir, are this run's
    steps = _checkpoint_steps(full)
    try:
        yield
    except USER_ERRORS as e:
        if not isinstance(e, FloatingPointError) and not getattr(e, "keeps_workdir", False) \
                and os.path.isdir(full) and _checkpoint_steps(full) <= steps:
            if existed:
                for name in set(os.listdir(full)) - before:
                    if name == lock_lib.LOCK_FILE or name.startswith(lock_lib.LOCK_FILE + "."):
                        continue
                    path = os.path.join(full, name)
                    if os.path.isdir(path) and not os.path.islink(path):
                        shutil.rmtree(path, ignore_errors=True)
                    else:
                        os.remove(path)
            else:
                shutil.rmtree(full, ignore_errors=True)
                parent = os.path.dirname(full)
                while parent != anchor and parent.startswith(anchor + os.sep):
                    try:
                        os.rmdir(parent)  # only while empty: another process may use it now
                    except OSError:
                        break
                    parent = os.path.dirname(parent)
        raise

INTERRUPTED_EXIT_CODE = 130  # 128 + SIGINT, what a shell reports for Ctrl-C


def interrupt_exits_now(what: str) -> None:
    """Makes Ctrl-C (SIGINT) end the process at once, as SIGTERM does, with one line naming
    ``what`` was stopped and exit status 130, no traceback.

    Why: Python runs its SIGINT handler (the ``KeyboardInterrupt``) only when the main thread
    returns to Python bytecode, and an XLA compile runs for minutes in C++ without returning, so
    Ctrl-C used to wait for the compile to end and then print a traceback. The C-level handler
    does run at once and writes the signal's number to the wakeup fd; a daemon thread waiting on
    that fd then ends the process (the compile releases the GIL while it runs). For commands with
    nothing to save on the way out (``experiments.compile``); the trainer keeps its own handling."""
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    # A Python-level handler (any) makes the C-level one write to the wakeup fd; the exit itself
    # happens in the thread, since this handler would run only after the compile.
    signal.signal(signal.SIGINT, lambda signum, frame: None)

    def watch():
        while True:
            data = os.read(read_fd, 64)
            if signal.SIGINT in data or not data:
                break
        print(f"interrupted (Ctrl-C): stopped {what}", file=sys.stderr, flush=True)
        os._exit(INTERRUPTED_EXIT_CODE)  # pylint: disable=protected-access  # at once, as SIGTERM

    threading.Thread(target=watch, name="sigint-exit", daemon=True).start()
