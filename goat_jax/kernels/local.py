"""One kernel on one device's arrays: :func:`attend_local`, the kernel of a capability row
(``row.attention``) with the rows that see no key zeroed. The front door
(:func:`goat_jax.kernels.attend`) calls it without context parallelism, and the context
strategies call it per device inside their ``shard_map``.
"""

from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp

from goat_jax.kernels.capabilities import CAPABILITIES
from goat_jax.kernels.mask import AttentionMask
from goat_jax.kernels.plan import DEFAULT, AttentionPlan

Array = jax.Array


def zero_empty_rows(out: Array, visible: Optional[Array]) -> Array:
    """Zeros the rows of ``out`` [B, T, N, H] without a visible key (a select: zero cotangent)."""
    if visible is None:
        return out
    return jnp.where(visible[:, :, None, None], out, jnp.zeros((), out.dtype))


def attend_local(q: Array, k: Array, v: Array, mask: AttentionMask, bias: Optional[Array], *,
                 implementation: str, scale: float, mesh: Any = None, plan: AttentionPlan = DEFAULT) -> Array:
    """Kernel ``implementation`` on q/k/v under ``mask``, with the rows that see no key zeroed
    (every kernel agrees there: module doc of :mod:`goat_jax.kernels`). ``mesh``: where a kernel
    that XLA cannot partition (splash) splits its work; None inside a shard_map. A kernel whose
    row bounds the documents of a packed row (``bounds_documents``: cuDNN's packed layout) is
    sized by ``plan.max_documents_per_row`` (its ``max_documents=``)."""
    row = CAPABILITIES[implementation]
    layout = {"max_documents": plan.max_documents_per_row} if row.bounds_documents else {}
    out = row.attention(q, k, v, scale=scale, mask=mask, bias=bias, mesh=mesh, **layout)
    return zero_empty_rows(out, mask.rows_with_keys(q.shape[1], k.shape[1]))
