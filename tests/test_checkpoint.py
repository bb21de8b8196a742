"""Checkpoints: round trip, keep-last-N, config fingerprint, and exact resume after SIGTERM and
SIGKILL of ``python -m experiments.train`` (compared step by step with an uninterrupted run)."""

import json
import os
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from goat_jax.train import checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = {"seed": 0, "num_train_steps": 10, "log_every_steps": 1, "mesh": {"data": -1},
          "model": {"embed_dim": 8, "remat": False}, "optimizer": {"learning_rate": 1e-3}}


def _state(value=1.0):
    return {"params": {"w": jnp.full((4, 3), value)}, "step": jnp.array(7, jnp.int32)}


def _abstract(tree):
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), tree)


# ----------------------------------------------------------------------------------------------
# Unit tests (in process)
# ----------------------------------------------------------------------------------------------


def test_round_trip_state_and_data_state(tmp_path):
    ckpt = checkpoint.Checkpointer(str(tmp_path), CONFIG, keep=2)
    ckpt.save(3, _state(2.5), {"parent": {"next_index": 17}, "offset": 4}, wait=True)
    state, data_state = ckpt.restore(3, _abstract(_state()))
    np.testing.assert_array_equal(state["params"]["w"], np.full((4, 3), 2.5))
    assert int(state["step"]) == 7
    assert data_state == {"parent": {"next_index": 17}, "offset": 4}
    ckpt.close()


def test_keeps_last_n_and_skips_existing_steps(tmp_path):
    ckpt = checkpoint.Checkpointer(str(tmp_path), CONFIG, keep=2)
    for step in (1, 2, 3):
        assert ckpt.save(step, _state(step), {"i": step})
    assert not ckpt.save(3, _state(99.0), {"i": 99})  # already saved: not overwritten
    ckpt.wait()
    assert ckpt.all_steps() == (2, 3) and ckpt.latest_step() == 3
    state, data_state = ckpt.restore(3, _abstract(_state()))
    assert float(state["params"]["w"][0, 0]) == 3.0 and data_state == {"i": 3}
    ckpt.close()


def test_fingerprint_ignores_cadence_and_mesh_but_not_model():
    same = json.loads(json.dumps(CONFIG))
    same["log_every_steps"], same["mesh"] = 100, {"data": 8}
    assert checkpoint.config_fingerprint(same) == checkpoint.config_fingerprint(CONFIG)
    changed = json.loads(json.dumps(CONFIG))
    changed["model"]["embed_dim"] = 16
    assert checkpoint.config_fingerprint(changed) != checkpoint.config_fingerprint(CONFIG)


def test_incompatible_config_fails_without_touching_checkpoints(tmp_path):
    ckpt = checkpoint.Checkpointer(str(tmp_path), CONFIG)
    ckpt.save(5, _state(), {"i": 5}, wait=True)
    ckpt.close()
    before = sorted(os.listdir(tmp_path))
    other = json.loads(json.dumps(CONFIG))
    other["model"]["embed_dim"] = 16
    other["optimizer"]["learning_rate"] = 3e-4
    ckpt = checkpoint.Checkpointer(str(tmp_path), other)
    with pytest.raises(checkpoint.IncompatibleCheckpointError) as err:
        ckpt.check_compatible()
    message = str(err.value)
    assert "model.embed_dim: checkpoint 8 vs now 16" in message
    assert "optimizer.learning_rate" in message and "fresh --workdir" in message
    assert sorted(os.listdir(tmp_path)) == before
    ckpt.close()


def test_field_added_at_its_default_resumes_and_other_values_do_not(tmp_path):
    """A run saved before a config field existed resumes when the field is set to the task's
    default for it (the same computation); any other value is a difference, as is a new field
    the task declares no default for."""
    ckpt = checkpoint.Checkpointer(str(tmp_path), CONFIG)
    ckpt.save(5, _state(), {"i": 5}, wait=True)
    ckpt.close()
    defaults = {"model.sink": "official", "model.extra": None}
    for sink, extra, ok in (("official", None, True), ("linear", None, False), ("official", 0.5, False)):
        newer = json.loads(json.dumps(CONFIG))
        newer["model"].update(sink=sink, extra=extra)
        ckpt = checkpoint.Checkpointer(str(tmp_path), newer, field_defaults=defaults)
        if ok:
            assert ckpt.check_compatible() == {}
        else:
            with pytest.raises(checkpoint.IncompatibleCheckpointError, match="checkpoint '<absent>' vs now"):
                ckpt.check_compatible()
        ckpt.close()
    newer = json.loads(json.dumps(CONFIG))
    newer["model"]["sink"] = "official"
    ckpt = checkpoint.Checkpointer(str(tmp_path), newer)  # no defaults declared: refused
    with pytest.raises(checkpoint.IncompatibleCheckpointError, match="model.sink"):
        ckpt.check_compatible()
    ckpt.close()


