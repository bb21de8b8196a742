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
from tests import config_helpers

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


def test_a_read_only_reader_prints_no_orbax_warnings_and_reads_the_run(tmp_path, caplog):
    """Every evaluation printed three orbax WARNING lines (read_only=True 'setting
    save_interval_steps=0', 'setting max_to_keep=None', 'Given directory is read only'): the
    reader now asks for what read-only means, and drops only that last notice, for its directory."""
    import logging

    writer = checkpoint.Checkpointer(str(tmp_path), CONFIG, keep=2)
    writer.save(3, _state(2.5), {"i": 3}, wait=True)
    writer.close()
    with caplog.at_level(logging.WARNING):
        reader = checkpoint.Checkpointer(str(tmp_path), CONFIG, keep=2, read_only=True)
        state, data_state = reader.restore(3, _abstract(_state()))
    assert float(state["params"]["w"][0, 0]) == 2.5 and data_state == {"i": 3}
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    # The filter is gone afterwards, and it never hid the same notice for another directory.
    absl = logging.getLogger("absl")
    assert not [f for f in absl.filters if isinstance(f, checkpoint._ReadOnlyNotice)]
    notice = checkpoint._ReadOnlyNotice(str(tmp_path))
    other = logging.LogRecord("absl", logging.WARNING, "", 0, "Given directory is read only=%s", ("/else",), None)
    mine = logging.LogRecord("absl", logging.WARNING, "", 0, "Given directory is read only=%s", (str(tmp_path),), None)
    assert notice.filter(other) and not notice.filter(mine)


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


def _engine_config():
    """Every engine field at its default, the required ones set, as a resolved config dict."""
    from goat_jax.train import validation
    config = {"task": "lm", "num_train_steps": 10, "optimizer": {"learning_rate": 1e-3}}
    for dotted, value in validation.engine_defaults().items():
        section, _, name = dotted.rpartition(".")
        (config.setdefault(section, {}) if section else config)[name] = value
    return json.loads(json.dumps(config, default=str))


def _another(value):
    """A different value of the same field (its kind does not matter to the fingerprint)."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value + 17  # above num_train_steps' 10: a longer run, as a resume may ask for
    return "changed" if value is None or isinstance(value, str) else [["changed"]]


def test_the_resume_lists_are_the_fields_declarations():
    """Every engine field declares its resume behaviour, the checkpoint's lists are those
    declarations (the same lists as when they were written out in checkpoint.py), and the
    checkpoint acts on each: a 'safe' field changes no fingerprint, an 'adjustable' one resumes
    with --resume_with_changes only, a 'fixed' one is refused."""
    from goat_jax.config.fields import RESUME_BEHAVIOURS
    from goat_jax.train import validation
    declared = {(f"{section}.{name}" if section else name): r
                for section, s in validation.ENGINE.items() for name, r in s.resume.items()}
    assert {k: r for k, r in declared.items() if r not in RESUME_BEHAVIOURS} == {}
    assert checkpoint.RESUME_SAFE_FIELDS == {
        "checkpoint_every_steps", "eval_every_steps", "log_every_steps", "keep_checkpoints", "mesh",
        "sharding_rules", "distributed", "progress_bar", "peak_flops_per_device",
        "per_device_batch_size", "profile_steps", "wandb", "context_load_balance",
        "context_strategy",  # added with ring attention: either strategy computes the same function
        "gpu_xla_flags"}  # XLA's GPU scheduling options: the same function, compiled differently
    assert checkpoint.RESUME_ADJUSTABLE_FIELDS == {
        "num_train_steps", "optimizer.learning_rate", "optimizer.warmup_steps", "optimizer.min_lr_ratio",
        "optimizer.b1", "optimizer.b2", "optimizer.eps", "optimizer.weight_decay", "optimizer.grad_clip"}
    with pytest.raises(ValueError, match="resume='later'"):
        from goat_jax.config.fields import Int
        Int(resume="later")


def test_the_checkpoint_acts_on_each_fields_resume_declaration(tmp_path):
    from goat_jax.train import validation
    saved = _engine_config()
    ckpt = checkpoint.Checkpointer(str(tmp_path), saved)
    ckpt.save(1, _state(), {"i": 1}, wait=True)
    ckpt.close()
    for section, s in validation.ENGINE.items():
        for name, behaviour in s.resume.items():
            config = json.loads(json.dumps(saved))
            node = config[section] if section else config
            node[name] = _another(node[name])
            dotted = f"{section}.{name}" if section else name
            ckpt = checkpoint.Checkpointer(str(tmp_path), config)
            try:
                if behaviour == "safe":
                    assert ckpt.fingerprint == checkpoint.config_fingerprint(saved), dotted
                    continue
                assert ckpt.fingerprint != checkpoint.config_fingerprint(saved), dotted
                with pytest.raises(checkpoint.IncompatibleCheckpointError, match=dotted.replace(".", r"\.")):
                    ckpt.check_compatible()
                if behaviour == "adjustable":
                    assert set(ckpt.check_compatible(allow_changes=True)) == {dotted}
                else:
                    with pytest.raises(checkpoint.IncompatibleCheckpointError, match="fresh --workdir"):
                        ckpt.check_compatible(allow_changes=True)
            finally:
                ckpt.close()


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
    return dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=config_helpers.xla_flags(1))


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
