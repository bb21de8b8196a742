"""Decoding against a KV cache sharded over the ``context`` mesh axis: the split-K merge.

A million-token cache does not fit one device; with ``mesh.context = c`` each device holds S / c
of its slots. One decode step (or a chunk of T queries, as a prefill in chunks or the chunked
evaluation runs) then needs no all-gather of keys (docs/training.md, "Decoding with a
sharded cache"):

1. The queries ``q`` [B, T, N, D] are replicated over ``context``; the cache ``k`` [B, S, K, D],
   ``v`` [B, S, K, Dv] is split over ``context`` on S.
2. Each shard scores its own slots in float32 (GOAT's packed q/k: the prior lanes are part of
   the dot product, so nothing else is needed), masks every slot whose *global* position is at
   or past ``kv_length`` (unwritten) or past the query's own global position (causal: a chunk
   of several queries sees a growing prefix), and returns the unnormalized partial softmax:
   ``m`` the row max, ``l = sum exp(s - m)``, ``o = exp(s - m) @ V`` (:func:`partial_attention`).
3. ``m_g = pmax(m)``; ``out = psum(exp(m - m_g) * o) / psum(exp(m - m_g) * l)``
   (:func:`merge_partials`): three collectives of sizes [B, N, T], [B, N, T, Dv], [B, N, T].
4. The shard that owns a new position writes its K/V (:func:`write_cache`); the others keep theirs.

Traps handled: a shard with no valid slot (a mostly empty cache: every shard past the length)
has ``m = -inf`` and ``l = o = 0``; it gets weight 0 in the merge (never ``exp(-inf - -inf)``,
NaN). A query with no valid key anywhere (``kv_length`` 0) returns zeros, as the ring's rows that
see no key. ``m``, ``l`` and ``o`` stay float32 whatever the inputs' dtype. Grouped queries
(GQA: K divides N, query head ``h`` reads KV head ``h // (N / K)``) and MQA (K = 1) read the
cache without repeating it.

Layouts of the slots over the shards (``layout``): ``'contiguous'`` (shard j holds slots
[j S/c, (j + 1) S/c), as context parallelism splits a training sequence) or ``'interleaved'``
(slot s on shard s mod c). The merge is the same (softmax does not care about order); which
one a partly filled cache should use is argued, with measurements, in docs/training.md.
"""

from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp
from jax import lax

from goat_jax.kernels import mesh as mesh_lib

Array = jax.Array

LAYOUTS = ("contiguous", "interleaved")


