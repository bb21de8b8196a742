"""A Vision Transformer whose position encoding is GOAT's 2D prior or a baseline.

Architecture (ViT, Dosovitskiy et al. 2021; the official GOAT ``imagenet.py`` recipe):
patchify with a ``patch x patch`` stride-``patch`` convolution -> prepend a CLS token ->
``num_layers`` x [LayerNorm -> self-attention -> drop-path -> residual, LayerNorm -> GELU MLP
-> drop-path -> residual] -> the CLS token -> LayerNorm -> Linear(num_classes). Only the
position encoding changes with ``position_encoding``; widths, norms, MLP, initialization and
drop-path are identical, so comparisons between encodings are fair:

============  ===================================================================================
'goat'        :class:`goat_jax.layers.goat.GoatAttention` with the 2D prior (rows get the first
              ``R - R//2`` frequencies), CLS first with zero position features, no absolute
              embedding at all (official: R = 16, M = 2, uniform init, key bias on)
'ape'         a learned absolute table ``[1 + rows*cols, E]`` incl. the CLS entry (timm/DeiT);
              at another grid its patch part is resized bicubically (PyTorch
              ``F.interpolate(mode='bicubic', align_corners=False)`` semantics, see
              :func:`resize_position_table`) and the CLS entry is kept: the official baseline
'sincos2d'    big_vision's fixed 2D sin-cos embedding on the patches (CLS gets none)
'rope2d'      axial 2D RoPE inside attention (:func:`goat_jax.positional.apply_rope_2d`)
'rope_mixed'  RoPE-Mixed (Heo et al. 2024): 2D RoPE with learned per-head, per-layer frequencies
              that mix rows and columns (:mod:`goat_jax.positional.rope_mixed`)
'nope'        no position information
============  ===================================================================================

Any input resolution divisible by the patch size runs at apply time: the patch grid is read
from the input, so GOAT, 'sincos2d', 'rope2d' and 'rope_mixed' extrapolate with the same patch
step (grid coordinates, no interpolation), and 'ape' interpolates its table.

Shape legend: B batch, R x C input pixels, P patch size, Ch channels, h x w patch grid,
L = 1 + h w tokens, E embed_dim, F mlp_dim, K num_classes.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from goat_jax.layers.goat import GoatAttention
from goat_jax.config.fields import Dtype, Float, Int, Str, borrow, check_instance, declare, specs_of
from goat_jax.models.lm import DTYPES
from goat_jax.kernels.plan import DEFAULT, AttentionPlan, plan_fields_hint
from goat_jax.prior import PriorSettings
from goat_jax import positional
from goat_jax.layers.positional import PositionalAttention
from goat_jax.positional import rope, rope_mixed, sincos_2d_embedding
from goat_jax.positional import registry

Array = jax.Array

# Encodings on the patch embeddings (attention runs 'nope').
EMBEDDING_ENCODINGS = ("ape", "sincos2d")
# Encodings inside attention from the positional package: those that read the patch grid ('2d')
# or ignore positions ('any'), read from its registry so a new 2D encoding is offered here too,
# with its settings as config fields.
BASELINES = tuple(e for e in positional.ENCODINGS if e.positions != "1d")
ATTENTION_ENCODINGS = tuple(e.name for e in BASELINES)
POSITION_ENCODINGS = ("goat",) + EMBEDDING_ENCODINGS + ATTENTION_ENCODINGS

# The official ViT-S/16 shape (224 px, patch 16, width 384, 12 layers, 6 heads, MLP 4x).
PRESETS = {
    "s16": dict(image_size=224, patch_size=16, num_layers=12, embed_dim=384, num_heads=6, mlp_dim=1536),
    "b16": dict(image_size=224, patch_size=16, num_layers=12, embed_dim=768, num_heads=12, mlp_dim=3072),
}


@dataclasses.dataclass(frozen=True)
class ViTConfig:
    """Hyper-parameters of :class:`ViT`: the fields of a config's ``model`` section (build from
    ml_collections with :meth:`from_config`, or a named shape with :meth:`preset`). Dtypes may
    be given as strings or dtypes.

    Each field is declared once, here (default, type, range, doc: its
    :func:`goat_jax.config.fields.declare` metadata, from which :data:`FIELD_SPECS` is derived);
    the GOAT fields are :class:`goat_jax.prior.PriorSettings`' declarations with the official
    ViT recipe's defaults, and the attention baselines' fields their encodings' declarations
    (``rope_base``: ``goat_jax.positional.rope.RopeSettings``, ``rope_mixed_base``:
    ``goat_jax.positional.rope_mixed.RopeMixedSettings``) with Heo et al.'s defaults; the model
    passes :attr:`prior` or :attr:`encoding_settings`, one object. Cross-field rules are in
    ``__post_init__``.
    """

    num_classes: int = declare(1000, Int(min=1, doc="classifier outputs K"))
    image_size: int = declare(224, Int(min=1, doc="training resolution: sets the 'ape' table grid"))
    patch_size: int = declare(16, Int(min=1, doc="P, the patch side (and the stride of the patch embedding)"))
    channels: int = declare(3, Int(choices=(1, 3), doc="1 grayscale, 3 RGB"))
    num_layers: int = declare(12, Int(min=1, doc="transformer blocks"))
    embed_dim: int = declare(384, Int(min=1, doc="residual width E"))
    num_heads: int = declare(6, Int(min=1, doc="attention heads"))
    mlp_dim: int = declare(1536, Int(min=1, doc="GELU MLP hidden width F"))
    position_encoding: str = declare("goat", Str(choices=POSITION_ENCODINGS))
    drop_path_rate: float = declare(0.1, Float(min=0.0, max=1.0, max_inclusive=False,
                                               doc="stochastic depth of the last block; linear from 0 over depth"))
    norm_eps: float = declare(1e-6, Float(min=0.0, min_inclusive=False, doc="LayerNorm epsilon"))
    pos_rank: int = borrow(PriorSettings, "pos_rank", default=16)  # split between rows and columns
    abs_rank: int = borrow(PriorSettings, "abs_rank", default=2)
    prior_init: str = borrow(PriorSettings, "prior_init", default="uniform")  # official ViT: a flat prior
    enable_key_bias: bool = borrow(PriorSettings, "enable_key_bias")
    learn_frequencies: bool = borrow(PriorSettings, "learn_frequencies")  # rows' and columns'
    qk_layout: str = borrow(PriorSettings, "qk_layout")  # docs/layer.md, Packed width
    rope_base: float = borrow(rope.RopeSettings, "rope_base", default=100.0)  # 'rope2d' (Heo et al. 2024: 100)
    rope_mixed_base: float = borrow(rope_mixed.RopeMixedSettings, "rope_mixed_base", default=10.0)  # Heo et al.: 10
    sincos_temperature: float = declare(10_000.0, Float(min=1.0, min_inclusive=False,
                                                        doc="'sincos2d' temperature (big_vision default)"))
    dtype: Any = declare("float32", Dtype(DTYPES, doc="compute dtype of activations"))
    param_dtype: Any = declare("float32", Dtype(DTYPES, doc="storage dtype of parameters"))

    def __post_init__(self):
        check_instance(self, "model")  # each field's own type and range (its declaration)
        if self.image_size % self.patch_size:
            raise ValueError(f"ViTConfig.image_size={self.image_size} is not divisible by "
                             f"patch_size={self.patch_size}.")
        if self.embed_dim % self.num_heads:
            raise ValueError(f"ViTConfig.embed_dim={self.embed_dim} is not divisible by "
                             f"num_heads={self.num_heads}.")
        if self.position_encoding == "sincos2d" and self.embed_dim % 4:
            raise ValueError(f"position_encoding='sincos2d' needs embed_dim divisible by 4, got {self.embed_dim}.")
        _ = self.prior  # the GOAT settings' own rules
        if self.position_encoding != "goat":  # the baseline's own rules: its settings' and its head's
            _ = self.encoding_settings
            positional.get_encoding(self.attention_encoding).check_head_dim(self.embed_dim // self.num_heads)

    @property
    def prior(self) -> PriorSettings:
        """The GOAT prior's settings (PriorSettings defaults for the fields not named here)."""
        return PriorSettings.from_fields(self)

    @property
    def attention_encoding(self) -> str:
        """The encoding of the attention layers: ``position_encoding``, 'nope' for the embedding
        encodings."""
        return self.position_encoding if self.position_encoding in ATTENTION_ENCODINGS else "nope"

    @property
    def encoding_settings(self) -> Optional[positional.EncodingSettings]:
        """The attention baseline's settings (its ``settings_class`` of this config's fields of
        those names), None for 'goat'."""
        if self.position_encoding == "goat":
            return None
        return positional.get_encoding(self.attention_encoding).settings_class.from_fields(self)

    @property
    def train_grid(self) -> Tuple[int, int]:
        """(rows, cols) of the patch grid at the training resolution."""
        side = self.image_size // self.patch_size
        return side, side

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> "ViTConfig":
        """A named shape from :data:`PRESETS` ('s16' = the official ViT-S/16), with overrides."""
        if name not in PRESETS:
            raise ValueError(f"Unknown ViT preset {name!r}; choose one of {sorted(PRESETS)}.")
        return cls(**{**PRESETS[name], **overrides})

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any]) -> "ViTConfig":
        """Builds a ViTConfig from an ``ml_collections.ConfigDict`` (or mapping); a ``preset``
        key starts from that shape. Unknown keys raise ValueError naming them."""
        values = cfg.to_dict() if hasattr(cfg, "to_dict") else dict(cfg)
        preset = values.pop("preset", None)
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - fields)
        if unknown:
            raise ValueError(f"Unknown ViTConfig field(s): {unknown}. Known fields: {sorted(fields)} and 'preset'."
                             + plan_fields_hint(unknown))
        return cls.preset(preset, **values) if preset else cls(**values)