def test_task_defaults_are_the_model_dataclass_defaults():
    from goat_jax.tasks import lm, vit
    defaults = lm.TASK.fields.defaults()
    assert defaults["model.sink_extrapolation"] == "official" and defaults["data.span_loss_weight"] is None
    assert vit.TASK.fields.defaults()["model.position_encoding"] == "goat"


def test_leftover_temporary_directory_is_ignored(tmp_path):
    """A save interrupted by SIGKILL leaves a tmp directory; it is not a checkpoint."""
    ckpt = checkpoint.Checkpointer(str(tmp_path), CONFIG)
    ckpt.save(2, _state(), {"i": 2}, wait=True)
    ckpt.close()
    os.makedirs(tmp_path / "4.orbax-checkpoint-tmp-123" / "state")
    ckpt = checkpoint.Checkpointer(str(tmp_path), CONFIG)
    assert ckpt.latest_step() == 2
    ckpt.close()


# ----------------------------------------------------------------------------------------------
# Kill and resume the real entry point
# ----------------------------------------------------------------------------------------------

STEPS = 80  # the kill lands at step ~20-25, with ~55 steps and ~6 checkpoint saves (seconds) to spare
_ARGS = ["--config", "configs/lm_tiny.py:goat,smoke", f"--config.num_train_steps={STEPS}",
         "--config.checkpoint_every_steps=10", "--config.keep_checkpoints=3",
         "--config.progress_bar=False"]


def _command(workdir):
    return [sys.executable, "-m", "experiments.train", "--workdir", str(workdir), *_ARGS]


def _env():
    return dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=1")


def _losses(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return {r["step"]: r["train_loss"] for r in rows if "train_loss" in r}, rows


def _run_to_end(workdir):
    proc = subprocess.run(_command(workdir), cwd=ROOT, env=_env(), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _wait_until(proc, condition, what, timeout=300):
    start = time.time()
    while not condition():
        if proc.poll() is not None:
            pytest.fail(f"the run exited (code {proc.returncode}) before {what}:\n"
                        f"{proc.stderr.read()[-3000:]}")
        if time.time() - start > timeout:
            proc.kill()
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.01)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Per-step losses of an uninterrupted run."""
    workdir = tmp_path_factory.mktemp("reference")
    _run_to_end(workdir)
    losses, _ = _losses(workdir)
    assert sorted(losses) == list(range(1, STEPS + 1))
    return losses


def _logged_step(workdir):
    try:
        with open(os.path.join(workdir, "metrics.jsonl")) as f:
            lines = f.read().splitlines()
        return max((json.loads(l)["step"] for l in lines[:-1]), default=0)  # last may be partial
    except (FileNotFoundError, json.JSONDecodeError):
        return 0


def _complete_checkpoints(workdir):
    directory = os.path.join(workdir, "checkpoints")
    if not os.path.isdir(directory):
        return []
    return sorted(int(d) for d in os.listdir(directory) if d.isdigit())


@pytest.mark.parametrize("sig", [
    pytest.param(signal.SIGTERM, id="sigterm", marks=pytest.mark.slow(reason="SIGKILL covers the resume; SIGTERM adds the graceful stop")),
    pytest.param(signal.SIGKILL, id="sigkill")])
def test_killed_run_resumes_with_identical_losses(tmp_path, reference, sig):
    proc = subprocess.Popen(_command(tmp_path), cwd=ROOT, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        if sig == signal.SIGTERM:
            _wait_until(proc, lambda: _logged_step(tmp_path) >= 25, "step 25 was logged")
        else:
            _wait_until(proc, lambda: any(s >= 20 for s in _complete_checkpoints(tmp_path)),
                        "a checkpoint at step >= 20")
        proc.send_signal(sig)
        _, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    if sig == signal.SIGTERM:
        # A clean exit after checkpointing the step it was on.
        assert proc.returncode == 0, stderr[-3000:]
        assert "SIGTERM: saved a checkpoint at step" in stderr
    else:
        assert proc.returncode == -signal.SIGKILL
    resume_step = _complete_checkpoints(tmp_path)[-1]
    assert 0 < resume_step < STEPS, "the kill landed after the run finished"

    proc = _run_to_end(tmp_path)
    assert f"resumed from step {resume_step}" in proc.stderr
    losses, rows = _losses(tmp_path)
    train_steps = [r["step"] for r in rows if "train_loss" in r]
    assert train_steps == list(range(1, STEPS + 1))  # each step logged once, in order
    for step in range(resume_step + 1, STEPS + 1):
        assert losses[step] == reference[step], (step, losses[step], reference[step])
