"""Positions from segment ids (document-aware packing): what the layers use when a packed row
comes with ``segment_ids`` but no explicit positions.

A segment is a maximal run of equal ids along the sequence; positions count from 0 at the start
of every run. For the rows of :mod:`goat_jax.data.packing` (ids 1, 2, ... then the padding id)
this reproduces the batch's ``positions`` exactly, padding included.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

Array = jax.Array


def segment_positions(segment_ids: Array) -> Array:
    """[B, T] int32 positions restarting at 0 wherever the id changes along the sequence.

    Args:
      segment_ids: [B, T] integer ids (traced or concrete).
    Raises:
      ValueError naming the argument for a shape other than [B, T] or a non-integer dtype.
    """
    segment_ids = jnp.asarray(segment_ids)
    if segment_ids.ndim != 2:
        raise ValueError(f"segment_ids must be [B, T], got shape {segment_ids.shape}.")
    if not jnp.issubdtype(segment_ids.dtype, jnp.integer):
        raise ValueError(f"segment_ids must be integer ids, got dtype {segment_ids.dtype}; cast "
                         "with .astype(jnp.int32).")
    t = segment_ids.shape[1]
    index = jnp.arange(t, dtype=jnp.int32)[None, :]
    starts = jnp.concatenate([jnp.ones_like(segment_ids[:, :1], bool),
                              segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
    # The latest run start at or before each index, by a running max: O(T), no T x T matrix.
    run_start = lax.cummax(jnp.where(starts, index, 0), axis=1)
    return (index - run_start).astype(jnp.int32)