# A registered 2D encoding's setting that ViTConfig does not borrow becomes a field of its own name.
ViTConfig = registry.add_settings_fields(ViTConfig, BASELINES)

# Type, range and doc of every field of a config's ``model`` section: ViTConfig's declarations
# plus ``preset`` (checked by the engine before any work, goat_jax/config/fields.py).
FIELD_SPECS = {"preset": Str(choices=tuple(PRESETS), optional=True, doc="a named shape; None: the fields alone"),
               **specs_of(ViTConfig)}


# ----------------------------------------------------------------------------------------------
# Bicubic resizing of the absolute table (pure functions)
# ----------------------------------------------------------------------------------------------


def _cubic_weights(t: np.ndarray, a: float) -> np.ndarray:
    """Keys cubic convolution weights of the 4 taps at offsets -1, 0, 1, 2 for fraction ``t``."""
    def near(x):  # |x| <= 1
        return ((a + 2) * x - (a + 3)) * x * x + 1

    def far(x):  # 1 < |x| < 2
        return ((a * x - 5 * a) * x + 8 * a) * x - 4 * a

    return np.stack([far(t + 1), near(t), near(1 - t), far(2 - t)], axis=-1)


def bicubic_matrix(in_size: int, out_size: int, a: float = -0.75) -> np.ndarray:
    """``[out_size, in_size]`` float64 matrix of 1D bicubic resampling, PyTorch semantics.

    Matches ``torch.nn.functional.interpolate(mode='bicubic', align_corners=False)`` (no
    antialiasing): half-pixel centres ``src = (dst + 0.5) * in / out - 0.5``, Keys' cubic with
    ``a = -0.75``, taps outside the input clamped to the border. ``jax.image.resize('bicubic')``
    differs on all three counts (``a = -0.5``, weights renormalized at the border, antialiasing
    when shrinking), so it would not reproduce the official baseline's evaluation.
    """
    src = (np.arange(out_size, dtype=np.float64) + 0.5) * (in_size / out_size) - 0.5
    base = np.floor(src)
    weights = _cubic_weights(src - base, a)  # [out, 4]
    taps = np.clip(base[:, None].astype(np.int64) + np.arange(-1, 3), 0, in_size - 1)  # [out, 4]
    m = np.zeros((out_size, in_size), np.float64)
    np.add.at(m, (np.repeat(np.arange(out_size), 4), taps.reshape(-1)), weights.reshape(-1))
    return m


