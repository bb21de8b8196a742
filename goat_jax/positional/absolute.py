"""Absolute position encodings, added to the token (or patch) embeddings before the first layer,
not inside attention: :func:`sinusoidal_embedding` (Vaswani et al. 2017),
:func:`sincos_2d_embedding` (big_vision's ViT default) and :class:`LearnedPositionEmbedding`
(GPT-2 / BERT). A model using them runs its attention with ``position_encoding='nope'``.
"""

from __future__ import annotations

from typing import Any, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from goat_jax import partitioning
from goat_jax import prior as prior_lib
from goat_jax.positional.base import check_max_len
from goat_jax.positional.rope import rope_frequencies
from goat_jax.prior import angles

Array = jax.Array
Dtype = Any


def sinusoidal_embedding(positions: Array, dim: int, base: float = 10_000.0) -> Array:
    """Vaswani et al. (2017) absolute encoding: ``PE[p, 2i] = sin(p / base**(2i/dim))``,
    ``PE[p, 2i+1] = cos(p / base**(2i/dim))`` (interleaved, as in the paper).

    Args:
      positions: [...] integer or float positions.
    Returns:
      [..., dim] float32, added to the token embeddings (attention then uses 'nope'). The angles
      are exact integer phases (:mod:`goat_jax.prior.angles`), as RoPE's.
    """
    angle = angles.angles(jnp.asarray(positions), rope_frequencies(dim, base))  # [..., dim/2]
    return jnp.stack([jnp.sin(angle), jnp.cos(angle)], axis=-1).reshape(angle.shape[:-1] + (dim,))


def sincos_2d_embedding(rows: int, cols: int, width: int, temperature: float = 10_000.0) -> Array:
    """big_vision's fixed 2D sin-cos patch embedding (``posemb_sincos_2d``, its ViT default).

    With ``omega_i = temperature ** (-i / (width/4 - 1))``, i < width/4, the patch at (r, c)
    gets ``[sin(c omega), cos(c omega), sin(r omega), cos(r omega)]`` (that order).

    Returns:
      [rows * cols, width] float32, row-major over the grid; added to the patch embeddings
      (a CLS token gets none, as in big_vision).
    """
    if width % 4 or width < 8:
        raise ValueError(f"sincos_2d_embedding needs a width divisible by 4 and >= 8, got {width}.")
    quarter = width // 4
    omega = 1.0 / temperature ** (np.arange(quarter, dtype=np.float64) / (quarter - 1))  # host f64
    r, c = np.meshgrid(np.arange(rows), np.arange(cols), indexing="ij")
    y = r.reshape(-1)[:, None] * omega  # [L, W/4]
    x = c.reshape(-1)[:, None] * omega
    return jnp.asarray(np.concatenate([np.sin(x), np.cos(x), np.sin(y), np.cos(y)], axis=1), jnp.float32)


class LearnedPositionEmbedding(nn.Module):
    """A learned absolute position table (GPT-2 / BERT style), added to token embeddings.

    ``module(positions)`` with integer ``positions`` [...] (e.g. ``arange(T)``) returns
    [..., features]. Positions >= ``max_len`` raise ValueError when known at trace time and give
    NaN when traced (no silent clamping). Attention then uses ``position_encoding='nope'``.
    """

    max_len: int
    features: int
    dtype: Optional[Dtype] = None
    param_dtype: Dtype = jnp.float32
    embedding_init: Any = nn.initializers.normal(stddev=0.02)

    @nn.compact
    def __call__(self, positions: Array) -> Array:
        check_max_len(self.max_len, prior_lib.concrete_range(positions), "LearnedPositionEmbedding")
        table = self.param(
            "embedding", partitioning.with_logical_partitioning(self.embedding_init, (None, "embed")),
            (self.max_len, self.features), self.param_dtype)
        idx = jnp.asarray(positions).astype(jnp.int32)
        out = jnp.asarray(table).at[idx].get(mode="fill", fill_value=jnp.nan, wrap_negative_indices=False)
        return out.astype(self.dtype or self.param_dtype)
