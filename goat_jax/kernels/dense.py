"""'dense': the materialized float32 reference, ``softmax(scale * q . k + bias + mask) v`` at
highest precision, and the only kernel that returns the attention probabilities (what layers
sow for evaluations, ``implementation='dense'``).
"""

from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp

from goat_jax.kernels import capabilities as caps
from goat_jax.kernels.mask import AttentionMask

Array = jax.Array


def attention(q: Array, k: Array, v: Array, *, scale: float, mask: AttentionMask, bias: Optional[Array] = None,
              mesh: Any = None, return_probs: bool = False) -> Any:
    """q [B, T, N, Hqk], k [B, S, K, Hqk], v [B, S, K, Hv] -> [B, T, N, Hv] in v's dtype, and
    with ``return_probs`` the probabilities [B, N, T, S] float32 too. ``mesh`` is unused."""
    del mesh
    g = q.shape[2] // k.shape[2]
    k = jnp.repeat(k, g, axis=2)
    v = jnp.repeat(v, g, axis=2)
    real = jnp.promote_types(q.dtype, jnp.float32)
    logits = jnp.einsum("btnh,bsnh->bnts", q.astype(real), k.astype(real),
                        precision=jax.lax.Precision.HIGHEST) * scale
    if bias is not None:
        logits = logits + bias.astype(real)
    explicit = mask.explicit(q.shape[1], k.shape[1])
    if explicit is not None:
        logits = jnp.where(explicit, logits, -jnp.inf)
        # A row without visible keys would be softmax(all -inf) = NaN, and NaN * 0 poisons the
        # value gradient even after attend() zeroes the row: give it finite logits instead.
        logits = jnp.where(explicit.any(axis=-1, keepdims=True), logits, 0.0)
    probs = jax.nn.softmax(logits, axis=-1)
    out = jnp.einsum("bnts,bsnh->btnh", probs, v.astype(real), precision=jax.lax.Precision.HIGHEST)
    return (out.astype(v.dtype), probs) if return_probs else out.astype(v.dtype)


ROW = caps.Capability(
    name="dense", platforms=caps.ANY, features=caps.FEATURES,
    summary="the materialized float32 reference (and the only kernel returning probabilities)", attention=attention,
    fallback=1, materializes_logits=True)  # no ring blocks: it returns no log-sum-exp to merge blocks by
