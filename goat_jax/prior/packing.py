"""Packing GOAT's log-prior into extra q/k channels (pure functions, no Flax), so that any
unmodified dot-product kernel computes GOAT exactly. The baselines that pack a bias the same way
(ALiBi packed, FoX's forget gates) use the exact bf16 split here too.

Paper section 3.3 (docs/protocols.md, The mechanism). Per head, with content dims ``d_c``::

    q~ = [q_c / sqrt(d_c),  A cos(w p_i) + B sin(w p_i),  A sin(w p_i) - B cos(w p_i),  g * 1 ...]
    k~ = [k_c,              cos(w p_j),                   sin(w p_j),                   u(j) ...]

so that ``q~ . k~`` (scale 1) equals ``q_c . k_c / sqrt(d_c) + kappa(p_i - p_j) + g u(j)`` and
any unmodified dot-product kernel (cuDNN flash, splash, XLA) computes GOAT exactly, with no
T x S bias. Values keep the full head dim.

bfloat16 at long context. ``u(j)`` contains the causal recency term ``slope * j``, which grows
with position: rounded to bfloat16 (8 mantissa bits) it is off by up to ``2**-9 |u|``, i.e. up
to 16 logits at j = 16384 -- this is what breaks the official package in bf16. We instead
split ``u`` *exactly* into ``c`` bf16 (or fp16) channels ``u = u_1 + ... + u_c`` (each the
rounding of the remainder), with the query side carrying the same coefficient (1 or the gate)
in each. Kernels multiply bf16 inputs exactly and accumulate in float32, so the sink reaches
the logits with float32 accuracy (3 bf16 parts carry 24 bits). The bounded channels (Fourier
features, scaled content) have position-independent rounding errors and stay one channel.
``sink_channels`` is 1 in float32, 3 in bfloat16 and 2 in float16 by default in the official
layout; the packed q/k dim is then ``head_dim + sink_channels - 1`` and values are zero-padded to
it where a kernel needs equal dims (cuDNN/XLA), never for splash. The content width of the
official layout does not depend on it (``head_dim - 2R - 1``), so the layer is one function in
every dtype. In ``qk_layout='lane_aligned'`` the channels are carved from the head instead, so
their number decides the content width: there it is fixed by the layout,
:data:`LANE_ALIGNED_SINK_CHANNELS` (bfloat16's 3) in every dtype, the parts past the first
exactly 0 in float32 (:func:`packed_sink_channels`).

Shape legend: B batch, T queries, S keys, N query heads, K kv heads, d_c content dims, R
relative rank.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import jax
import jax.numpy as jnp

from goat_jax.prior.positions import real_dtype
from goat_jax.prior.settings import LANE_ALIGNED_SINK_CHANNELS

Array = jax.Array
Dtype = Any


def default_sink_channels(dtype: Dtype) -> int:
    """Channels needed to carry ``u(j)`` at float32 accuracy in ``dtype`` (see module doc).

    What the official layout packs (they widen q/k, the content keeps its width); a layout that
    carves its channels from the head takes :func:`packed_sink_channels` instead."""
    dtype = jnp.dtype(dtype)
    if dtype == jnp.dtype(jnp.bfloat16):
        return 3
    if dtype == jnp.dtype(jnp.float16):
        return 2
    return 1


def packed_sink_channels(qk_layout: str, enable_key_bias: bool, sink_channels: Optional[int],
                         dtype: Dtype) -> int:
    """The sink channels a GOAT layer packs: 0 without the sink; an explicit ``sink_channels``
    (>= 1) as given, in every dtype; else, for ``qk_layout='official'``,
    :func:`default_sink_channels` of ``dtype`` (they widen q/k and leave the content width alone),
    and for ``'lane_aligned'`` :data:`LANE_ALIGNED_SINK_CHANNELS` in every dtype (they are carved
    from the content, so a dtype-dependent count would make each dtype another function; in
    float32 the parts past the first are exactly 0). Pass the result to
    :meth:`goat_jax.prior.PriorSpec.content_dim` and to :func:`pack_query` / :func:`pack_key`.

    Raises:
      ValueError: ``sink_channels < 1`` with the sink enabled, naming the argument.
    """
    if not enable_key_bias:
        return 0
    if sink_channels is not None:
        if int(sink_channels) < 1:
            raise ValueError(f"sink_channels must be >= 1 when enable_key_bias, got {sink_channels}; "
                             "leave it None for the layout's own count.")
        return int(sink_channels)
    if qk_layout == "lane_aligned":
        return LANE_ALIGNED_SINK_CHANNELS
    return default_sink_channels(dtype)


def split_exact(x: Array, parts: int, dtype: Dtype) -> Array:
    """Splits float32 ``x`` into ``parts`` values of ``dtype`` whose float32 sum is ``x``
    (up to the last part's rounding): ``x_1 = round(x)``, ``x_2 = round(x - x_1)``, ...

    Returns [..., parts] in ``dtype``.
    """
    out, rest = [], x.astype(real_dtype())
    for _ in range(parts):
        piece = rest.astype(dtype)
        out.append(piece)
        rest = rest - piece.astype(rest.dtype)
    return jnp.stack(out, axis=-1)


def pack_query(q_content: Array, q_rel: Array, q_sink: Array, sink_channels: int, dtype: Dtype) -> Array:
    """Packed queries ``[q_c / sqrt(d_c), q_rel, q_sink x sink_channels]``.

    Args:
      q_content: [B, T, N, d_c]; q_rel: [..., T, N, 2R]; q_sink: [..., T, N] (ignored when
        ``sink_channels == 0``).
    Returns:
      [B, T, N, d_c + 2R + sink_channels] in ``dtype``.
    """
    b, t, n, d_c = q_content.shape
    # The 1/sqrt(d_c) scale is folded in float32 before the cast so the kernel runs at scale 1.
    parts = [(q_content.astype(real_dtype()) / math.sqrt(d_c)).astype(dtype),
             jnp.broadcast_to(q_rel, (b, t, n, q_rel.shape[-1])).astype(dtype)]
    if sink_channels:
        coef = jnp.broadcast_to(q_sink, (b, t, n))[..., None]
        parts.append(jnp.repeat(coef, sink_channels, axis=-1).astype(dtype))
    return jnp.concatenate(parts, axis=-1)


def pack_key(k_content: Array, k_rel: Array, u: Array, sink_channels: int, dtype: Dtype,
             rel_per_head: bool = False) -> Array:
    """Packed keys ``[k_c, cos(w p_j), sin(w p_j), split(u(j))]``.

    Args:
      k_content: [B, S, K, d_c]; k_rel: [..., S, 2R] shared by the heads, or [..., S, K, 2R]
        when ``rel_per_head`` (learned per-head frequencies); u: [..., S, K] float32.
    Returns:
      [B, S, K, d_c + 2R + sink_channels] in ``dtype``.
    """
    b, s, kh, _ = k_content.shape
    rel = k_rel if rel_per_head else k_rel[..., None, :]
    parts = [k_content.astype(dtype),
             jnp.broadcast_to(rel, (b, s, kh, k_rel.shape[-1])).astype(dtype)]
    if sink_channels:
        u = jnp.broadcast_to(u, (b, s, kh))
        parts.append(split_exact(u, sink_channels, dtype))
    return jnp.concatenate(parts, axis=-1)
