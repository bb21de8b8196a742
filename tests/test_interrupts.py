"""Ctrl-C saves like SIGTERM (issue #67, item 4; goat_jax/train/interrupts.py; the table of every
long-running command under SIGINT, SIGTERM and SIGHUP is in docs/training.md, "Stopping a run").

* ``experiments.train`` (a real process, Ctrl-C mid-training): a checkpoint at the step it was on,
  one line ``interrupted: saved a checkpoint at step k``, exit 130, no traceback. It used to print
  a ~30-line ``KeyboardInterrupt`` traceback and save nothing.
* A second Ctrl-C exits at once (130), also while the main thread is blocked in C.
* SIGHUP (the terminal closed) is a stop request like SIGTERM, unless ``nohup`` ignores it.
* ``experiments.evaluate`` stopped by Ctrl-C writes the evaluations that finished first.
* The report harness stopped by Ctrl-C mid-training: the trainer saved, nothing of the run is
  evaluated or reported, exit 130.
"""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from goat_jax.train import interrupts
from goat_jax.train import run as run_lib
from tests import config_helpers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _logged_steps(workdir):
    try:
        return [r["step"] for r in run_lib.read_metrics(str(workdir)) if "train_loss" in r]
    except OSError:
        return []


@pytest.fixture(scope="module")
def ctrl_c_run(tmp_path_factory):
    """``experiments.train`` of the smoke LM for 5,000 steps (no checkpoint before the end), sent
    one Ctrl-C once it has logged step 3: ``(returncode, stderr, workdir)``."""
    workdir = tmp_path_factory.mktemp("ctrl_c") / "run"
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=config_helpers.xla_flags(1))
    proc = subprocess.Popen(
        [sys.executable, "-m", "experiments.train", "--config", "configs/lm_tiny.py:goat,smoke", "--workdir",
         str(workdir), "--config.num_train_steps=5000", "--config.checkpoint_every_steps=5000",
         "--config.eval_every_steps=0", "--config.log_every_steps=1", "--config.progress_bar=False"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        start = time.time()
        while len(_logged_steps(workdir)) < 3:
            if proc.poll() is not None or time.time() - start > 300:
                pytest.fail(f"the run ended (code {proc.poll()}) or stalled before step 3:\n{proc.stderr.read()[-3000:]}")
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, stderr, workdir


def test_ctrl_c_in_training_saves_a_checkpoint_with_one_line(ctrl_c_run):
    returncode, stderr, workdir = ctrl_c_run
    assert returncode == 130, stderr[-3000:]
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr[-3000:]
    lines = [l for l in stderr.splitlines() if "interrupted" in l]
    assert len(lines) == 1 and lines[0].endswith(tuple(f"interrupted: saved a checkpoint at step {k}"
                                                       for k in range(3, 5000))), stderr[-3000:]
    step = int(lines[0].rsplit(" ", 1)[-1])
    assert run_lib.checkpoint_steps(str(workdir)) == (step,)  # the only checkpoint: the one Ctrl-C saved
    assert max(_logged_steps(workdir)) == step


_SECOND_CTRL_C = r'''
import ctypes, time
from goat_jax.train import interrupts

class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]

stop = interrupts.StopSignals()
libc = ctypes.CDLL(None, use_errno=True)
mutex = ctypes.create_string_buffer(64)
libc.pthread_mutex_lock(mutex)
print("BLOCKED", flush=True)  # in C for 20 s, as in an XLA compile: Python handlers wait for it
libc.pthread_mutex_timedlock(mutex, ctypes.byref(_Timespec(int(time.time()) + 20, 0)))
raise SystemExit("the block ran to its end")
'''


def test_a_second_ctrl_c_exits_at_once_even_in_c():
    proc = subprocess.Popen([sys.executable, "-c", _SECOND_CTRL_C], cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "BLOCKED", proc.stderr.read()[-2000:]
        sent = time.monotonic()
        proc.send_signal(signal.SIGINT)
        time.sleep(0.3)
        proc.send_signal(signal.SIGINT)
        stderr = proc.communicate(timeout=10)[1]
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130 and took < 5, (proc.returncode, took, stderr[-2000:])
    assert stderr.strip().splitlines()[-1].startswith("interrupted again (Ctrl-C): exiting at once without saving")


def _sighup_noted(stop):
    os.kill(os.getpid(), signal.SIGHUP)
    deadline = time.time() + 5
    while not stop.requested and time.time() < deadline:
        time.sleep(0.01)
    return stop.signum == signal.SIGHUP and stop.reached(1)


def test_sighup_is_a_stop_request_unless_nohup_ignores_it():
    start = signal.signal(signal.SIGHUP, signal.SIG_DFL)  # as in a terminal, whatever ran this test
    try:
        _sighup_cases()
    finally:
        signal.signal(signal.SIGHUP, start)


def _sighup_cases():
    with interrupts.stop_signals() as stop:
        assert _sighup_noted(stop)
        assert stop.saved_line(7) == "SIGHUP: saved a checkpoint at step 7; exiting."
    with interrupts.raise_on_stop():  # a trainer inside the harness takes SIGHUP over, and gives it back
        outer = signal.getsignal(signal.SIGHUP)
        with interrupts.stop_signals() as stop:
            assert _sighup_noted(stop)
        assert signal.getsignal(signal.SIGHUP) is outer
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)  # what nohup does
    try:
        with interrupts.stop_signals() as stop:
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN  # left ignored
            os.kill(os.getpid(), signal.SIGHUP)
            time.sleep(0.1)
            assert not stop.requested
    finally:
        signal.signal(signal.SIGHUP, previous)


def test_evaluate_stopped_by_ctrl_c_writes_the_evaluations_that_finished(ctrl_c_run, tmp_path, monkeypatch):
    """Ctrl-C during the second evaluation: the first one's results are in --out (they were lost:
    only an ``Exception`` kept the finished ones, and ``KeyboardInterrupt`` is not one)."""
    from experiments import evaluate  # pylint: disable=g-import-not-at-top
    from goat_jax.eval import runs  # pylint: disable=g-import-not-at-top

    def interrupted(run, *a, **k):
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C, while the sinks evaluation runs
        time.sleep(30)
        pytest.fail("the Ctrl-C did not stop the evaluation")

    monkeypatch.setattr(runs, "eval_sinks", interrupted)
    out = tmp_path / "eval"
    before = signal.getsignal(signal.SIGINT)
    with pytest.raises((interrupts.Stopped, KeyboardInterrupt)):
        evaluate.main(["--workdir", str(ctrl_c_run[2]), "--label", "run", "--evals", "extrapolation,sinks",
                       "--multipliers", "1", "--out", str(out)])
    kept = json.loads((out / "results.json").read_text())
    assert "extrapolation" in kept["run"] and "sinks" not in kept["run"]  # the finished one only
    assert signal.getsignal(signal.SIGINT) is before  # handlers restored


def test_the_harness_stopped_by_ctrl_c_mid_training_saves_and_reports_nothing(tmp_path, monkeypatch, capsys):
    import dataclasses  # pylint: disable=g-import-not-at-top

    from experiments import reproduce  # pylint: disable=g-import-not-at-top
    from goat_jax.reproduce import jobs as jobs_lib  # pylint: disable=g-import-not-at-top
    from goat_jax.reproduce import suites  # pylint: disable=g-import-not-at-top

    suite = dataclasses.replace(suites.SUITES["smoke"], name="smoke_ctrl_c", tasks=(), toy="", encodings=("goat",),
                                lm_variants=(), retrieval_variants=(), multipliers=(1,), standard_trials=1,
                                sink_examples=1)
    monkeypatch.setitem(suites.SUITES, "smoke_ctrl_c", suite)
    real_config = jobs_lib.job_config

    def long_config(job):  # long enough that Ctrl-C lands mid-training; no checkpoint but Ctrl-C's
        config = real_config(job)
        config.num_train_steps, config.checkpoint_every_steps, config.eval_every_steps = 5000, 5000, 0
        return config

    monkeypatch.setattr(jobs_lib, "job_config", long_config)
    workdir = tmp_path / "runs" / "jargon" / "goat"

    def ctrl_c_once_training():
        start = time.time()
        while time.time() - start < 300:
            if _logged_steps(workdir) and signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
                os.kill(os.getpid(), signal.SIGINT)
                return
            time.sleep(0.05)

    threading.Thread(target=ctrl_c_once_training, daemon=True).start()
    try:
        rc = reproduce.main(["--suite", "smoke_ctrl_c", "--families", "lm", "--workdir", str(tmp_path / "runs"),
                             "--out", str(tmp_path / "out")])
    except KeyboardInterrupt:
        rc = "KeyboardInterrupt"  # before issue #67: the trainer's step was interrupted, nothing saved
    log = capsys.readouterr().out
    assert rc == 130, log[-3000:]
    assert "SIGINT: a checkpoint was saved" in log and "no report written" in log
    steps = run_lib.checkpoint_steps(str(workdir))
    assert steps and 0 < steps[-1] < 5000
    assert not (workdir / jobs_lib.EVAL_CACHE).exists() and not (tmp_path / "out" / "REPORT.md").exists()
