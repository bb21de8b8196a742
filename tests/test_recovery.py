"""What happens when things go wrong: damaged checkpoints are skipped (and kept), only finite
states are saved, and the advice of the non-finite error, followed literally, continues the run."""

import json
import logging
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.config_helpers import lm_smoke_config
from goat_jax.train import checkpoint
from goat_jax.train import trainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = {"seed": 0, "num_train_steps": 10, "optimizer": {"learning_rate": 1e-3, "grad_clip": 1.0},
          "model": {"embed_dim": 8}}


def _state(value):
    return {"params": {"w": jnp.full((4, 3), value)}, "step": jnp.array(7, jnp.int32)}


def _abstract(tree):
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), tree)


def _truncate_state(step_dir):
    """Cuts the largest file of the saved train state to half its size."""
    files = [os.path.join(r, f) for r, _, fs in os.walk(os.path.join(step_dir, "state")) for f in fs
             if f != "commit_success.txt"]
    path = max(files, key=os.path.getsize)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def _truncate_metadata(step_dir):
    """Cuts the state's pytree metadata (what the issue saw as a structure error)."""
    path = os.path.join(step_dir, "state", "_METADATA")
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def _remove_data_state(step_dir):
    os.remove(os.path.join(step_dir, "data", "process_0-of-1.json"))


CORRUPTIONS = {"missing_data_state": _remove_data_state, "truncated_state_file": _truncate_state,
               "truncated_state_metadata": _truncate_metadata}


# ----------------------------------------------------------------------------------------------
# Damaged checkpoints: fall back to the newest one that restores, say so, keep the damaged one
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("corrupt", sorted(CORRUPTIONS))
def test_damaged_latest_checkpoint_falls_back_and_is_kept(tmp_path, caplog, corrupt):
    ckpt = checkpoint.Checkpointer(str(tmp_path / "checkpoints"), CONFIG)
    for step in (1, 2, 3):
        ckpt.save(step, _state(float(step)), {"i": step}, wait=True)
    ckpt.close()
    CORRUPTIONS[corrupt](str(tmp_path / "checkpoints" / "3"))

    ckpt = checkpoint.Checkpointer(str(tmp_path / "checkpoints"), CONFIG)
    assert ckpt.check_compatible() == {}
    with caplog.at_level(logging.WARNING):
        step, state, data_state = ckpt.restore_latest(_abstract(_state(0.0)))
    assert step == 2 and data_state == {"i": 2}
    np.testing.assert_array_equal(state["params"]["w"], np.full((4, 3), 2.0))
    warnings = " ".join(r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)
    assert "checkpoint step 3" in warnings and "does not restore" in warnings
    assert "resuming from step 2" in warnings
    if corrupt == "missing_data_state":  # named as missing, not as a process-count mismatch
        assert "process_0-of-1.json is missing" in warnings and "number of processes" not in warnings
    # Kept for inspection, out of the way of the resumed run's own step-3 save.
    assert os.path.isdir(tmp_path / "corrupt_checkpoints" / "3" / "state")
    assert ckpt.all_steps() == (1, 2)
    assert ckpt.save(3, _state(3.5), {"i": 3}, wait=True)
    ckpt.close()


def test_process_count_mismatch_is_still_reported_as_such(tmp_path):
    ckpt = checkpoint.Checkpointer(str(tmp_path), CONFIG)
    ckpt.save(1, _state(1.0), {"i": 1}, wait=True)
    ckpt.close()
    data = tmp_path / "1" / "data"
    os.rename(data / "process_0-of-1.json", data / "process_0-of-2.json")
    ckpt = checkpoint.Checkpointer(str(tmp_path), CONFIG)
    with pytest.raises(checkpoint.IncompatibleCheckpointError, match=r"written by 2 process\(es\), not the 1"):
        ckpt.restore_latest(_abstract(_state(0.0)))
    ckpt.close()


