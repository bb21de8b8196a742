"""The genome task and its configs: validation, the official shape, the loss's accuracy sum, and
the command lines (a smoke training of configs/dna_tiny.py and the DNA evaluation of it)."""

import json
import math
import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from configs import dna_hg38, dna_tiny
from goat_jax.data import dna as dna_data
from goat_jax.models import count_params
from goat_jax.kernels.plan import AttentionPlan
from goat_jax.train import tasks
from goat_jax.train import trainer
from tests import test_configs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("arg", ["goat", "rope", "alibi", "nope", "goat,smoke", "rope,fasta"])
@pytest.mark.parametrize("module", [dna_tiny, dna_hg38])
def test_dna_configs_validate(module, arg):
    if "smoke" in arg and module is dna_hg38 or "fasta" in arg and module is dna_tiny:
        pytest.skip("variant of the other config")
    config = module.get_config(arg)
    assert config.task == "dna" and config.model.position_encoding == arg.split(",")[0]
    assert trainer.validate_config(config, num_devices=8).global_batch == config.global_batch_size
    assert config.model.training_seq_len == config.seq_len
    assert tasks.get_task("dna").flops_per_token(config) > 0


@pytest.mark.parametrize("name", ["dna_tiny", "dna_hg38"])
def test_every_field_has_a_comment(name):
    test_configs.test_every_field_has_a_comment(name)


def test_official_shape_and_recipe():
    config = dna_hg38.get_config("goat")
    m = config.model
    assert (m.block, m.num_layers, m.embed_dim, m.num_heads, m.mlp_dim, m.vocab_size) == \
        ("gpt2", 8, 512, 8, 2048, 5)
    assert (m.pos_rank, m.abs_rank, m.prior_init, m.training_seq_len) == (2, 8, "seeded", 1024)
    assert (m.use_bias, m.norm_eps, m.tie_embeddings, m.dtype) == (True, 1e-5, True, "bfloat16")
    assert (config.seq_len, config.global_batch_size, config.num_train_steps) == (1024, 8, 1000)
    assert config.data.max_offset == 200 and not config.data.reverse_complement
    assert config.optimizer.decay_grouping == "official_genome"
    mask = tasks.get_task("dna").decay_groupings["official_genome"]({"a": {"bias": 1, "kernel": 2}})
    assert mask == {"a": {"bias": True, "kernel": True}}
    rope_config = dna_hg38.get_config("rope")
    rope = count_params(tasks.get_task("dna").build_model(rope_config, AttentionPlan.from_config(rope_config)), (1, 8))
    goat = count_params(tasks.get_task("dna").build_model(config, AttentionPlan.from_config(config)), (1, 8))
    assert rope == 25_222_656  # the paper's ~25.2M
    assert 0 < goat - rope < 10_000  # the GOAT prior adds a few parameters per layer


def test_loss_counts_correct_predictions_and_eval_metrics():
    task = tasks.get_task("dna")
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(2, 6, 5)), jnp.float32)
    targets = jnp.asarray([[0, 1, 2, 3, 4, 0], [4, 4, 3, 2, 1, 0]], jnp.int32)
    weights = jnp.asarray([[1, 1, 1, 1, 1, 0], [1, 0, 1, 1, 1, 1]], jnp.float32)
    loss_sum, (w, aux) = task.loss(lambda v, x: logits, {}, {"inputs": targets, "targets": targets,
                                                              "weights": weights}, None)
    lg = np.asarray(logits, np.float64)
    logp = lg - np.log(np.exp(lg).sum(-1, keepdims=True))
    t, wt = np.asarray(targets), np.asarray(weights)
    want = -(np.take_along_axis(logp, t[..., None], -1)[..., 0] * wt).sum()
    assert float(loss_sum) == pytest.approx(want, rel=1e-5) and float(w) == wt.sum()
    assert float(aux["correct"]) == ((lg.argmax(-1) == t) * wt).sum()
    got = task.eval_metrics({"loss": 13.0, "weight": 10.0, "correct": 4.0})
    assert got == pytest.approx({"bits_per_base": 1.3 / math.log(2), "ppl": math.exp(1.3),
                                 "accuracy": 0.4, "tokens": 10.0})


@pytest.mark.slow(reason="trains and evaluates through both command lines")
def test_smoke_training_and_evaluate_command_lines(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    workdir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.train", "--config", "configs/dna_tiny.py:goat,smoke",
         "--workdir", str(workdir), "--config.progress_bar=False"],
        cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    evals = [json.loads(l) for l in open(workdir / "metrics.jsonl") if "eval_loss" in l]
    assert evals and {"eval_bits_per_base", "eval_accuracy", "eval_ppl"} <= set(evals[-1])
    last = evals[-1]
    assert last["eval_bits_per_base"] == pytest.approx(last["eval_loss"] / math.log(2))
    assert last["eval_loss"] < math.log(5)  # learned something beyond uniform over ACGNT

    out = tmp_path / "eval"
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.evaluate", "--workdir", str(workdir), "--evals", "dna",
         "--fasta", dna_data.HUMAN_CHR17_40KB, "--multipliers", "1,2,4,8", "--max_bases", "6000",
         "--gc_windows", "8", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.load(open(out / "results.json"))["goat"]["dna"]
    assert sorted(int(n) for n in res["by_length"]) == [64, 128, 256, 512]
    for r in res["by_length"].values():
        assert r["bits_per_base"] == pytest.approx(r["nll"] / math.log(2))
        assert 0 <= r["accuracy"] <= 1 and r["num_bases"] > 0
    assert res["gc"]["num_windows"] == 8 and -1 <= res["gc"]["r_prompt"] <= 1
    assert "GC agreement" in open(out / "results.md").read()
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.evaluate", "--workdir", str(workdir), "--evals", "dna",
         "--out", str(tmp_path / "none")], cwd=ROOT, capture_output=True, text=True, timeout=600,
        env=env)
    assert proc.returncode != 0 and "--evals dna needs --fasta FILE" in proc.stderr
