"""Reading runs back (goat_jax.train.run): read-only on a live trainer, nothing created in a
folder it reads, and unique labels when evaluating several runs."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from configs import lm_tiny
from goat_jax.eval import runs
from goat_jax.train import run as run_lib
from goat_jax.train import trainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _snapshot(directory):
    """``{relative path: (size, mtime_ns)}`` of everything under ``directory``."""
    out = {}
    for root, dirs, files in os.walk(directory):
        for name in dirs + files:
            path = os.path.join(root, name)
            st = os.stat(path)
            out[os.path.relpath(path, directory)] = (st.st_size if name in files else 0, st.st_mtime_ns)
    return out


def test_evaluating_a_live_run_never_harms_it(tmp_path):
    """A real trainer saves a checkpoint every 2 steps while this test restores its latest
    checkpoint in a loop, and the evaluation CLI runs start to end while the trainer is alive
    (stopped with SIGSTOP after its first checkpoint, continued when the evaluation has
    finished, so the two overlap however loaded the machine is): the trainer finishes with exit 0
    and every checkpoint it wrote restores. (The old reader cleaned up 'temporary' checkpoint
    directories, deleting the save in progress and killing the trainer.)"""
    workdir, out = tmp_path / "run", tmp_path / "eval"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    steps = 20
    trainer = subprocess.Popen(
        [sys.executable, "-m", "experiments.train", "--config", "configs/lm_tiny.py:goat,smoke",
         "--workdir", str(workdir), f"--config.num_train_steps={steps}", "--config.checkpoint_every_steps=2",
         "--config.keep_checkpoints=100", "--config.progress_bar=False"],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    loads, cli = [], None
    try:
        while trainer.poll() is None:
            try:
                loads.append(run_lib.load_run(str(workdir)).step)
            except FileNotFoundError:
                pass  # no config or checkpoint yet
            time.sleep(0.25)  # leave the trainer the CPU it needs between the loads
            if loads and cli is None:
                trainer.send_signal(signal.SIGSTOP)  # alive (lock held, maybe mid-save), not advancing
                cli = subprocess.run([sys.executable, "-m", "experiments.evaluate", "--workdir", str(workdir),
                                      "--evals", "sinks", "--out", str(out)], cwd=ROOT, env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
                assert trainer.poll() is None  # the evaluation ran on a live run
                trainer.send_signal(signal.SIGCONT)
        stderr = trainer.communicate(timeout=600)[1]
    finally:
        if trainer.poll() is None:
            trainer.send_signal(signal.SIGCONT)
            trainer.kill()
    assert trainer.returncode == 0, stderr[-3000:]
    assert cli is not None and cli.returncode == 0, cli.stdout[-3000:]
    assert (out / "results.json").exists()
    assert len(set(loads)) >= 2, loads  # the loop really overlapped the training
    saved = sorted(int(d) for d in os.listdir(workdir / "checkpoints") if d.isdigit())
    assert saved == list(range(2, steps + 1, 2))
    for step in saved:
        assert run_lib.load_run(str(workdir), step).step == step
    assert not [d for d in os.listdir(workdir / "checkpoints") if not d.isdigit() and "tmp" in d]


@pytest.mark.slow(reason="trains a run to read")
def test_reading_writes_nothing(tmp_path):
    """load_run leaves a finished run byte- and mtime-identical, and creates no checkpoints/
    in a folder that has none."""
    workdir = tmp_path / "run"
    config = lm_tiny.get_config("goat,smoke")
    config.num_train_steps, config.progress_bar = 2, False
    trainer.train_and_evaluate(config, str(workdir))
    before = _snapshot(workdir)
    assert run_lib.load_run(str(workdir)).step == 2
    assert _snapshot(workdir) == before

    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text((workdir / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match="has not saved a checkpoint"):
        run_lib.load_run(str(bare))
    assert sorted(os.listdir(bare)) == ["config.json"]


def _fake_run(path, encoding):
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"task": "lm", "model": {"position_encoding": encoding}}))
    return str(path)


def test_labels_are_unique(tmp_path):
    """Two runs of one encoding no longer collapse into one result: they get the workdir name;
    repeated explicit labels are refused."""
    a = _fake_run(tmp_path / "a" / "seed0", "goat")
    b = _fake_run(tmp_path / "b" / "seed1", "goat")
    c = _fake_run(tmp_path / "c" / "seed0", "goat")
    r = _fake_run(tmp_path / "rope", "rope")
    assert runs.run_labels([a, r]) == ["goat", "rope"]
    assert runs.run_labels([a, b, r]) == ["goat (seed0)", "goat (seed1)", "rope"]
    # Same encoding and same workdir name: the path tells them apart.
    labels = runs.run_labels([a, c])
    assert len(set(labels)) == 2 and all(label.startswith("goat (") for label in labels)
    assert runs.run_labels([a, b], ["x", None]) == ["x", "goat"]
    with pytest.raises(ValueError, match=r"--label values must be unique; \['x'\]"):
        runs.run_labels([a, b], ["x", "x"])
    with pytest.raises(ValueError, match="one --label per --workdir"):
        runs.run_labels([a, b], ["x"])


def test_evaluate_cli_refuses_duplicate_labels(tmp_path):
    """Before loading anything: one error line, exit 1, no output directory."""
    a = _fake_run(tmp_path / "a", "goat")
    b = _fake_run(tmp_path / "b", "goat")
    proc = subprocess.run([sys.executable, "-m", "experiments.evaluate", "--workdir", a, "--workdir", b,
                           "--label", "x", "--label", "x", "--out", str(tmp_path / "o")], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert proc.returncode == 1 and "error: --label values must be unique; ['x']" in proc.stderr, proc.stderr
    assert not (tmp_path / "o").exists()


def test_metrics_reader_skips_torn_lines_and_summarizes(tmp_path, rng):
    """read_metrics returns every whole row in order (a line torn by a kill is skipped), and the
    summaries are the max elapsed time and the median throughput of the training rows."""
    rates = rng.uniform(10, 1000, size=int(rng.integers(3, 9)))
    rows = [{"step": i + 1, "train_loss": 1.0, "tokens_per_sec": float(r), "elapsed_s": 2.5 * (i + 1)}
            for i, r in enumerate(rates)]
    rows.insert(2, {"step": 2, "eval_loss": 0.5})  # eval rows carry neither field
    text = "".join(json.dumps(r) + "\n" for r in rows) + '{"step": 99, "train_lo'  # torn by a kill
    (tmp_path / run_lib.METRICS_FILE).write_text(text)
    assert run_lib.read_metrics(str(tmp_path)) == rows
    assert run_lib.training_seconds(str(tmp_path)) == 2.5 * len(rates)
    ordered = sorted(rates)
    assert run_lib.median_throughput(str(tmp_path)) == pytest.approx(ordered[len(ordered) // 2], rel=0, abs=0)
    (tmp_path / run_lib.METRICS_FILE).write_text('{"step": 1, "eval_loss": 0.5}\n')
    assert run_lib.median_throughput(str(tmp_path)) is None and run_lib.training_seconds(str(tmp_path)) == 0.0


def test_last_logged_is_the_newest_row_with_the_key(tmp_path):
    """last_logged: the value of the last row that has the key; None without one or without metrics."""
    assert run_lib.last_logged(str(tmp_path), "eval_loss") is None  # no metrics file yet
    rows = [{"step": 1, "eval_loss": 2.0}, {"step": 2, "train_loss": 1.0}, {"step": 3, "eval_loss": 0.75},
            {"step": 4, "train_loss": 0.5, "eval_loss": None}]
    (tmp_path / run_lib.METRICS_FILE).write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert run_lib.last_logged(str(tmp_path), "eval_loss") == 0.75
    assert run_lib.last_logged(str(tmp_path), "train_loss") == 0.5
    assert run_lib.last_logged(str(tmp_path), "grad_norm") is None


def test_write_whole_replaces_text_and_bytes_and_a_failed_write_leaves_the_old_file(tmp_path, monkeypatch):
    """files.write_whole: the new content in one rename (text or bytes); a write that fails
    midway (here: the rename refused) keeps the old file and leaves no temporary file."""
    from goat_jax import files

    path = str(tmp_path / "f")
    files.write_whole(path, "old\n")
    assert open(path).read() == "old\n"
    files.write_whole(path, b"\x00\xffbytes")
    assert open(path, "rb").read() == b"\x00\xffbytes"
    files.write_whole(path, "old\n")

    def refuse(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(files.os, "replace", refuse)
    with pytest.raises(OSError, match="No space left"):
        files.write_whole(path, "new\n")
    assert open(path).read() == "old\n" and sorted(os.listdir(tmp_path)) == ["f"]
