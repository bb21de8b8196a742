"""Tiny ViT on Fashion-MNIST (the Debian package ``dataset-fashion-mnist``): minutes on 2 CPU cores.

      python -m experiments.train --config configs/vit_tiny.py --workdir runs/vit_tiny_goat
      python -m experiments.train --config configs/vit_tiny.py:ape --workdir runs/vit_tiny_ape

The argument names the position encoding (default 'goat'; any of
goat_jax.models.vit.POSITION_ENCODINGS), optionally followed by ',smoke': a seconds-long variant
for tests, e.g. ``configs/vit_tiny.py:goat,smoke``, and/or ',canvas': the canvas protocol's model
(head dim 64, GOAT ranks R = 16, M = 2, 4 blocks, 4 epochs; docs/protocols.md). Everything else
is identical across encodings.

28 x 28 grayscale images in 7 x 7 patches: a 4 x 4 grid at the training resolution, so the
evaluation resolutions 28, 42, 56, 84 (1x, 1.5x, 2x, 3x) are 4x4, 6x6, 8x8 and 12x12 grids.
The ViT keeps the official recipe's structure (pre-LN, CLS pooling, drop-path, GOAT R/M split
scaled to a 32-dim head, uniform prior init); augmentation is flip + label smoothing only,
since RandAugment / Mixup are for 300-epoch ImageNet runs, not one pass over 60k small images.
"""

import ml_collections
from ml_collections import config_dict

from goat_jax.config.args import parse_config_arg
from goat_jax.data import images
from goat_jax.models import vit


def get_config(arg: str = "goat") -> ml_collections.ConfigDict:
    """The tiny config; ``arg`` = ``'<position_encoding>[,smoke][,canvas]'``."""
    args = parse_config_arg(arg, "configs/vit_tiny.py", encoding=(vit.POSITION_ENCODINGS, "goat"),
                            size=(("smoke",), None), protocol=(("canvas",), None))
    smoke, canvas, encoding = args["size"] == "smoke", args["protocol"] == "canvas", args["encoding"]
    c = ml_collections.ConfigDict()
    c.task = "vit"  # image classification (goat_jax/tasks/vit.py)

    c.num_train_steps = 940  # 2 epochs of 60k images at batch 128
    c.global_batch_size = 128  # images per step
    c.log_every_steps = 20  # metrics.jsonl / TensorBoard cadence
    c.eval_every_steps = 470  # held-out loss / top-1 cadence, once per epoch (0: never)
    c.checkpoint_every_steps = 470  # checkpoint cadence (also at the end and on SIGTERM)
    c.keep_checkpoints = 2  # keep the newest N checkpoints

    c.optimizer = ml_collections.ConfigDict()
    c.optimizer.learning_rate = 1e-3  # peak AdamW rate (small ViT, batch 128)
    c.optimizer.warmup_steps = 100  # linear warmup
    c.optimizer.min_lr_ratio = 0.01  # cosine floor as a fraction of the peak
    c.optimizer.b2 = 0.999  # Adam second moment (DeiT)
    c.optimizer.weight_decay = 0.05  # official ViT recipe; not on biases, norms, prior, pos_embed, cls
    c.optimizer.grad_clip = 0.0  # the official recipe does not clip

    c.model = ml_collections.ConfigDict()
    c.model.num_classes = 10  # Fashion-MNIST classes
    c.model.image_size = 28  # training resolution
    c.model.patch_size = 7  # 4 x 4 patches at 28 px; 28/42/56/84 px all divide
    c.model.channels = 1  # grayscale
    c.model.num_layers = 6  # transformer blocks
    c.model.embed_dim = 128  # residual width
    c.model.num_heads = 4  # head dim 32
    c.model.mlp_dim = 256  # GELU MLP hidden (2x: a small model on small data)
    c.model.position_encoding = encoding  # 'goat' | 'ape' | 'sincos2d' | 'rope2d' | 'rope_mixed' | 'nope'
    c.model.drop_path_rate = 0.1  # official value, linear over depth
    c.model.norm_eps = 1e-6  # LayerNorm epsilon
    c.model.pos_rank = 8  # GOAT R: 2R = 16 of the 32 head dims (official: 32 of 64)
    c.model.abs_rank = 2  # GOAT M (official)
    c.model.prior_init = "uniform"  # official ViT: a flat prior at init
    c.model.enable_key_bias = True  # learned sink u(j) (official: on)
    c.model.rope_base = 100.0  # 'rope2d' base (Heo et al. 2024)
    c.model.rope_mixed_base = 10.0  # 'rope_mixed' initial frequency ladder base (Heo et al. 2024)
    c.model.sincos_temperature = 10_000.0  # 'sincos2d' temperature (big_vision)
    c.model.dtype = "float32"  # compute dtype (CPU: float32)
    c.model.param_dtype = "float32"  # parameter dtype
    c.model.implementation = config_dict.placeholder(str)  # attention kernel; None: auto (XLA on CPU)

    c.data = images.fashion_mnist_config()  # 60k/10k real images from the Debian package
    c.data.num_eval_batches = 0  # the whole 10k test split
    c.data.read_threads = 2  # 2-core machine

    if canvas:  # the canvas protocol (docs/protocols.md, "Tiny vision protocol: objects on a larger canvas")
        # Head dim 64 so GOAT takes the official ViT ranks (2R = 32 of 64 dims, M = 2), the same
        # shape for every encoding; 4 blocks and 4 epochs keep a run near 15 CPU-minutes.
        c.model.embed_dim = 128
        c.model.num_heads = 2  # head dim 64
        c.model.num_layers = 4
        c.model.pos_rank = 16  # official ViT guidance
        c.model.abs_rank = 2
        c.num_train_steps = 1880  # 4 epochs of 60k images at batch 128
        c.eval_every_steps = 470
        # Every half epoch, all kept: the prior's range over training, and a killed run (e.g. a
        # session's end) loses at most half an epoch.
        c.checkpoint_every_steps = 235
        c.keep_checkpoints = 9
    if smoke:  # seconds per run: the CLI smoke test
        c.num_train_steps = 6
        c.global_batch_size = 16
        c.log_every_steps = 1
        c.eval_every_steps = 3
        c.checkpoint_every_steps = 3
        c.optimizer.warmup_steps = 2
        c.model.num_layers = 2
        c.model.embed_dim = 64
        c.model.mlp_dim = 128
        c.model.pos_rank = 4
        c.data.num_eval_batches = 2
    return c
