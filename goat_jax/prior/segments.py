"""Positions from segment ids (document-aware packing): what the layers use when a packed row
comes with ``segment_ids`` but no explicit positions.

A segment is a maximal run of equal ids along the sequence; positions count from 0 at the start
of every run. For the rows of :mod:`goat_jax.data.packing` (ids 1, 2, ... then the padding id)
this reproduces the batch's ``positions`` exactly, padding included.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

Array = jax.Array


def run_starts(segment_ids: Array) -> Array:
    """[B, T] bool: True where a run of equal ids starts (index 0 and wherever the id changes)."""
    return jnp.concatenate([jnp.ones_like(segment_ids[:, :1], bool), segment_ids[:, 1:] != segment_ids[:, :-1]],
                           axis=1)


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
    starts = run_starts(segment_ids)
    # The latest run start at or before each index, by a running max: O(T), no T x T matrix.
    run_start = lax.cummax(jnp.where(starts, index, 0), axis=1)
    return (index - run_start).astype(jnp.int32)


def segment_lengths(segment_ids: Array) -> Array:
    """[B, T] int32: the length of the run of equal ids each token belongs to (what a document
    would be as its own sequence), e.g. for length-dependent encodings ('rope_pi').

    Args:
      segment_ids: [B, T] integer ids (traced or concrete).
    """
    segment_ids = jnp.asarray(segment_ids)
    positions = segment_positions(segment_ids)  # validates shape and dtype
    t = segment_ids.shape[1]
    index = jnp.arange(t, dtype=jnp.int32)[None, :]
    ends = jnp.concatenate([segment_ids[:, 1:] != segment_ids[:, :-1],
                            jnp.ones_like(segment_ids[:, :1], bool)], axis=1)
    # The earliest run end at or after each index: a running min from the right.
    run_end = lax.cummin(jnp.where(ends, index, t), axis=1, reverse=True)
    return (run_end - index + 1 + positions).astype(jnp.int32)


def _concrete(x) -> Optional[np.ndarray]:
    """``x`` as a NumPy array when known at trace time, else None (a tracer)."""
    try:
        return np.asarray(x)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None


def check_contiguous(segment_ids: Array, name: str = "segment_ids") -> None:
    """Raises ValueError naming ``name`` when, in some row, an id re-appears after another id
    (a document split by another): positions would restart at the second run while attention
    would join both runs. Only for ids known at trace time; traced ids are not checked.
    """
    ids = _concrete(segment_ids)
    if ids is None or ids.size == 0:
        return
    for row, r in enumerate(ids.reshape(-1, ids.shape[-1])):
        runs = 1 + int(np.count_nonzero(r[1:] != r[:-1]))
        if runs != len(np.unique(r)):
            raise ValueError(
                f"{name} row {row} is not contiguous: an id re-appears after another id, so one "
                "'document' would be split in two. Give every document a run of its own id "
                "(e.g. 1, 1, 2, 2, 2, 3, ... as goat_jax.data.packing emits).")


def check_positions_agree(positions: Array, segment_ids: Array, name: str,
                          ids_name: str = "segment_ids") -> None:
    """Raises ValueError naming ``name`` when explicit ``positions`` ([T] or [B, T]) do not
    restart at 0 where ``segment_ids`` [B, T] change along a row, i.e. contradict the documents.
    Only when both are known at trace time; traced values are used as given (attention still
    never crosses segments, but the encodings see the given positions).
    """
    pos, ids = _concrete(positions), _concrete(segment_ids)
    if pos is None or ids is None or ids.size == 0:
        return
    pos = np.broadcast_to(pos, ids.shape)
    starts = np.zeros(ids.shape, bool)
    starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
    bad = starts & (pos != 0)
    if bad.any():
        row, col = (int(v[0]) for v in np.nonzero(bad))
        raise ValueError(
            f"{name} contradicts {ids_name}: row {row} starts a new segment at index {col} but its "
            f"position there is {int(pos[row, col])}, not 0. Pass positions that restart at each "
            f"document (goat_jax.prior.segments.segment_positions({ids_name})), or omit {name} and the "
            "layer derives them.")
