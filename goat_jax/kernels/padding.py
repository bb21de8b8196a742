"""Exact padding of attention inputs to what a kernel needs: lengths to whole blocks (splash's
128, cuDNN's even lengths) and head dims to a multiple (cuDNN's 8) or to each other (kernels that
need equal q/k and v widths). Padded keys are masked, padded query rows dropped, padded channels
are zeros: the result is the unpadded attention.
"""

from __future__ import annotations

from typing import Tuple

import jax
import jax.numpy as jnp

from goat_jax.kernels.mask import AttentionMask

Array = jax.Array


def pad_lengths(q: Array, k: Array, v: Array, mask: AttentionMask,
                multiple: int) -> Tuple[Array, Array, Array, AttentionMask]:
    """``(q, k, v, mask)`` with the query and key lengths padded to multiples of ``multiple``,
    exactly: the caller drops the extra query rows' outputs, and the extra keys are masked out
    (:meth:`goat_jax.kernels.mask.AttentionMask.padded`). Lengths already multiples are returned
    unchanged.

    Why, per kernel: splash (``multiple`` 128, its block) would otherwise leave a ViT's 197
    tokens (196 patches + CLS) the blockwise fallback on TPU, whose compile takes tens of
    minutes (padding to 256 costs splash 30% more tiles); cuDNN (``multiple`` 2): jax 0.10.2's
    cuDNN attention, under differentiation, checks every call as one with a bias (its forward
    rule is handed an empty placeholder for "no bias"), and biased cuDNN attention needs even
    lengths, so training a ViT on a GPU failed at the first step ("Unsupported sequence length
    Q 197, KV 197")."""
    b, t, s = q.shape[0], q.shape[1], k.shape[1]
    tp, sp = -(-t // multiple) * multiple, -(-s // multiple) * multiple
    if tp != t:
        q = jnp.pad(q, [(0, 0), (0, tp - t), (0, 0), (0, 0)])
    if sp != s:
        k = jnp.pad(k, [(0, 0), (0, sp - s), (0, 0), (0, 0)])
        v = jnp.pad(v, [(0, 0), (0, sp - s), (0, 0), (0, 0)])
    return q, k, v, mask.padded(b, t, s, tp, sp)


def pad_head_dims(q: Array, k: Array, v: Array, multiple: int = 1, equal: bool = True) -> Tuple[Array, Array, Array]:
    """q/k (and v) with zero channels appended: q/k to a multiple of ``multiple``, then, when
    ``equal``, the narrower of q/k and v to the wider width (``jax.nn.dot_product_attention``
    needs equal widths; GOAT's packed q/k are wider than v). The caller slices the output back
    to v's width. Zero channels add nothing to ``q . k`` and nothing to the output."""
    hqk = -(-q.shape[-1] // multiple) * multiple
    q, k = pad_width(q, hqk), pad_width(k, hqk)
    if equal:
        width = max(hqk, v.shape[-1])
        q, k, v = pad_width(q, width), pad_width(k, width), pad_width(v, width)
    return q, k, v


def pad_width(x: Array, width: int) -> Array:
    """``x`` [..., H] with zero channels appended up to ``width`` (unchanged if already that wide)."""
    return x if x.shape[-1] == width else jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - x.shape[-1])])