def test_no_restorable_checkpoint_is_an_error_that_moves_nothing(tmp_path):
    ckpt = checkpoint.Checkpointer(str(tmp_path / "checkpoints"), CONFIG)
    for step in (1, 2):
        ckpt.save(step, _state(float(step)), {"i": step}, wait=True)
    ckpt.close()
    for step in (1, 2):
        _remove_data_state(str(tmp_path / "checkpoints" / str(step)))
    ckpt = checkpoint.Checkpointer(str(tmp_path / "checkpoints"), CONFIG)
    with pytest.raises(checkpoint.CorruptCheckpointError, match=r"no checkpoint .* restores: step 2: .*; step 1: "):
        ckpt.restore_latest(_abstract(_state(0.0)))
    assert ckpt.all_steps() == (1, 2) and not (tmp_path / "corrupt_checkpoints").exists()
    ckpt.close()


_smoke = lm_smoke_config


def _losses(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return [(r["step"], r["train_loss"]) for r in rows if "train_loss" in r]


@pytest.mark.slow(reason="an uninterrupted and a resumed training run")
def test_trainer_resumes_from_the_newest_restorable_checkpoint(tmp_path, caplog):
    """A run whose step-10 checkpoint lost a state file resumes from step 5 and logs steps 6-10
    with exactly the losses of the uninterrupted run."""
    config = _smoke(num_train_steps=10)
    trainer.train_and_evaluate(config, str(tmp_path))
    first = dict(_losses(tmp_path))
    _truncate_state(str(tmp_path / "checkpoints" / "10"))
    with caplog.at_level(logging.WARNING):
        summary = trainer.train_and_evaluate(config, str(tmp_path))
    assert summary["step"] == 10 and summary["train_loss"] == first[10]  # step 10 was recomputed
    assert "resuming from step 5" in caplog.text and "checkpoint step 10" in caplog.text
    assert _losses(tmp_path) == sorted(first.items())  # rows 6-10 rewritten with the same losses
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["10", "5"]
    assert os.listdir(tmp_path / "corrupt_checkpoints") == ["10"]


# ----------------------------------------------------------------------------------------------
# Non-finite states are never saved, and the error's advice works as written
# ----------------------------------------------------------------------------------------------


def test_resume_with_changes_admits_only_optimizer_fields(tmp_path):
    ckpt = checkpoint.Checkpointer(str(tmp_path), CONFIG)
    ckpt.save(1, _state(1.0), {"i": 1}, wait=True)
    ckpt.close()
    lower = dict(CONFIG, optimizer={"learning_rate": 1e-4, "grad_clip": 1.0})
    ckpt = checkpoint.Checkpointer(str(tmp_path), lower)
    with pytest.raises(checkpoint.IncompatibleCheckpointError, match=r"rerun with --resume_with_changes"):
        ckpt.check_compatible()
    assert ckpt.check_compatible(allow_changes=True) == {"optimizer.learning_rate": (1e-3, 1e-4)}
    ckpt.close()
    wider = dict(lower, model={"embed_dim": 16})
    ckpt = checkpoint.Checkpointer(str(tmp_path), wider)
    with pytest.raises(checkpoint.IncompatibleCheckpointError, match=r"model\.embed_dim: checkpoint 8 vs now 16"):
        ckpt.check_compatible(allow_changes=True)
    ckpt.close()


OVERFLOW_RUN = {"num_train_steps": 6, "checkpoint_every_steps": 1}


def _overflow_at_step_3(tmp_path, monkeypatch) -> str:
    """Trains ``OVERFLOW_RUN`` in ``tmp_path`` with a step whose update makes every parameter NaN
    at step 3 while its loss and gradient stay finite (what an overflowing step does); checks
    that the run stops there having saved nothing after step 2, and returns the error."""
    from goat_jax.train import steps as steps_lib  # pylint: disable=g-import-not-at-top  # where the engine builds it

    original = steps_lib.make_train_step

    def overflowing_step(*args, **kwargs):
        step_fn = original(*args, **kwargs)

        def train_step(state, batch):
            new, metrics = step_fn(state, batch)
            params = jax.tree.map(lambda p: jnp.where(new.step == 3, jnp.nan, p), new.params)
            return new.replace(params=params), metrics
        return train_step

    with monkeypatch.context() as patch:
        patch.setattr(steps_lib, "make_train_step", overflowing_step)
        with pytest.raises(FloatingPointError) as info:
            trainer.train_and_evaluate(_smoke(**OVERFLOW_RUN), str(tmp_path))
    message = str(info.value)
    assert "non-finite in step 3" in message and "last finite checkpoint (step 2)" in message
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["1", "2"]
    return message


def test_nonfinite_state_is_never_saved(tmp_path, monkeypatch):
    """Step 3's update makes every parameter NaN while its loss and gradient are finite: the run
    stops at step 3, names step 2 as the last finite checkpoint, and saved nothing after it."""
    _overflow_at_step_3(tmp_path, monkeypatch)


@pytest.mark.slow(reason="the first half is test_nonfinite_state_is_never_saved; this adds a resume through the CLI")
def test_nonfinite_state_is_never_saved_and_the_advice_continues_the_run(tmp_path, monkeypatch):
    """After the overflow of test_nonfinite_state_is_never_saved, the error's advice, run as
    written with a lower learning rate, resumes from step 2 and finishes."""
    message = _overflow_at_step_3(tmp_path, monkeypatch)
    advice = re.search(r"rerun the same command adding (--resume_with_changes --config\.optimizer\.learning_rate=)<lower>",
                       message)
    assert advice, message
    command = [sys.executable, "-m", "experiments.train", "--config", "configs/lm_tiny.py:goat,smoke",
               "--workdir", str(tmp_path), "--config.progress_bar=False",
               *(f"--config.{k}={v}" for k, v in OVERFLOW_RUN.items()), *advice.group(1).split()[:-1],
               advice.group(1).split()[-1] + "1e-3"]
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from step 2" in proc.stderr
    steps = [s for s, loss in _losses(tmp_path) if np.isfinite(loss)]
    assert steps[-4:] == [3, 4, 5, 6]
    changes = [json.loads(line) for line in open(tmp_path / "config_changes.jsonl")]
    assert changes == [{"step": 2, "changes": {"optimizer.learning_rate": [3e-3, 1e-3]}}]
    assert json.loads((tmp_path / "config.json").read_text())["optimizer"]["learning_rate"] == 1e-3


@pytest.mark.slow(reason="trains twice; the first run's advice is tested in the default suite")
def test_a_restored_state_that_fails_at_once_is_named(tmp_path):
    """The 8th batch is NaN (tests/test_trainer.py POISONED) and the checkpoint is at step 7: the
    first run advises resuming from step 7; resuming, the very first step fails, and the error
    says to set checkpoint 7 aside instead of repeating the advice."""
    config = _smoke(task="tests.test_trainer:POISONED", num_train_steps=10, checkpoint_every_steps=7)
    with pytest.raises(FloatingPointError, match=r"step 8.*last finite checkpoint \(step 7\)"):
        trainer.train_and_evaluate(config, str(tmp_path))
    with pytest.raises(FloatingPointError, match=r"step 8.*restored from step 7 fails at once.*"
                                                 r"Move .*checkpoints/7 aside"):
        trainer.train_and_evaluate(config, str(tmp_path))


def test_evaluation_reads_the_newest_checkpoint_that_restores(tmp_path, caplog):
    """``experiments.evaluate`` on a run whose newest checkpoint is damaged: the run is loaded
    from the newest one that restores (named in a warning), read-only (the damaged one stays);
    with every checkpoint damaged, one error listing each."""
    from goat_jax.train import run as run_lib

    trainer.train_and_evaluate(_smoke(num_train_steps=10), str(tmp_path))
    _truncate_state(str(tmp_path / "checkpoints" / "10"))
    with caplog.at_level(logging.WARNING):
        loaded = run_lib.load_run(str(tmp_path))
    assert loaded.step == 5
    assert "checkpoint step 10" in caplog.text and "evaluating step 5" in caplog.text
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["10", "5"]  # nothing moved or removed
    _truncate_state(str(tmp_path / "checkpoints" / "5"))
    with pytest.raises(ValueError, match=r"no checkpoint in .* restores: step 10: .*; step 5: "):
        run_lib.load_run(str(tmp_path))
