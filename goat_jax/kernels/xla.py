"""'xla': ``jax.nn.dot_product_attention``'s XLA path, which materializes the T x S logits (the
automatic choice for short sequences and decoding, and the one fast kernel that takes an
additive bias or a sliding window). :func:`dot_product_attention` is also the call of the
'cudnn' kernel (:mod:`goat_jax.kernels.cudnn`).
"""

from __future__ import annotations

from typing import Any, Optional

import jax

from goat_jax.kernels import capabilities as caps
from goat_jax.kernels import flash
from goat_jax.kernels.mask import AttentionMask
from goat_jax.kernels.padding import pad_head_dims

Array = jax.Array


def dot_product_attention(q: Array, k: Array, v: Array, scale: float, mask: AttentionMask, bias: Optional[Array],
                          implementation: str, head_dim_multiple: int = 1, full_mask: bool = False) -> Array:
    """``jax.nn.dot_product_attention`` of q [B, T, N, Hqk], k [B, S, K, Hqk], v [B, S, K, Hv]
    under ``mask`` with jax's ``implementation``: q/k/v padded to one width with zero channels
    (it needs equal widths; q/k first to a multiple of ``head_dim_multiple``), the kernel's own
    causal mode for a static offset of 0 and its own ``key_value_seq_lengths``, everything else
    as an explicit boolean mask (``full_mask``: broadcast to its full shape, as cuDNN needs it).
    Returns [B, T, N, Hv]."""
    hv, t, s = v.shape[-1], q.shape[1], k.shape[1]
    q, k, v = pad_head_dims(q, k, v, head_dim_multiple)
    native = mask.native_causal
    explicit = mask.replace(causal=mask.causal and not native).explicit(t, s, lengths=False, full=full_mask)
    out = jax.nn.dot_product_attention(
        q, k, v, bias=bias, mask=explicit, scale=scale, is_causal=native,
        key_value_seq_lengths=mask.kv_lengths, implementation=implementation)
    return out[..., :hv]


def attention(q: Array, k: Array, v: Array, *, scale: float, mask: AttentionMask, bias: Optional[Array] = None,
              mesh: Any = None) -> Array:
    """The 'xla' kernel (module doc); ``mesh`` is unused (XLA partitions it itself)."""
    del mesh
    return dot_product_attention(q, k, v, scale, mask, bias, "xla")


ROW = caps.Capability(
    name="xla", platforms=caps.ANY,
    features=("segment_ids", "ragged_segments", "bias", "traced_offset", "window"),
    why_not={"return_probs": caps.NO_PROBS},
    summary="jax.nn.dot_product_attention's XLA path: materializes the T x S logits", attention=attention,
    fallback=0, materializes_logits=True, ring_blocks=flash.RING_BLOCKS)  # a ring under 'xla' runs flash's loops
