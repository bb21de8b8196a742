"""The trainer's optional hooks: ``config.profile_steps`` (a jax.profiler trace into
WORKDIR/profile/) and ``config.wandb`` (Weights & Biases, here offline, resuming its run id)."""

import glob
import os

import pytest

from goat_jax.train import profiling, trainer, wandb_logger
from tests.config_helpers import lm_smoke_config


@pytest.mark.slow(reason="two profiled training runs with W&B")
def test_profiled_offline_wandb_run_resumes_the_same_wandb_run(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    wandb_dir = tmp_path / "wandb_files"
    monkeypatch.setenv("WANDB_DIR", str(wandb_dir))
    monkeypatch.setenv("WANDB_SILENT", "true")
    workdir = str(tmp_path / "run")
    config = lm_smoke_config(num_train_steps=2, checkpoint_every_steps=2, profile_steps=(2, 2),
                             **{"optimizer.warmup_steps": 1, "wandb.mode": "offline",
                                "wandb.project": "goat-jax-test"})
    trainer.train_and_evaluate(config, workdir)

    traces = glob.glob(os.path.join(profiling.profile_dir(workdir), "**", "*.xplane.pb"), recursive=True)
    assert traces and all(os.path.getsize(t) > 0 for t in traces)
    with open(wandb_logger.run_id_path(workdir)) as f:
        run_id = f.read().strip()
    first = glob.glob(str(wandb_dir / "wandb" / f"offline-run-*-{run_id}" / f"run-{run_id}.wandb"))
    assert len(first) == 1
    with open(first[0], "rb") as f:
        records = f.read()
    # The offline run file holds the metrics rows and the resolved config.
    assert b"train_loss" in records and b"num_train_steps" in records and b"grad_norm" in records

    # Resume (two more steps): the same W&B run id, no second id file, no second trace.
    config.num_train_steps = 4
    config.profile_steps = ()
    trainer.train_and_evaluate(config, workdir, resume_with_changes=True)
    with open(wandb_logger.run_id_path(workdir)) as f:
        assert f.read().strip() == run_id
    files = glob.glob(str(wandb_dir / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert files and all(f.endswith(f"run-{run_id}.wandb") for f in files)
    assert len(glob.glob(os.path.join(profiling.profile_dir(workdir), "**", "*.xplane.pb"),
                         recursive=True)) == len(traces)


def test_profile_steps_and_wandb_are_checked_before_any_work(tmp_path):
    for steps, match in (((3,), "wrong length"), ((0, 2), "profile_steps"), ((3, 2), "not a range"),
                         ((1, 99), "not a range"), (("a", "b"), "profile_steps")):
        workdir = tmp_path / f"run_{len(os.listdir(tmp_path))}"
        with pytest.raises(ValueError, match=match):
            trainer.train_and_evaluate(lm_smoke_config(profile_steps=steps), str(workdir))
        assert not workdir.exists()
    with pytest.raises(ValueError, match="wandb.mode"):
        trainer.train_and_evaluate(lm_smoke_config(**{"wandb.mode": "onlin"}), str(tmp_path / "w"))
    with pytest.raises(ValueError, match="Unknown config field wandb.projetc"):
        config = lm_smoke_config()
        config.wandb.projetc = "x"
        trainer.train_and_evaluate(config, str(tmp_path / "w"))
    assert not (tmp_path / "w").exists()


def test_a_resumed_run_traces_what_is_left_of_the_range(tmp_path):
    assert (profiling.StepProfiler((3, 6), str(tmp_path), 4).first,
            profiling.StepProfiler((3, 6), str(tmp_path), 4).last) == (5, 6)
    assert profiling.StepProfiler((3, 6), str(tmp_path), 6).first is None
    assert profiling.StepProfiler((), str(tmp_path), 0).first is None


def test_offline_wandb_files_land_in_workdir_wandb(tmp_path, monkeypatch):
    """Without $WANDB_DIR the offline run is WORKDIR/wandb/offline-run-* (what the docs' `wandb
    sync` names), not WORKDIR/wandb/wandb/offline-run-* (wandb appends wandb/ to its dir)."""
    pytest.importorskip("wandb")
    monkeypatch.delenv("WANDB_DIR", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    config = lm_smoke_config(**{"wandb.mode": "offline", "wandb.project": "goat-jax-test"})
    workdir = str(tmp_path / "run")
    run = wandb_logger.WandbLogger(config.wandb, {"seed": 0}, workdir)
    run.log({"step": 1, "train_loss": 2.5})
    run.finish()
    with open(wandb_logger.run_id_path(workdir)) as f:
        run_id = f.read().strip()
    assert len(glob.glob(os.path.join(workdir, "wandb", f"offline-run-*-{run_id}",
                                      f"run-{run_id}.wandb"))) == 1
    assert not os.path.exists(os.path.join(workdir, "wandb", "wandb"))


def test_a_failing_wandb_init_is_one_line_and_writes_no_run_id(tmp_path, monkeypatch):
    """A wandb.init that fails past the preflight (e.g. a key the server rejects) is a one-line
    ValueError naming the offline fix, and no wandb_run_id names a W&B run that never existed."""
    wandb = pytest.importorskip("wandb")

    def refuse(**kwargs):
        raise wandb.errors.CommError("Run initialization has timed out after 90.0 sec.\nPlease try\n")
    monkeypatch.setattr(wandb, "init", refuse)
    config = lm_smoke_config(**{"wandb.mode": "online"})
    with pytest.raises(ValueError) as e:
        wandb_logger.WandbLogger(config.wandb, {}, str(tmp_path))
    assert "\n" not in str(e.value) and "wandb.init failed: Run initialization has timed out" in str(e.value)
    assert "--config.wandb.mode=offline" in str(e.value)
    assert not os.path.exists(wandb_logger.run_id_path(str(tmp_path)))
