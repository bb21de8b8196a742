"""The trainer refuses a step that cannot fit in memory before any work, with XLA's estimate
(goat_jax/train/memory.py). That the checked executable then trains exactly as jit did is
what tests/test_trainer.py and tests/test_recovery.py check (same losses on resume)."""

import logging
import types

import jax
import pytest

from configs import lm_tiny
from goat_jax.train import memory, trainer

CPU = types.SimpleNamespace(platform="cpu", device_kind="cpu")
GPU = types.SimpleNamespace(platform="gpu", device_kind="NVIDIA H200")
GiB = 1 << 30


def test_the_rule_refuses_above_the_limit_and_warns_above_what_is_free(caplog, monkeypatch):
    monkeypatch.delenv(memory.SKIP_ENV, raising=False)
    # 4 CPU devices share host RAM: 4 x 3 GiB > 10 GiB.
    with pytest.raises(ValueError, match=r"one train step needs an estimated 12.00 GiB \(4 CPU device\(s\) x "
                                         r"3.00 GiB.*more than the 10.00 GiB of host RAM"):
        memory.check_fits(3 * GiB, CPU, 4, limit=10 * GiB, available=8 * GiB, what="host RAM")
    # An accelerator: per device, whatever the local count.
    memory.check_fits(3 * GiB, GPU, 8, limit=4 * GiB, available=4 * GiB)
    with caplog.at_level(logging.WARNING):
        memory.check_fits(3 * GiB, GPU, 8, limit=4 * GiB, available=2 * GiB)
    assert "2.00 GiB of memory available now" in caplog.text
    memory.check_fits(None, CPU, 1, limit=1, available=1)  # no estimate: nothing to check
    monkeypatch.setenv(memory.SKIP_ENV, "1")
    memory.check_fits(3 * GiB, CPU, 4, limit=GiB, available=GiB)  # warned, not refused


def test_step_bytes_reads_xla_memory_analysis():
    f = jax.jit(lambda x: (x @ x.T).sum())
    compiled = f.lower(jax.ShapeDtypeStruct((256, 512), "float32")).compile()
    got = memory.step_bytes(compiled)
    assert got is not None and got >= 256 * 512 * 4  # at least its argument


def test_trainer_refuses_before_any_state_or_checkpoint(tmp_path, monkeypatch):
    """A machine with 1 MiB of RAM: the tiny LM is refused with its estimate, after compiling
    but before the state is initialized or anything is saved."""
    monkeypatch.delenv(memory.SKIP_ENV, raising=False)
    monkeypatch.setattr(memory, "machine_memory", lambda device, n: (1 << 20, 1 << 20, "host RAM"))
    config = lm_tiny.get_config("goat,smoke")
    config.progress_bar = False
    with pytest.raises(ValueError, match=r"one train step needs an estimated .* GiB .*more than the 0.00 "
                                         r"GiB of host RAM.*grad_accum_steps"):
        trainer.train_and_evaluate(config, str(tmp_path / "run"))
    assert not (tmp_path / "run" / "checkpoints").exists() or not list((tmp_path / "run" / "checkpoints").iterdir())
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