def resize_position_table(table: Array, old_grid: Tuple[int, int], new_grid: Tuple[int, int]) -> Array:
    """Resizes a row-major patch position table to another grid (bicubic, PyTorch semantics).

    Args:
      table: [old_h * old_w, E] (patch entries only; keep a CLS entry aside).
      old_grid, new_grid: (rows, cols).
    Returns:
      [new_h * new_w, E] in ``table``'s dtype; exactly ``table`` when the grids are equal.
    """
    old_grid, new_grid = tuple(old_grid), tuple(new_grid)
    if table.shape[0] != old_grid[0] * old_grid[1]:
        raise ValueError(f"table has {table.shape[0]} rows, but old_grid={old_grid} has "
                         f"{old_grid[0] * old_grid[1]} patches.")
    if old_grid == new_grid:
        return table
    rows = jnp.asarray(bicubic_matrix(old_grid[0], new_grid[0]), jnp.float32)  # [h', h]
    cols = jnp.asarray(bicubic_matrix(old_grid[1], new_grid[1]), jnp.float32)  # [w', w]
    grid = table.astype(jnp.float32).reshape(old_grid + (-1,))  # [h, w, E]
    out = jnp.einsum("ih,jw,hwe->ije", rows, cols, grid, precision=jax.lax.Precision.HIGHEST)
    return out.reshape(new_grid[0] * new_grid[1], -1).astype(table.dtype)


