"""Sequence order under context parallelism: the load-balanced (dual-chunk-swap) order, its
inverse, and the length rules of splitting a sequence over the ``context`` mesh axis
(docs/training.md, Long context).

Load balancing (``config.context_load_balance``). Under a causal mask the last shard's queries
see all keys and the first shard's only its own, so the last shard works about ``2c - 1`` times
as long as the first. The *dual-chunk-swap* order (:func:`balance_order`; also called zigzag)
cuts the sequence into 2c chunks and gives shard ``i`` chunks ``i`` and ``2c - 1 - i``: every
shard then does the same work. It is chosen over the *striped* order (token ``t`` to shard
``t mod c``) because each shard keeps two contiguous runs of positions, so every kernel keeps
its contract -- a causal mask with an offset, per chunk -- with its block skipping (flash) and
static masks (splash); striped rows would need a strided mask no kernel here has. The engine
reorders every ``[B, T]`` array of a batch once, before the model (:func:`balance_batch`: tokens,
targets, weights, segment ids and the positions, which the batch then carries explicitly);
inside attention the gathered keys are put back in sequence order (:func:`natural_order`) and
each of a shard's two chunks attends with its own offset. The loss is a sum over tokens, so the
result equals the unbalanced run.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Dict, Optional

import jax
import jax.numpy as jnp
import numpy as np

from goat_jax.kernels.capabilities import CAPABILITIES

Array = jax.Array

BALANCE_FIELD = "context_load_balance"  # the config field (top level) that turns balancing on
STRATEGY_FIELD = "context_strategy"  # the config field (top level): how attention crosses the shards


def _static_masks(implementation: Optional[str]) -> bool:
    """Whether kernel ``implementation`` builds its masks statically (splash): every chunk a
    context shard attends must then be whole blocks."""
    row = CAPABILITIES.get(implementation) if implementation is not None else None
    return row is not None and row.static_masks


def length_multiple(num_shards: int, balanced: bool, implementation: Optional[str] = None) -> int:
    """What a sequence length must be a multiple of to run over ``num_shards`` context shards:
    the shards (twice as many chunks when ``balanced``), times splash's 128-token blocks when the
    kernel is splash (every chunk a shard attends must be whole blocks)."""
    if num_shards <= 1:
        return 1
    chunks = num_shards * (2 if balanced else 1)
    if _static_masks(implementation):
        chunks *= CAPABILITIES[implementation].length_multiple
    return chunks


def check_length(length: int, num_shards: int, balanced: bool, implementation: Optional[str] = None,
                 field: str = "seq_len") -> None:
    """Raises ValueError naming ``field`` and the fix when ``length`` cannot be split over
    ``num_shards`` context shards (:func:`length_multiple`)."""
    multiple = length_multiple(num_shards, balanced, implementation)
    if length % multiple:
        parts = [f"mesh.context={num_shards}"]
        if balanced:
            parts.append(f"2 chunks per shard ({BALANCE_FIELD}=True)")
        if _static_masks(implementation):
            parts.append(f"{implementation}'s {CAPABILITIES[implementation].length_multiple}-token blocks per chunk")
        below, above = length // multiple * multiple, -(-length // multiple) * multiple
        choices = f"{below} or {above}" if below else f"{above}"
        raise ValueError(
            f"{field}={length} cannot be split over the context axis: it must be a multiple of "
            f"{multiple} ({' x '.join(parts)}). Make it {choices}, or change mesh.context.")


def balance_order(length: int, num_shards: int) -> np.ndarray:
    """The dual-chunk-swap order of ``length`` tokens over ``num_shards`` shards: [length] int32,
    the sequence index at each place. Chunk ``i`` and chunk ``2c - 1 - i`` (each ``length / 2c``
    tokens) go to shard ``i``; the identity for one shard."""
    check_length(length, num_shards, True, field="length")
    if num_shards <= 1:
        return np.arange(length, dtype=np.int32)
    m = length // (2 * num_shards)
    chunks = [c for i in range(num_shards) for c in (i, 2 * num_shards - 1 - i)]
    return np.concatenate([np.arange(c * m, (c + 1) * m) for c in chunks]).astype(np.int32)


def natural_order(x: Array, num_shards: int, axis: int) -> Array:
    """Undoes :func:`balance_order` along ``axis`` of a gathered array (slices and one concat:
    shard ``i``'s first chunk is chunk ``i``, its second chunk ``2c - 1 - i``)."""
    axis = axis % x.ndim
    length = x.shape[axis]
    m = length // (2 * num_shards)
    split = x.reshape(x.shape[:axis] + (num_shards, 2, m) + x.shape[axis + 1:])
    first = jax.lax.index_in_dim(split, 0, axis + 1, keepdims=False)  # chunks 0 .. c-1
    second = jnp.flip(jax.lax.index_in_dim(split, 1, axis + 1, keepdims=False), axis)  # c .. 2c-1
    return jnp.concatenate([first, second], axis=axis).reshape(x.shape)


def balance_batch(batch: Dict[str, Any], seq_len: int, num_shards: int) -> Dict[str, Any]:
    """The batch in :func:`balance_order`: every array of rank >= 2 whose axis 1 has ``seq_len``
    entries is reordered along it (tokens, targets, weights, segment ids, positions), and
    ``positions`` ([B, T] int32, the sequence index of each place) is added when the batch has
    none, so that the model sees the positions of the unbalanced run. A batch with
    ``segment_ids`` must carry its own ``positions`` (each document's, made before reordering:
    they cannot be recovered from reordered ids). The identity for one shard."""
    if num_shards <= 1:
        return batch
    if "segment_ids" in batch and "positions" not in batch:
        raise ValueError(
            f"{BALANCE_FIELD}=True with segment_ids needs the batch's 'positions' (each document's, "
            "computed before the reordering); packed-document batches of goat_jax.data carry them.")
    order = balance_order(seq_len, num_shards)
    out = {}
    for key, value in batch.items():
        if getattr(value, "ndim", 0) >= 2 and value.shape[1] == seq_len:
            value = jnp.take(value, order, axis=1)
        out[key] = value
    if "positions" not in out:
        first = next(iter(batch.values()))
        out["positions"] = jnp.broadcast_to(jnp.asarray(order), (first.shape[0], seq_len))
    return out


def balanced_step(step: Callable[..., Any], seq_len: int, num_shards: int) -> Callable[..., Any]:
    """``step(first, batch)`` (a train or eval step) run on the batch in :func:`balance_order`
    (:func:`balance_batch`); the model's attention plan says the order (``load_balanced``,
    :meth:`goat_jax.kernels.plan.AttentionPlan.from_config` reads it from the same config field)."""
    @functools.wraps(step)
    def wrapped(first, batch):
        return step(first, balance_batch(batch, seq_len, num_shards))
    return wrapped


def context_step(step: Callable[..., Any], config: Any, mesh: Any, plan: Any) -> Callable[..., Any]:
    """``step`` (a train or eval step) on the batch in load-balanced order
    (:func:`balanced_step`) when the run's ``plan`` (a :class:`goat_jax.kernels.plan.AttentionPlan`) is
    balanced and ``mesh``'s context axis has more than one device; else ``step`` itself. The
    model carries the same plan (its task builds it from the same config), so its attention
    expects that order."""
    num_shards = dict(mesh.shape).get(plan.context_axis, 1)
    if num_shards <= 1 or not plan.load_balanced:
        return step
    return balanced_step(step, int(config.seq_len), num_shards)
