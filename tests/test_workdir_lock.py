"""One trainer per workdir (goat_jax/train/lock.py): a second real ``experiments.train`` on a
workdir in use stops at once with one line naming the workdir and the holder, touches none of
the holder's files, and a SIGKILLed holder leaves no stale lock."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from goat_jax import cli
from goat_jax.train import lock as lock_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _train_cmd(workdir, *overrides):
    return [sys.executable, "-m", "experiments.train", "--config", "configs/lm_tiny.py:goat,smoke",
            "--workdir", str(workdir), "--config.progress_bar=False", *overrides]


def _env():
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("GOAT_DEBUG", None)
    return env


def test_second_trainer_on_a_busy_workdir_stops_at_once_and_names_the_holder(tmp_path):
    workdir = tmp_path / "run"
    # The first trainer: long enough to still be running when the second starts.
    first = subprocess.Popen(_train_cmd(workdir, "--config.num_train_steps=100000",
                                        "--config.checkpoint_every_steps=100000",
                                        "--config.eval_every_steps=0",
                                        "--config.log_every_steps=1"),
                             cwd=ROOT, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        metrics = workdir / "metrics.jsonl"
        deadline = time.time() + 240
        while time.time() < deadline and first.poll() is None:
            if metrics.exists() and len(metrics.read_text().splitlines()) >= 2:
                break
            time.sleep(0.5)
        assert first.poll() is None, first.stderr.read().decode()[-3000:]
        held = json.loads((workdir / lock_lib.LOCK_FILE).read_text())
        assert held["pid"] == first.pid

        second = subprocess.run(_train_cmd(workdir), cwd=ROOT, env=_env(), capture_output=True,
                                text=True, timeout=300)
        assert second.returncode == 1, second.stderr[-3000:]
        assert "Traceback" not in second.stderr
        errors = [l for l in second.stderr.splitlines() if l.startswith("error: ")]
        assert len(errors) == 1, second.stderr[-3000:]
        assert f"workdir {workdir} is in use by another trainer: pid {first.pid}" in errors[0]
        # The holder's files are untouched: its metrics keep growing from step 1 in the same file.
        inode = os.stat(metrics).st_ino
        rows_before = len(metrics.read_text().splitlines())
        time.sleep(3)
        rows = [json.loads(l) for l in metrics.read_text().splitlines()]
        assert os.stat(metrics).st_ino == inode and rows[0]["step"] == 1 and len(rows) > rows_before
        assert first.poll() is None
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait(60)
    # SIGKILL leaves no stale lock: the next holder gets it at once.
    fd = lock_lib.acquire(str(workdir))
    assert json.loads((workdir / lock_lib.LOCK_FILE).read_text())["pid"] == os.getpid()
    lock_lib.release(fd)


def test_lock_excludes_within_one_process_and_per_process_index(tmp_path):
    """flock conflicts between two opens even in one process (a test calling the trainer twice
    sees the same rule); each process index of a multi-host run has its own file."""
    with lock_lib.hold(str(tmp_path)):
        with pytest.raises(lock_lib.WorkdirLockedError, match=f"pid {os.getpid()} on host"):
            lock_lib.acquire(str(tmp_path))
        fd = lock_lib.acquire(str(tmp_path), process_index=1)  # another file: not blocked
        assert os.path.exists(tmp_path / ".lock.1")
        lock_lib.release(fd)
    lock_lib.release(lock_lib.acquire(str(tmp_path)))  # released on exit of the block


def test_a_busy_workdir_is_never_cleaned_up(tmp_path):
    """The command-line cleanup removes a workdir it created on a refused run, but not one
    whose lock another process holds (it may have created it an instant earlier)."""
    workdir = tmp_path / "run"
    with pytest.raises(lock_lib.WorkdirLockedError):
        with cli.workdir_cleanup(str(workdir)):
            workdir.mkdir()
            raise lock_lib.WorkdirLockedError("busy")
    assert workdir.exists()


def test_the_cleanup_removes_the_entries_a_refused_run_added_and_the_parents_it_made(tmp_path):
    """In an existing workdir only the new entries go (an old checkpoint and the user's files
    stay); a new nested workdir goes with the parents made for it, not the folder above them;
    a run that saved a new checkpoint, or failed on a non-finite loss, keeps everything."""
    old = tmp_path / "old"
    (old / "checkpoints" / "5").mkdir(parents=True)
    (old / "notes.txt").write_text("mine")

    def refused(workdir, error=ValueError("refused"), checkpoint=None):
        with pytest.raises(type(error)):
            with cli.workdir_cleanup(str(workdir)):
                workdir.mkdir(parents=True, exist_ok=True)
                for name in ("config.json", ".lock", "metrics.jsonl"):
                    (workdir / name).write_text("")
                (workdir / "tensorboard").mkdir(exist_ok=True)
                (workdir / "checkpoints").mkdir(exist_ok=True)
                if checkpoint:
                    (workdir / "checkpoints" / checkpoint).mkdir()
                raise error

    refused(old)
    # The lock file stays (goat_jax/train/lock.py: deleting it would let two trainers lock two files).
    assert sorted(os.listdir(old)) == [".lock", "checkpoints", "notes.txt"] and os.listdir(old / "checkpoints") == ["5"]
    refused(tmp_path / "a" / "b" / "run")
    assert sorted(os.listdir(tmp_path)) == ["old"]
    refused(old, checkpoint="10")
    assert "config.json" in os.listdir(old)
    fresh = tmp_path / "nan"
    refused(fresh, error=FloatingPointError("nan"))
    assert (fresh / "metrics.jsonl").exists()
