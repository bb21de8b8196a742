"""ViT-S/16 on ImageNet-1k: the official GOAT ``imagenet.py`` recipe (DeiT-like), per encoding.

      python -m experiments.train --config configs/vit_s16_imagenet.py:goat --workdir runs/vit_s16_goat \
          --config.data.tfds_data_dir=/data/tensorflow_datasets          # TFDS imagenet2012
      python -m experiments.train --config configs/vit_s16_imagenet.py:ape --workdir runs/vit_s16_ape \
          --config.data.source=folder --config.data.folder=/data/imagenet  # train/<wnid>/*.JPEG, val/<wnid>/*

The argument is the position encoding ('goat', 'ape' = the official baseline, 'sincos2d',
'rope2d', 'nope'); everything else is identical. docs/experiments.md, section "Vision", says how to
prepare ImageNet either way.

Recipe: 224 px, RandomResizedCrop (0.08-1), flip, RandAugment(2, 9), random erasing 0.25,
Mixup 0.8 / CutMix 1.0 (switch 0.5), label smoothing 0.1, AdamW lr 5e-4 wd 0.05 (b2 0.999),
5 warmup epochs then cosine, 300 epochs, global batch 64, no clipping, drop-path 0.1. Evaluated
at 224/384/512 by resizing to r * 256/224 and centre-cropping r.
"""

import ml_collections
from ml_collections import config_dict

from goat_jax.config.args import parse_config_arg
from goat_jax.data import images
from goat_jax.models import vit

_TRAIN_IMAGES = 1_281_167  # ImageNet-1k train split
_BATCH = 64  # official global batch
_STEPS_PER_EPOCH = _TRAIN_IMAGES // _BATCH  # 20,018


def get_config(arg: str = "goat") -> ml_collections.ConfigDict:
    """The official ViT-S/16 recipe; ``arg`` = the position encoding."""
    encoding = parse_config_arg(arg, "configs/vit_s16_imagenet.py",
                                encoding=(vit.POSITION_ENCODINGS, "goat"))["encoding"]
    c = ml_collections.ConfigDict()
    c.task = "vit"  # image classification (goat_jax/tasks/vit.py)

    c.num_train_steps = 300 * _STEPS_PER_EPOCH  # 300 epochs
    c.global_batch_size = _BATCH  # official: 64 images per step
    c.log_every_steps = 100  # metrics cadence
    c.eval_every_steps = 5 * _STEPS_PER_EPOCH  # top-1 on the 50k val images every 5 epochs
    c.checkpoint_every_steps = _STEPS_PER_EPOCH  # once per epoch (also at the end and on SIGTERM)

    c.optimizer = ml_collections.ConfigDict()
    c.optimizer.learning_rate = 5e-4  # official peak (not rescaled to the batch)
    c.optimizer.warmup_steps = 5 * _STEPS_PER_EPOCH  # 5 warmup epochs
    c.optimizer.min_lr_ratio = 0.02  # cosine floor 1e-5 = 0.02 x 5e-4 (timm's min_lr)
    c.optimizer.b2 = 0.999  # AdamW (DeiT)
    c.optimizer.weight_decay = 0.05  # not on biases, norms, the GOAT prior, pos_embed, cls
    c.optimizer.grad_clip = 0.0  # official: no clipping

    c.model = ml_collections.ConfigDict()
    c.model.preset = "s16"  # ViT-S/16: 224 px, patch 16, width 384, 12 layers, 6 heads, MLP 1536
    c.model.num_classes = 1000  # ImageNet-1k
    c.model.channels = 3  # RGB
    c.model.position_encoding = encoding  # the config argument
    c.model.drop_path_rate = 0.1  # linear over depth (official)
    c.model.norm_eps = 1e-6  # LayerNorm epsilon (official)
    c.model.pos_rank = 16  # GOAT R (official)
    c.model.abs_rank = 2  # GOAT M (official)
    c.model.prior_init = "uniform"  # official: the prior starts flat
    c.model.enable_key_bias = True  # official: key bias (sink) on
    c.model.rope_base = 100.0  # 'rope2d' base (Heo et al. 2024)
    c.model.rope_mixed_base = 10.0  # 'rope_mixed' initial frequency ladder base (Heo et al. 2024)
    c.model.sincos_temperature = 10_000.0  # 'sincos2d' (big_vision)
    c.model.dtype = "bfloat16"  # compute dtype on accelerators (the prior stays float32)
    c.model.param_dtype = "float32"  # parameters and optimizer state
    c.model.implementation = config_dict.placeholder(str)  # attention kernel; None: auto

    c.data = images.default_data_config()  # TFDS imagenet2012 + the official train transforms
    c.data.num_eval_batches = 0  # the whole 50k val split
    return c
