"""The training engine end to end on the tiny byte-level LM, plus its optimizer pieces.

Runs are in process on one CPU device (the 8-device and kill/resume runs are subprocesses in
test_sharding.py and test_checkpoint.py).
"""

import dataclasses
import json
import logging
import os
import re
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import lm_tiny
from tests.config_helpers import lm_smoke_config, set_fields
from goat_jax.data import text
from goat_jax.train import optim
from goat_jax.train import tasks
from goat_jax.train import trainer
from goat_jax.kernels.plan import AttentionPlan

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN_KEYS = {"step", "train_loss", "learning_rate", "grad_norm", "tokens_per_sec", "mfu", "elapsed_s"}


def _rows(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


_smoke = lm_smoke_config


def unigram_entropy(config, num_batches=100):
    """Entropy (nats) of the training stream's byte distribution: the loss of the best model
    that ignores context."""
    train, _, _ = text.make_lm_datasets(config.data, seq_len=config.seq_len,
                                        global_batch_size=config.global_batch_size, seed=config.seed)
    counts = np.zeros(config.model.vocab_size)
    for _ in range(num_batches):
        batch = next(train)
        counts += np.bincount(batch["targets"].ravel(), weights=batch["weights"].ravel(),
                              minlength=config.model.vocab_size)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


# ----------------------------------------------------------------------------------------------
# Optimizer pieces
# ----------------------------------------------------------------------------------------------


def test_schedule_warmup_then_cosine_to_floor():
    config = lm_tiny.get_config()
    opt = config.optimizer
    schedule = optim.learning_rate_schedule(opt, num_train_steps=100)
    lr = np.array([float(schedule(i)) for i in range(100)])
    peak, warm = opt.learning_rate, opt.warmup_steps
    assert lr[0] == pytest.approx(peak / warm)  # the first update already moves
    assert lr[warm - 1] == pytest.approx(peak)
    assert np.all(np.diff(lr[:warm]) > 0) and np.all(np.diff(lr[warm - 1:]) <= 1e-9)
    assert lr[-1] == pytest.approx(peak * opt.min_lr_ratio, rel=1e-5)


def test_decay_mask_excludes_biases_norms_and_goat_prior():
    config = _smoke()
    model = tasks.get_task("lm").build_model(config, AttentionPlan.from_config(config))
    params = jax.eval_shape(model.init, jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32))["params"]
    flat = {"/".join(str(getattr(k, "key", k)) for k in path): v
            for path, v in jax.tree_util.tree_leaves_with_path(optim.decay_mask(jax.tree.map(
                lambda x: x.value if hasattr(x, "value") else x, params,
                is_leaf=lambda x: hasattr(x, "names")), tasks.get_task("lm").no_decay_names))}
    assert flat["embed/embedding"] and flat["layer_0/mlp/wi_0/kernel"]
    assert flat["layer_0/attention/q_proj/kernel"]  # 3-D kernel [E, N, H]
    assert not flat["final_norm/scale"] and not flat["layer_0/attn_norm/scale"]
    prior = [k for k in flat if "/prior/" in k]
    assert prior and not any(flat[k] for k in prior)  # incl. the 2-D sink-MLP kernels


@pytest.mark.slow(reason="compiles the step for the full batch and for 4 microbatches")
def test_gradient_accumulation_matches_full_batch():
    """Summed (unnormalized) loss and gradients over 4 strided microbatches equal the full
    batch's, with padding weights that differ between microbatches."""
    config = _smoke()
    task = tasks.get_task("lm")
    model = task.build_model(config, AttentionPlan.from_config(config))
    rng = np.random.default_rng(0)
    tokens = rng.integers(3, 259, size=(8, config.seq_len + 1)).astype(np.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
             "weights": (rng.random((8, config.seq_len)) > 0.3).astype(np.float32)}
    params = nn.unbox(model.init(jax.random.PRNGKey(0), batch["inputs"])["params"])

    def loss_fn(p, b, rng):
        return task.loss(model.apply, p, b, rng)

    out = {n: jax.jit(lambda p, b, n=n: optim.accumulate_gradients(loss_fn, p, b, n))(params, batch)
           for n in (1, 4)}
    (loss1, weight1, grads1), (loss4, weight4, grads4) = out[1], out[4]
    assert float(weight4) == float(weight1) == batch["weights"].sum()
    np.testing.assert_allclose(loss4, loss1, rtol=1e-5)
    scale = max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(grads1))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5 * scale), grads4, grads1)


# ----------------------------------------------------------------------------------------------
# End to end
# ----------------------------------------------------------------------------------------------


