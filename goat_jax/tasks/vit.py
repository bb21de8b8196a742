"""The image-classification task (``config.task = 'vit'``): a :class:`goat_jax.models.vit.ViT`
trained on ImageNet-1k (TFDS or a JPEG folder) or Fashion-MNIST (``goat_jax.data.images``).

Config sections: ``model.*`` (:class:`goat_jax.models.vit.ViTConfig` fields, optionally
``preset``; this task builds the model) and ``data.*`` (``goat_jax.data.images.default_data_config()``).
Loss: cross-entropy against the batch's ``targets`` (Mixup/CutMix-mixed, label-smoothed in
training; one-hot in evaluation), summed over ``weights``. Eval metrics: ``eval_loss`` (nats per
image) and ``eval_top1``. Drop-path draws from the per-step key the engine passes to the loss.
The contract this module fills is in :mod:`goat_jax.train.tasks`.
"""

from __future__ import annotations

from typing import Dict

import jax
import jax.numpy as jnp
import numpy as np

from goat_jax.data import images
from goat_jax.models import vit
from goat_jax.tasks import NO_DECAY_NAMES, model_fields
from goat_jax.kernels.plan import AttentionPlan
from goat_jax.train import tasks

Batch = tasks.Batch


def model_config(config) -> vit.ViTConfig:
    """The resolved :class:`ViTConfig` of ``config.model`` (preset applied)."""
    return vit.ViTConfig.from_config(model_fields(config, "vit", "vit"))


def build_model(config, plan: AttentionPlan):
    """The ``config.model`` ViT whose attention runs under ``plan`` (the run's)."""
    return vit.ViT(model_config(config), plan=plan)


def make_datasets(config, global_batch_size: int, process_index: int, process_count: int, *,
                  plan: AttentionPlan) -> tasks.Datasets:
    """This host's train iterator and eval factory (at the training resolution). ``info`` holds
    ``make_eval_at(resolution)`` for evaluations at other resolutions and the ``ImageInfo``.
    ``plan`` is unused (images are not packed documents)."""
    del plan
    train, make_eval_at, info = images.make_image_datasets(
        config.data, global_batch_size=global_batch_size, seed=config.seed,
        process_index=process_index, process_count=process_count)
    if info.num_classes != config.model.num_classes:
        raise ValueError(f"model.num_classes={config.model.num_classes} but the data has {info.num_classes} "
                         f"classes; set model.num_classes={info.num_classes}.")
    return tasks.Datasets(train=train, make_eval=make_eval_at, info={"make_eval_at": make_eval_at, "images": info})


def loss(apply_fn, params, batch, rng):
    """Summed soft-target cross-entropy over ``weights``; aux ``correct`` = weighted top-1 hits
    against ``label``. ``rng`` (training) drives drop-path; ``None`` (eval) is deterministic."""
    train = rng is not None
    logits = apply_fn({"params": params}, batch["image"], train=train,
                      rngs={"dropout": rng} if train else None)  # [B, K] float32
    weights = batch["weights"].astype(jnp.float32)
    ce = -jnp.sum(batch["targets"].astype(jnp.float32) * jax.nn.log_softmax(logits), axis=-1)  # [B]
    correct = tasks.weighted_correct(logits, batch["label"], weights)
    return jnp.sum(ce * weights), (jnp.sum(weights), {"correct": correct})


def dummy_batch(config, batch_size: int) -> Batch:
    """Zeros of the training shapes."""
    size, k = config.data.image_size, config.model.num_classes
    return {"image": np.zeros((batch_size, size, size, config.data.channels), np.float32),
            "label": np.zeros((batch_size,), np.int32),
            "targets": np.full((batch_size, k), 1.0 / k, np.float32),
            "weights": np.ones((batch_size,), np.float32)}


def vit_flops_per_image(cfg: vit.ViTConfig, resolution: int) -> float:
    """Training FLOPs per image (forward + backward) at ``resolution``, PaLM counting:
    ``6 N L + 12 layers E L^2`` with N the matmul parameters a token passes through (attention
    projections, MLP; the patch embedding per patch) and L = 1 + patches tokens. The head and
    GOAT's few packed prior channels are negligible and not counted."""
    e, f = cfg.embed_dim, cfg.mlp_dim
    tokens = 1 + (resolution // cfg.patch_size) ** 2
    per_token = cfg.num_layers * (4 * e * e + 2 * e * f)
    patch = cfg.patch_size ** 2 * cfg.channels * e * (tokens - 1)
    return float(6 * (per_token * tokens + patch) + 12 * cfg.num_layers * e * tokens ** 2)


# The ViT task's config fields: ViTConfig plus its 'preset', the image pipeline's data.
FIELDS = tasks.TaskFields(model=vit.ViTConfig, data={"images": images.FIELD_SPECS},
                          model_extra={"preset": vit.FIELD_SPECS["preset"]},
                          plan_fields=("implementation",),  # no packed documents, so no document bound
                          # model.name='vit': what checkpoints written before the task alone chose the model hold.
                          model_name="vit")


def validate(config) -> None:
    """The model config builds; the data's channels and training resolution match the model's."""
    cfg = model_config(config)
    if config.data.channels != cfg.channels:
        raise ValueError(f"data.channels={config.data.channels} but model.channels={cfg.channels} "
                         "(grayscale is 1, RGB 3); make them agree.")
    if config.data.image_size != cfg.image_size:
        raise ValueError(f"data.image_size={config.data.image_size} but model.image_size={cfg.image_size}: "
                         "the model's training grid (the 'ape' table) must be the training resolution.")
    if config.data.image_size % cfg.patch_size:
        raise ValueError(f"data.image_size={config.data.image_size} is not divisible by "
                         f"model.patch_size={cfg.patch_size}.")


def eval_metrics(totals: Dict[str, float]) -> Dict[str, float]:
    """``top1``: the weighted fraction of correct argmax predictions."""
    return {"top1": totals["correct"] / totals["weight"]}


TASK = tasks.Task(
    name="vit",
    batch_keys=("image", "label", "targets", "weights"),
    build_model=build_model,
    make_datasets=make_datasets,
    loss=loss,
    dummy_batch=dummy_batch,
    model_inputs=lambda batch: (batch["image"],),
    tokens_per_example=lambda config: 1,  # throughput is reported in images/s
    flops_per_token=lambda config: vit_flops_per_image(model_config(config), config.data.image_size),
    fields=FIELDS,
    validate=validate,
    eval_metrics=eval_metrics,
    # Reading threads and eval size do not change what is computed; the kernel changes speed only.
    resume_safe_fields=("data.read_threads", "data.num_eval_batches", "model.implementation"),
    # timm/DeiT exclude the position table and CLS token from weight decay, besides biases and norms.
    no_decay_names=NO_DECAY_NAMES | {"pos_embed", "cls"},
)
