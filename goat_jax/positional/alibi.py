"""ALiBi (Press et al. 2022): the logit penalty ``-m_h |p_i - p_j|`` with the ALiBi slopes.

Two forms of the same logits: 'alibi' materializes the [N, T, S] bias (the textbook form; XLA /
dense kernels only), 'alibi_packed' packs it into extra q/k channels exactly like GOAT's causal
recency slope, so it runs on flash kernels (causal only).

Shape legend: B batch, T queries, S keys, N query heads, K kv heads, G = N // K, H head dim,
c split channels.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Optional

import jax
import jax.numpy as jnp

from goat_jax import prior as prior_lib
from goat_jax.prior.packing import split_exact
from goat_jax.positional.base import EncodingContext, PositionEncoding, as_batched

Array = jax.Array
Dtype = Any


def alibi_bias(num_heads: int, q_positions: Array, k_positions: Array) -> Array:
    """ALiBi bias ``-m_h |p_i - p_j|`` with the ALiBi slopes ``m_h`` (``prior.alibi_slopes``).

    Under a causal mask this is the paper's ``-m_h (p_i - p_j)``; the absolute value is the usual
    bidirectional extension.

    Args:
      q_positions: [T] or [B, T]; k_positions: [S] or [B, S].
    Returns:
      [1 or B, N, T, S] float32.
    """
    slopes = jnp.asarray(prior_lib.alibi_slopes(num_heads), jnp.float32)
    dist = jnp.abs(as_batched(q_positions)[:, :, None] - as_batched(k_positions)[:, None, :])
    return -slopes[:, None, None] * dist[:, None]  # [B|1, N, T, S]


def pack_alibi_query(q: Array, group_size: int, channels: int, dtype: Dtype,
                     scale: Optional[float] = None) -> Array:
    """Queries for packed causal ALiBi: ``[q * scale, onehot_g x c]`` (``scale`` default
    ``1 / sqrt(H)``).

    Query head ``n`` (group member ``g = n % G`` of KV head ``n // G``) carries ones in the
    ``c`` channels of its own slope block ``g`` and zeros in the other ``G - 1`` blocks, so each
    query head picks its own slope from a key shared by its GQA group.

    Args:
      q: [B, T, N, H] raw queries.
    Returns:
      [B, T, N, H + G c] in ``dtype`` (use with attention scale 1).
    """
    b, t, n, h = q.shape
    # The scale is folded in float32 before the cast, as in goat_jax.prior.packing.pack_query.
    q32 = q.astype(jnp.float32)
    scaled = (q32 / math.sqrt(h) if scale is None else q32 * scale).astype(dtype)
    onehot = jnp.repeat(jnp.eye(group_size, dtype=dtype), channels, axis=-1)  # [G, G c]
    select = jnp.tile(onehot, (n // group_size, 1))  # [N, G c]; row n -> block n % G
    return jnp.concatenate([scaled, jnp.broadcast_to(select, (b, t, n, select.shape[-1]))], axis=-1)


def pack_alibi_key(k: Array, k_positions: Array, num_heads: int, channels: int, dtype: Dtype) -> Array:
    """Keys for packed causal ALiBi: ``[k, split(m_g p_j) for g in group]``.

    ``q~ . k~ = q . k / sqrt(H) + m_n p_j``, which is ALiBi's ``-m_n (p_i - p_j)`` up to the
    row constant ``m_n p_i`` that softmax ignores: valid under a causal mask with positions
    increasing along the sequence. ``m p_j`` grows with position, so it is split exactly into
    ``c`` parts of ``dtype`` (``goat_jax.prior.packing.split_exact``, as GOAT's sink): bf16 inputs multiply
    exactly and accumulate in float32, so the slope reaches the logits at float32 accuracy.

    Args:
      k: [B, S, K, H]; k_positions: [S] or [B, S].
    Returns:
      [B, S, K, H + G c] in ``dtype``.
    """
    b, s, kh, h = k.shape
    g = num_heads // kh
    slopes = jnp.asarray(prior_lib.alibi_slopes(num_heads), jnp.float32).reshape(kh, g)  # [K, G]
    u = as_batched(k_positions)[:, :, None, None] * slopes  # [B|1, S, K, G]
    parts = split_exact(u, channels, dtype).reshape(u.shape[:3] + (g * channels,))  # [B|1, S, K, G c]
    return jnp.concatenate([k.astype(dtype), jnp.broadcast_to(parts, (b, s, kh, g * channels))], axis=-1)


class Alibi(PositionEncoding):
    """'alibi': the materialized bias, bidirectional as ``-m |p_i - p_j|``."""

    name = "alibi"
    materialized_bias = True
    flash_alternative = "'alibi_packed' (causal)"

    def bias(self, params: Mapping[str, Any], ctx: EncodingContext) -> Array:
        return alibi_bias(ctx.shape.num_heads, ctx.q_pos, ctx.attended_k_pos)  # [B|1, N, T, S] float32


class AlibiPacked(PositionEncoding):
    """'alibi_packed': ``[q * scale, one-hot slope selector]`` . ``[k, split(m p_j)]``; the scale is
    folded into the queries, so the kernel runs at scale 1. The cache stores packed keys."""

    name = "alibi_packed"
    causal_only = ("it drops ALiBi's row constant m * p_i, which is exact only when every visible "
                   "key precedes the query. Use 'alibi' (materialized bias) for bidirectional attention.")

    def extra_qk_dims(self, shape: Any, channels: int) -> int:
        return shape.group * channels

    def encode(self, params: Mapping[str, Any], ctx: EncodingContext, q: Array, k: Array):
        dtype = ctx.shape.dtype
        q = pack_alibi_query(q, ctx.shape.group, ctx.channels, dtype, ctx.attention_scale)  # [B, T, N, H + G c]
        k = pack_alibi_key(k, ctx.k_pos, ctx.shape.num_heads, ctx.channels, dtype)  # [B, S, K, H + G c]
        return q, k, 1.0


ALIBI, ALIBI_PACKED = Alibi(), AlibiPacked()