def patch_grid(image_shape: Tuple[int, ...], patch_size: int) -> Tuple[int, int]:
    """(rows, cols) of patches for an ``[B, R, C, Ch]`` image; raises ValueError naming the
    resolution and the patch size unless both sides are divisible by it."""
    r, c = int(image_shape[1]), int(image_shape[2])
    if r % patch_size or c % patch_size:
        raise ValueError(f"Input resolution {r}x{c} is not divisible by patch_size={patch_size}; "
                         f"resize or crop to a multiple of {patch_size} (e.g. "
                         f"{r // patch_size * patch_size}x{c // patch_size * patch_size}).")
    return r // patch_size, c // patch_size


# ----------------------------------------------------------------------------------------------
# Blocks
# ----------------------------------------------------------------------------------------------


def _layer_norm(cfg: ViTConfig, name: str) -> nn.Module:
    return nn.LayerNorm(epsilon=cfg.norm_eps, dtype=jnp.dtype(cfg.dtype), param_dtype=jnp.dtype(cfg.param_dtype),
                        scale_init=nn.with_logical_partitioning(nn.initializers.ones, ("embed",)),
                        bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ("embed",)), name=name)


def _dense(cfg: ViTConfig, features: int, axes, name: str) -> nn.Module:
    # big_vision's MlpBlock init: xavier-uniform kernels, near-zero normal biases.
    return nn.Dense(features, dtype=jnp.dtype(cfg.dtype), param_dtype=jnp.dtype(cfg.param_dtype),
                    kernel_init=nn.with_logical_partitioning(nn.initializers.xavier_uniform(), axes),
                    bias_init=nn.with_logical_partitioning(nn.initializers.normal(1e-6), axes[1:]), name=name)


def make_attention(cfg: ViTConfig, plan: AttentionPlan = DEFAULT, name: str = "attention") -> nn.Module:
    """GoatAttention (2D, CLS) for 'goat', else PositionalAttention (the encoding itself for
    :data:`ATTENTION_ENCODINGS`, 'nope' for those that live on the embeddings). Shared knobs are passed identically; every variant
    has qkv and output biases, as the official ViT. ``plan``: the model's attention plan."""
    common = dict(num_heads=cfg.num_heads, out_features=cfg.embed_dim, use_bias=True,
                  dtype=jnp.dtype(cfg.dtype), param_dtype=jnp.dtype(cfg.param_dtype),
                  plan=plan, name=name)
    if cfg.position_encoding == "goat":
        return GoatAttention(prior=cfg.prior, pos_encoding="2d", has_cls_token_default=True, **common)
    return PositionalAttention(position_encoding=cfg.attention_encoding, settings=cfg.encoding_settings, **common)


class EncoderBlock(nn.Module):
    """Pre-LN block ``x + dp(attn(ln(x)))``, then ``x + dp(mlp(ln(x)))``: [B, L, E] -> [B, L, E].

    ``dp`` is drop-path (stochastic depth, Huang et al. 2016): the whole residual branch of an
    example is dropped with probability ``drop_path`` and kept ones are scaled by
    ``1 / (1 - drop_path)``, drawn from the 'dropout' rng stream when ``train``.
    """

    config: ViTConfig
    drop_path: float = 0.0
    plan: AttentionPlan = DEFAULT  # the model's (ViT.plan)

    @nn.compact
    def __call__(self, x: Array, grid: Tuple[int, int], train: bool) -> Array:
        cfg = self.config
        # broadcast over tokens and features: one keep/drop decision per example and branch.
        drop = nn.Dropout(self.drop_path, broadcast_dims=(1, 2), deterministic=not train)
        h = make_attention(cfg, self.plan)(_layer_norm(cfg, "attn_norm")(x), spatial_shape=grid, has_cls_token=True)
        x = nn.with_logical_constraint(x + drop(h), ("batch", "length", "embed"))
        h = _layer_norm(cfg, "mlp_norm")(x)
        h = _dense(cfg, cfg.mlp_dim, ("embed", "mlp"), "fc1")(h)
        h = nn.with_logical_constraint(nn.gelu(h, approximate=False), ("batch", "length", "mlp"))
        h = _dense(cfg, cfg.embed_dim, ("mlp", "embed"), "fc2")(h)
        return nn.with_logical_constraint(x + drop(h), ("batch", "length", "embed"))