def slot_positions(slots: int, shards: int, shard: Any, layout: str = "contiguous") -> Array:
    """The global positions [slots] of the cache slots shard ``shard`` (an int or a traced
    ``axis_index``) of ``shards`` holds, ``slots`` per shard, under ``layout`` (module doc)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}.")
    local = jnp.arange(slots, dtype=jnp.int32)
    if layout == "contiguous":
        return shard * slots + local
    return shard + shards * local


def partial_attention(q: Array, k: Array, v: Array, q_positions: Array, key_positions: Array,
                      kv_length: Array, *, scale: float) -> tuple[Array, Array, Array]:
    """One shard's unnormalized attention over its slots (step 2 of the module doc).

    Args:
      q: [B, T, N, D] queries (GOAT: packed, prior lanes included).
      k: [B, S, K, D] this shard's cache keys; K divides N (K = N: MHA; 1: MQA).
      v: [B, S, K, Dv] this shard's cache values.
      q_positions: [B, T] int, the queries' global positions.
      key_positions: [S] int, the global position of each of this shard's slots.
      kv_length: [B] int, how many positions of each row are written (slots at or past it are
        masked, whatever they hold).
      scale: the logits' factor (the layer's; GOAT's is for the content lanes, so it is never
        guessed from D here).

    Returns:
      ``(o [B, T, N, Dv], m [B, T, N], l [B, T, N])``, all float32: ``m`` the max logit over the
      visible slots (-inf where none is), ``l`` the sum of ``exp(logit - m)``, ``o`` the
      ``exp(logit - m)``-weighted sum of the values (both 0 where no slot is visible).
    """
    b, t, n, d = q.shape
    kh = k.shape[2]
    if k.ndim != 4 or v.ndim != 4 or k.shape[:3] != v.shape[:3] or k.shape[0] != b or k.shape[3] != d:
        raise ValueError(f"k must be [B, S, K, {d}] and v [B, S, K, Dv] with q [B, T, N, D] = {q.shape}; "
                         f"got k {k.shape}, v {v.shape}.")
    if n % kh:
        raise ValueError(f"the key/value heads ({kh}) must divide the query heads ({n}).")
    g = n // kh
    precision = lax.Precision.HIGHEST
    qg = q.reshape(b, t, kh, g, d)
    s = jnp.einsum("btkgd,bskd->btkgs", qg, k, precision=precision,
                   preferred_element_type=jnp.float32) * jnp.float32(scale)  # [B, T, K, G, S]
    kp = key_positions.astype(jnp.int32)[None, None, :]  # [1, 1, S]
    visible = (kp < kv_length.astype(jnp.int32)[:, None, None]) & (kp <= q_positions.astype(jnp.int32)[:, :, None])
    visible = visible[:, :, None, None, :]  # [B, T, 1, 1, S]
    s = jnp.where(visible, s, -jnp.inf)
    m = jnp.max(s, axis=-1)  # [B, T, K, G]; -inf where no slot is visible
    p = jnp.where(visible, jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0)[..., None]), 0.0)
    l = jnp.sum(p, axis=-1)
    o = jnp.einsum("btkgs,bskv->btkgv", p, v.astype(jnp.float32), precision=precision)
    return o.reshape(b, t, n, v.shape[-1]), m.reshape(b, t, n), l.reshape(b, t, n)


def merge_partials(o: Array, m: Array, l: Array, axis: Optional[str]) -> Array:
    """The attention output [B, T, N, Dv] float32 of the shards' partials (step 3 of the module
    doc), inside a ``shard_map`` over ``axis`` (None: one shard, no collective). Shards with
    ``m = -inf`` weigh 0; rows whose every shard has ``m = -inf`` are zeros."""
    m_g = m if axis is None else lax.pmax(m, axis)
    finite = jnp.isfinite(m_g)
    w = jnp.where(jnp.isfinite(m), jnp.exp(m - jnp.where(finite, m_g, 0.0)), 0.0)
    num, den = w[..., None] * o, w * l
    if axis is not None:
        num, den = lax.psum(num, axis), lax.psum(den, axis)
    return num / jnp.where(den > 0, den, 1.0)[..., None]


def _check(q, k, v, q_positions, kv_length, c, layout):
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"q, k and v must be [B, T, N, D], [B, S, K, D], [B, S, K, Dv]; got {q.shape}, {k.shape}, "
                         f"{v.shape}.")
    if q_positions.shape != q.shape[:2]:
        raise ValueError(f"q_positions must be [B, T] = {q.shape[:2]}, got {q_positions.shape}.")
    if kv_length.shape != q.shape[:1]:
        raise ValueError(f"kv_length must be [B] = {q.shape[:1]}, got {kv_length.shape}.")
    if k.shape[1] % c:
        raise ValueError(f"the cache's {k.shape[1]} slots must split evenly over mesh.context={c} shards; "
                         f"size the cache to a multiple of {c}.")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}.")


def decode_attention(q: Array, k: Array, v: Array, *, q_positions: Array, kv_length: Array, scale: float,
                     mesh: Any = None, axis: str = mesh_lib.CONTEXT_AXIS, layout: str = "contiguous") -> Array:
    """Attention of a chunk of queries against a KV cache split over ``mesh``'s ``axis``
    (module doc; one shard, no collective, when the mesh has no such axis of size > 1).

    Args:
      q: [B, T, N, D] the new queries (T = 1 for one decode step), replicated over ``axis``.
      k: [B, S, K, D] the whole cache's keys as a global array, split over ``axis`` on S by
        ``layout`` (``'interleaved'``: global slot order is shard-major, i.e. the array's slot
        ``j * S/c + i`` holds position ``j + c * i``; see :func:`slot_positions`).
      v: [B, S, K, Dv] the cache's values, laid out as ``k``.
      q_positions: [B, T] int, the queries' global positions.
      kv_length: [B] int, the positions written so far (including this chunk's, once written:
        the causal mask keeps each query from the chunk's later keys).
      scale: the logits' factor.
      mesh: the device mesh (default: the abstract mesh in context).
      axis: the mesh axis the slots are split over.
      layout: ``'contiguous'`` or ``'interleaved'`` (module doc).

    Returns:
      [B, T, N, Dv] in ``q``'s dtype, replicated over ``axis``; zeros for a query that sees no
      key. The batch and heads are split over the other mesh axes as the attention kernels split
      them (:func:`goat_jax.kernels.mesh.partition`).
    """
    mesh = mesh_lib.ambient_mesh() if mesh is None else mesh
    c = mesh_lib.context_shards(mesh, axis)
    q_positions, kv_length = jnp.asarray(q_positions), jnp.asarray(kv_length)
    _check(q, k, v, q_positions, kv_length, c, layout)
    slots = k.shape[1] // c
    if c == 1:
        o, m, l = partial_attention(q, k, v, q_positions, jnp.arange(slots, dtype=jnp.int32), kv_length,
                                    scale=scale)
        return merge_partials(o, m, l, None).astype(q.dtype)
    b, _, n, _ = q.shape
    specs = mesh_lib.partition(mesh, b, n, k.shape[2], axis)
    whole, split = specs.specs(length=None), specs.specs(length=axis)

    def shard(q_, k_, v_, qp_, kl_):
        keys = slot_positions(slots, c, lax.axis_index(axis), layout)
        o, m, l = partial_attention(q_, k_, v_, qp_, keys, kl_, scale=scale)
        return merge_partials(o, m, l, axis).astype(q_.dtype)

    return jax.shard_map(shard, mesh=specs.mesh, in_specs=(whole.q, split.kv, split.kv, whole.rows, whole.batch),
                         out_specs=whole.q, check_vma=False)(q, k, v, q_positions, kv_length)


def write_cache(k_cache: Array, v_cache: Array, k_new: Array, v_new: Array, start: Array, *, mesh: Any = None,
                axis: str = mesh_lib.CONTEXT_AXIS, layout: str = "contiguous") -> tuple[Array, Array]:
    """Writes ``k_new``/``v_new`` [B, T, K, D*] at global positions ``start .. start + T - 1``
    (``start`` an int32 scalar, traced or not: the cache index every row shares) into the cache
    ``k_cache``/``v_cache`` [B, S, K, D*] split over ``axis`` by ``layout`` (step 4 of the
    module doc): each shard writes the positions it owns and nothing moves between shards.
    Positions at or past S are dropped (the caller sizes the cache). Returns the new caches,
    sharded as they came."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}.")
    mesh = mesh_lib.ambient_mesh() if mesh is None else mesh
    c = mesh_lib.context_shards(mesh, axis)
    s, t = k_cache.shape[1], k_new.shape[1]
    if s % c:
        raise ValueError(f"the cache's {s} slots must split evenly over mesh.context={c} shards.")
    slots = s // c
    start = jnp.asarray(start, jnp.int32)

    def local(kc, vc, kn, vn, shard):
        pos = start + jnp.arange(t, dtype=jnp.int32)
        if layout == "contiguous":
            idx, mine = pos - shard * slots, (pos >= shard * slots) & (pos < (shard + 1) * slots)
        else:
            idx, mine = pos // c, pos % c == shard
        idx = jnp.where(mine & (pos < s), idx, slots)  # out of range: dropped
        put = lambda cache, new: cache.at[:, idx].set(new.astype(cache.dtype), mode="drop")
        return put(kc, kn), put(vc, vn)

    if c == 1:
        return local(k_cache, v_cache, k_new, v_new, 0)
    b, kh = k_cache.shape[0], k_cache.shape[2]
    specs = mesh_lib.partition(mesh, b, kh, kh, axis)
    whole, split = specs.specs(length=None), specs.specs(length=axis)
    fn = lambda kc, vc, kn, vn: local(kc, vc, kn, vn, lax.axis_index(axis))
    return jax.shard_map(fn, mesh=specs.mesh, in_specs=(split.kv, split.kv, whole.kv, whole.kv),
                         out_specs=(split.kv, split.kv), check_vma=False)(k_cache, v_cache, k_new, v_new)
