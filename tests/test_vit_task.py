"""goat_jax.tasks.vit and the ViT configs: the loss against a float64 reference, config
validation, and a smoke training of ``configs/vit_tiny.py:goat,smoke`` through the CLI."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import vit_s16_imagenet, vit_tiny
from goat_jax.models import count_params
from goat_jax.models.vit import POSITION_ENCODINGS
from goat_jax.tasks import vit as vit_task
from goat_jax.train import tasks
from goat_jax.train import trainer
from goat_jax.kernels.plan import AttentionPlan

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("encoding", POSITION_ENCODINGS)
def test_configs_validate(encoding):
    for module in (vit_tiny, vit_s16_imagenet):
        config = module.get_config(encoding)
        assert config.model.position_encoding == encoding
        assert trainer.validate_config(config, num_devices=8).global_batch == config.global_batch_size
        assert tasks.get_task(config.task) is vit_task.TASK
    smoke = vit_tiny.get_config(f"{encoding},smoke")
    trainer.validate_config(smoke, num_devices=1)


def test_s16_config_is_the_official_recipe():
    c = vit_s16_imagenet.get_config("ape")
    cfg = vit_task.model_config(c)
    assert (cfg.embed_dim, cfg.num_layers, cfg.num_heads, cfg.mlp_dim, cfg.patch_size) == (384, 12, 6, 1536, 16)
    assert (c.optimizer.learning_rate, c.optimizer.weight_decay, c.global_batch_size) == (5e-4, 0.05, 64)
    assert c.num_train_steps == 300 * (1_281_167 // 64) and c.optimizer.warmup_steps == 5 * (1_281_167 // 64)
    d = c.data
    assert (d.crop_scale, d.randaugment_ops, d.randaugment_magnitude, d.random_erasing) == ((0.08, 1.0), 2, 9, 0.25)
    assert (d.mixup_alpha, d.cutmix_alpha, d.mixup_switch_prob, d.label_smoothing) == (0.8, 1.0, 0.5, 0.1)
    assert count_params(vit_task.build_model(c, AttentionPlan.from_config(c)), (1, 224, 224, 3), jnp.float32) == 22_050_664
    with pytest.raises(ValueError, match="unknown config argument token .rope.. accepted tokens"):
        vit_s16_imagenet.get_config("rope")


def test_validate_names_mismatches():
    c = vit_tiny.get_config("goat")
    c.data.channels, c.data.mean, c.data.std = 3, (0.5,) * 3, (0.5,) * 3
    with pytest.raises(ValueError, match="data.channels=3 but model.channels=1"):
        trainer.validate_config(c, num_devices=1)
    c = vit_tiny.get_config("goat")
    c.data.image_size = 35
    with pytest.raises(ValueError, match="data.image_size=35 but model.image_size=28"):
        trainer.validate_config(c, num_devices=1)


def test_loss_matches_float64_reference(rng):
    config = vit_tiny.get_config("rope2d,smoke")
    model = vit_task.build_model(config, AttentionPlan.from_config(config))
    batch = vit_task.dummy_batch(config, 4)
    batch["image"] = rng.standard_normal(batch["image"].shape).astype(np.float32)
    targets = rng.random((4, 10))
    batch["targets"] = (targets / targets.sum(1, keepdims=True)).astype(np.float32)
    batch["label"] = rng.integers(0, 10, 4).astype(np.int32)
    batch["weights"] = np.array([1, 1, 0.5, 0], np.float32)
    params = jax.jit(model.init)(jax.random.PRNGKey(0), batch["image"])["params"]
    params = jax.tree_util.tree_map(lambda a: a + 0.1 * rng.standard_normal(a.shape).astype(np.float32),
                                    jax.tree_util.tree_map(np.asarray, params))
    loss_fn = jax.jit(lambda p, b, r: vit_task.loss(model.apply, p, b, r))
    loss, (weight, aux) = loss_fn(params, batch, None)
    logits = np.asarray(jax.jit(model.apply)({"params": params}, batch["image"]), np.float64)
    logp = logits - logits.max(1, keepdims=True)
    logp = logp - np.log(np.exp(logp).sum(1, keepdims=True))
    want = float(np.sum(-(batch["targets"] * logp).sum(1) * batch["weights"]))
    np.testing.assert_allclose(float(loss), want, rtol=1e-5)
    assert float(weight) == 2.5
    hits = (logits.argmax(1) == batch["label"]).astype(float)
    np.testing.assert_allclose(float(aux["correct"]), float(np.sum(hits * batch["weights"])), rtol=1e-6)
    # Training draws drop-path from the key; evaluation (rng None) is deterministic.
    train = [float(loss_fn(params, batch, jax.random.PRNGKey(s))[0]) for s in range(4)]
    assert len(set(train)) > 1
    assert float(loss_fn(params, batch, None)[0]) == float(loss)
    assert vit_task.eval_metrics({"loss": 3.0, "weight": 4.0, "correct": 3.0}) == {"top1": 0.75}


def test_flops_per_image_counts_matmuls():
    cfg = vit_task.model_config(vit_s16_imagenet.get_config("goat"))
    tokens, e, f = 197, 384, 1536
    want = 6 * (12 * (4 * e * e + 2 * e * f) * tokens + 16 * 16 * 3 * e * 196) + 12 * 12 * e * tokens ** 2
    assert vit_task.vit_flops_per_image(cfg, 224) == want
    # Published ViT-S/16 cost: 4.6 G multiply-adds forward = 9.2 GFLOPs, x3 with the backward.
    assert 27.0e9 < want < 28.2e9


@pytest.mark.slow(reason="trains through the command line")
def test_tiny_smoke_training_through_the_cli(tmp_path):
    """``configs/vit_tiny.py:goat,smoke`` on the real Fashion-MNIST files, via the CLI."""
    if not os.path.exists("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz"):
        pytest.skip("dataset-fashion-mnist is not installed")
    workdir = tmp_path / "smoke"
    proc = subprocess.run([sys.executable, "-m", "experiments.train", "--config", "configs/vit_tiny.py:goat,smoke",
                           "--workdir", str(workdir)], cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in open(workdir / "metrics.jsonl")]
    evals = [r for r in rows if "eval_top1" in r]
    assert evals and evals[-1]["step"] == 6 and 0.0 <= evals[-1]["eval_top1"] <= 1.0
    assert np.isfinite([r["train_loss"] for r in rows if "train_loss" in r]).all()
    assert json.load(open(workdir / "config.json"))["model"]["position_encoding"] == "goat"

    # The resolution evaluation of experiments.evaluate on that run (in process: no second compile
    # of the CLI's imports), at 1x and 2x: top-1 per resolution, the figures, the prior checks.
    from goat_jax.eval import vision

    out = tmp_path / "eval"
    res = vision.evaluate_vision_runs([str(workdir)], ["goat"], [28, 56], str(out), log=lambda s: None)
    assert set(res["goat"]["resolution"]) == {28, 56} and res["goat"]["step"] == 6
    assert all(0 <= v["top1"] <= 1 and v["images"] == 32 for v in res["goat"]["resolution"].values())
    assert 0 <= res["goat"]["shift_invariance_error"] < 1
    for name in ("results.json", "results.md", "resolution.png", "prior_goat.png"):
        assert (out / name).exists()


def test_every_model_and_data_field_has_a_spec():
    import dataclasses

    from goat_jax.data import images
    from goat_jax.models import vit

    assert {f.name for f in dataclasses.fields(vit.ViTConfig)} | {"preset"} == set(vit.FIELD_SPECS)
    assert set(images.default_data_config()) == set(images.FIELD_SPECS)
    c = vit_tiny.get_config("goat,smoke")
    c.model.drop_path_rate = 1.0
    with pytest.raises(ValueError, match=r"^model.drop_path_rate=1.0 .*--config.model.drop_path_rate"):
        trainer.validate_config(c, num_devices=1)