class ViT(nn.Module):
    """``images [B, R, C, Ch] -> logits [B, K] float32``.

    Call: ``model.apply(variables, images, train=False)``; with ``train=True`` pass
    ``rngs={'dropout': key}`` (drop-path). Images are channels-last floats (normalized by the
    data pipeline); any resolution divisible by ``patch_size`` works, the grid is derived from
    the input.
    """

    config: ViTConfig
    plan: AttentionPlan = DEFAULT  # how attention runs (the run's, handed over by the task)

    @nn.compact
    def __call__(self, images: Array, *, train: bool = False) -> Array:
        cfg = self.config
        dtype = jnp.dtype(cfg.dtype)
        if images.ndim != 4:
            raise ValueError(f"images must be [batch, rows, cols, channels], got shape {images.shape}.")
        if images.shape[-1] != cfg.channels:
            raise ValueError(
                f"images have {images.shape[-1]} channel(s) but the model expects channels={cfg.channels} "
                f"({'grayscale' if cfg.channels == 1 else 'RGB' if cfg.channels == 3 else 'as configured'}); "
                "convert the images (e.g. PIL .convert('RGB' or 'L')) or set model.channels.")
        grid = patch_grid(images.shape, cfg.patch_size)
        p = cfg.patch_size
        x = nn.Conv(cfg.embed_dim, (p, p), strides=(p, p), padding="VALID", dtype=dtype,
                    param_dtype=jnp.dtype(cfg.param_dtype),
                    kernel_init=nn.with_logical_partitioning(nn.initializers.lecun_normal(), (None, None, None, "embed")),
                    bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ("embed",)),
                    name="patch_embed")(images.astype(dtype))  # [B, h, w, E]
        b = x.shape[0]
        x = x.reshape(b, grid[0] * grid[1], cfg.embed_dim)  # [B, h w, E], row-major patches

        if cfg.position_encoding == "sincos2d":
            x = x + sincos_2d_embedding(grid[0], grid[1], cfg.embed_dim, cfg.sincos_temperature).astype(dtype)
        cls = self.param("cls", nn.with_logical_partitioning(nn.initializers.zeros, (None, None, "embed")),
                         (1, 1, cfg.embed_dim), jnp.dtype(cfg.param_dtype))
        x = jnp.concatenate([jnp.broadcast_to(cls.astype(dtype), (b, 1, cfg.embed_dim)), x], axis=1)  # [B, L, E]
        if cfg.position_encoding == "ape":
            table = self.param("pos_embed", nn.with_logical_partitioning(nn.initializers.normal(0.02), (None, "embed")),
                               (1 + cfg.train_grid[0] * cfg.train_grid[1], cfg.embed_dim),
                               jnp.dtype(cfg.param_dtype))
            patches = resize_position_table(table[1:], cfg.train_grid, grid)  # CLS entry kept as is
            x = x + jnp.concatenate([table[:1], patches], axis=0).astype(dtype)
        x = nn.with_logical_constraint(x, ("batch", "length", "embed"))

        for i in range(cfg.num_layers):
            # Stochastic depth grows linearly from 0 at the first block to drop_path_rate.
            rate = cfg.drop_path_rate * i / max(cfg.num_layers - 1, 1)
            x = EncoderBlock(cfg, drop_path=rate, plan=self.plan, name=f"block_{i}")(x, grid, train)

        x = _layer_norm(cfg, "final_norm")(x[:, 0])  # [B, E], the CLS token
        # Zero-initialized head (big_vision): every class starts equally likely. float32 logits
        # for the softmax and the loss.
        head = nn.Dense(cfg.num_classes, dtype=jnp.float32, param_dtype=jnp.dtype(cfg.param_dtype),
                        kernel_init=nn.with_logical_partitioning(nn.initializers.zeros, ("embed", "classes")),
                        bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ("classes",)), name="head")
        return head(x.astype(jnp.float32))