def test_run_leaves_metrics_tensorboard_checkpoints_and_config(tmp_path, caplog):
    config = _smoke(num_train_steps=10, eval_every_steps=10, log_every_steps=2)
    with caplog.at_level(logging.INFO):
        summary = trainer.train_and_evaluate(config, str(tmp_path))
    assert re.search(r"step 10: eval_loss [\d.]+, eval_ppl [\d.]+, eval_tokens 1024$", caplog.text, re.M), caplog.text[-2000:]
    assert summary["step"] == 10 and not summary["preempted"]
    rows = _rows(tmp_path)
    train = [r for r in rows if "train_loss" in r]
    assert [r["step"] for r in train] == [2, 4, 6, 8, 10]
    assert all(set(r) == TRAIN_KEYS for r in train)
    assert all(r["tokens_per_sec"] > 0 for r in train[1:])
    assert [set(r) for r in rows if "eval_loss" in r] == [{"step", "eval_loss", "eval_ppl", "eval_tokens", "elapsed_s"}]
    # The scored tokens beside the loss (issue #67): 2 eval batches x 8 windows x 64 targets.
    assert [r["eval_tokens"] for r in rows if "eval_loss" in r] == [2 * 8 * 64]
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(tmp_path / "tensorboard"))
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["10", "5"]
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["global_batch_size"] == 8 and saved["model"]["training_seq_len"] == 64
    # Running again finds the finished run and does nothing.
    assert trainer.train_and_evaluate(config, str(tmp_path))["step"] == 10


class _Poison:
    """Wraps a train iterator: the 8th batch gets NaN weights."""

    def __init__(self, inner):
        self.inner, self.n = inner, 0

    def __next__(self):
        batch = dict(next(self.inner))
        self.n += 1
        if self.n == 8:
            batch["weights"] = batch["weights"] * np.float32("nan")
        return batch

    def get_state(self):
        return {"n": self.n, "inner": self.inner.get_state()}

    def set_state(self, state):
        self.n = state["n"]
        self.inner.set_state(state["inner"])


def _poisoned_datasets(config, *args, plan):
    """The LM data with a NaN weight in the 8th batch."""
    data = tasks.get_task("lm").make_datasets(config, *args, plan=plan)
    return dataclasses.replace(data, train=_Poison(data.train))


# A task defined outside goat_jax/tasks, loaded by config.task = 'tests.test_trainer:POISONED'.
POISONED = dataclasses.replace(tasks.get_task("lm"), name="lm_poisoned", make_datasets=_poisoned_datasets)


def test_nonfinite_loss_stops_and_keeps_last_good_checkpoint(tmp_path):
    """The 8th batch carries a NaN weight: the run stops at step 8 with a clear error, saves
    nothing after step 5, and leaves the step-5 checkpoint as the latest."""
    config = _smoke(task="tests.test_trainer:POISONED", num_train_steps=20)
    with pytest.raises(FloatingPointError, match=r"step 8.*last finite checkpoint \(step 5\).*--resume_with_changes"):
        trainer.train_and_evaluate(config, str(tmp_path))
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["5"]


@pytest.mark.slow(reason="200 training steps of the tiny model")
def test_loss_falls_well_below_unigram_entropy_fast(tmp_path):
    """200 steps of the tiny model (~1 min on 2 cores): held-out loss 0.6 nats under the
    unigram entropy (~3.4 nats), i.e. the model uses context."""
    config = set_fields(lm_tiny.get_config())  # with the engine's defaults (the seed), as a run has them
    config.progress_bar = False
    config.num_train_steps = 200
    config.eval_every_steps = 200
    config.checkpoint_every_steps = 200
    entropy = unigram_entropy(config)
    summary = trainer.train_and_evaluate(config, str(tmp_path))
    assert summary["eval_loss"] < entropy - 0.6, (summary, entropy)


@pytest.mark.slow(reason="trains the tiny config through the CLI for minutes")
def test_tiny_config_command_trains_below_unigram_entropy(tmp_path):
    """The documented command, unchanged (600 steps, ~3-4 min on 2 cores)."""
    workdir = tmp_path / "tiny"
    proc = subprocess.run([sys.executable, "-m", "experiments.train", "--config", "configs/lm_tiny.py",
                           "--workdir", str(workdir)], cwd=ROOT, capture_output=True, text=True,
                          timeout=1800, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "step/s" in proc.stderr and "loss=" in proc.stderr  # the progress bar
    config = set_fields(lm_tiny.get_config())  # with the engine's defaults (the seed), as the run had them
    entropy = unigram_entropy(config)
    rows = _rows(workdir)
    final_eval = [r for r in rows if "eval_loss" in r][-1]
    assert final_eval["step"] == config.num_train_steps
    assert final_eval["eval_loss"] < entropy - 1.0, (final_eval, entropy)
    for name in ("config.json", "metrics.jsonl", "tensorboard", "checkpoints"):
        assert (workdir / name).exists()
