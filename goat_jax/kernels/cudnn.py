"""'cudnn': cuDNN's fused flash attention through ``jax.nn.dot_product_attention`` (GPU,
bfloat16/float16; its row in :mod:`goat_jax.kernels.capabilities` says what it takes).

cuDNN wants head dims that are multiples of 8 (GOAT's packed q/k are zero-padded to one, and v
to the q/k width: ``jax.nn.dot_product_attention`` needs equal widths) and, under
differentiation in jax 0.10.2, even lengths (:func:`goat_jax.kernels.padding.pad_lengths`).
"""

from __future__ import annotations

from typing import Any, Optional

import jax

from goat_jax.kernels.capabilities import CAPABILITIES
from goat_jax.kernels.mask import AttentionMask
from goat_jax.kernels.padding import pad_lengths
from goat_jax.kernels.xla import dot_product_attention

Array = jax.Array
ROW = CAPABILITIES["cudnn"]


def attention(q: Array, k: Array, v: Array, *, scale: float, mask: AttentionMask, bias: Optional[Array] = None,
              mesh: Any = None) -> Array:
    """The 'cudnn' kernel (module doc) on q [B, T, N, Hqk], k [B, S, K, Hqk], v [B, S, K, Hv];
    jax's partitioning rule shards it over the batch, so ``mesh`` is unused."""
    del mesh
    t_real = q.shape[1]
    q, k, v, mask = pad_lengths(q, k, v, mask, ROW.length_multiple)
    out = dot_product_attention(q, k, v, scale, mask, bias, "cudnn", ROW.head_dim_multiple)
    return out[:, :t_real]
