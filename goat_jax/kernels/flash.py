"""Memory-efficient ("flash") attention in pure JAX: never materializes T x S on any backend.

``implementation='flash'`` in :mod:`goat_jax.kernels` (:func:`attention`). The math is FlashAttention-2
(Dao, 2023) written with ``lax`` loops:

* Forward: for each query block, an online softmax over key blocks keeps a running row max
  ``m``, row sum ``l`` and unnormalized output ``acc`` (float32), so only one
  ``[B, K, G, block_q, block_k]`` logits tile is alive at a time. It saves the output and the
  row log-sum-exp ``lse = m + log l`` ([B, K, G, T], float32) for the backward pass.
* Backward (``jax.custom_vjp``): for each key block, loop over the query blocks that see it,
  recompute ``p = exp(s - lse)`` from the saved ``lse`` and accumulate
  ``dv += p^T do``, ``dk += ds^T q``, ``dq += ds k`` with ``ds = p (do v^T - rowsum(do o))``.
  Memory is linear in T and S (the tiles, dq in float32, and the inputs).
* Causal block skipping: the loops run only over the key blocks a query block can see
  (``lax.fori_loop`` with a per-block trip count), so fully masked blocks cost nothing; this
  also works with a traced ``causal_offset`` (a KV-cache index) since the trip counts may be
  dynamic (the backward is hand-written, so the loops need no reverse-mode autodiff).
* Segment ids (document-aware packing, the masking contract of :mod:`goat_jax.kernels.mask`): each tile
  masks pairs of different ids, and a tile is skipped when the ``[min, max]`` id ranges of its
  query block and of its key block's unmasked keys are disjoint in every example it holds.
  The loops run over the key (query) blocks between the first and the last one that can meet
  a query (key) block, so with non-decreasing ids (packed documents) only the tiles on the
  block diagonal of the documents are visited; with any other ids the result is the same,
  only fewer tiles are skipped. One tile holds every example, so on a single device the
  examples run one after another (``per_example``), each visiting only its own tiles;
  otherwise (the batch may be sharded over devices) they run together and visit the union of
  their tiles.
* Rows with no visible key (every key masked) output zeros and pass zero gradient.

Dtypes: any float input; matmuls accumulate in float32 (``preferred_element_type``), the
softmax statistics are float32, and float32 inputs use ``Precision.HIGHEST`` so a GPU does not
silently drop to TF32. The output has v's dtype.

Shape legend: B batch, T queries, S keys, N query heads, K kv heads, G = N / K query heads per
kv head (GQA/MQA), Hqk q/k head dim, Hv value head dim (may differ from Hqk: GOAT packs extra
q/k channels), Q / C query / key block lengths, nq / nk numbers of blocks.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax import lax

from goat_jax.kernels import capabilities as caps
from goat_jax.kernels.mask import AttentionMask

Array = jax.Array

# Chosen on CPU from short forward+backward runs (float32, 8 heads, H 64, causal, L 1024 and
# 4096): 512 x 512 forward tiles amortize the loop overhead and keep the matmuls BLAS-sized; the
# backward (5 matmuls per tile) ran 1.3 s with 512 x 256 tiles vs 1.9 s with 512 x 512 at 4096;
# 256- and 1024-tiles were no faster. Re-tune per backend with the block arguments.
DEFAULT_BLOCK_Q = 512
DEFAULT_BLOCK_K = 512
DEFAULT_BWD_BLOCK_Q = 512
DEFAULT_BWD_BLOCK_K = 256


class Config(NamedTuple):
    """Static (hashable) parameters of one call."""

    scale: float
    is_causal: bool
    t: int  # real query length (before padding to whole blocks)
    bq: int
    bk: int
    bwd_bq: int
    bwd_bk: int
    precision: Any
    keep_f32: bool = False  # return the output and gradients in float32 (ring attention sums them)


def _block(length: int, requested: int) -> int:
    """Block length: the request, or the sequence rounded up to a multiple of 8 if shorter."""
    if requested < 1:
        raise ValueError(f"flash attention block sizes must be >= 1, got {requested}.")
    return min(requested, -(-length // 8) * 8)


def _dot(a: Array, b: Array, dims: str, precision) -> Array:
    """``einsum(dims, a, b)`` accumulated in float32."""
    return jnp.einsum(dims, a, b, preferred_element_type=jnp.float32, precision=precision)


class _Segments(NamedTuple):
    """Segment ids padded to whole blocks and the block ranges the loops visit."""

    q: Array  # [B, Tp] int32
    kv: Array  # [B, Sp] int32
    fwd_lo: Array  # [nq] first key block (forward blocks) a query block can meet
    fwd_hi: Array  # [nq] one past the last such key block
    bwd_lo: Array  # [nk] first query block (backward blocks) a key block can meet
    bwd_hi: Array  # [nk] one past the last


def _block_ranges(ids: Array, keep: Optional[Array], block: int):
    """Per-block [B, n] min and max of ``ids`` [B, L] over the kept positions (an empty block
    gets min > max, so it meets nothing)."""
    b, length = ids.shape
    info = jnp.iinfo(jnp.int32)
    keep = jnp.ones_like(ids, bool) if keep is None else jnp.broadcast_to(keep, ids.shape)
    blocks = ids.reshape(b, length // block, block)
    kept = keep.reshape(b, length // block, block)
    return (jnp.where(kept, blocks, info.max).min(-1), jnp.where(kept, blocks, info.min).max(-1))


def _meet_bounds(q_ids: Array, kv_ids: Array, valid: Optional[Array], bq: int, bk: int):
    """(lo, hi) of key blocks per query block and (lo, hi) of query blocks per key block:
    the first and one-past-last blocks whose id ranges overlap in some row of the batch."""
    q_min, q_max = _block_ranges(q_ids, None, bq)  # [B, nq]
    k_min, k_max = _block_ranges(kv_ids, valid, bk)  # [B, nk]
    meet = ((q_min[:, :, None] <= k_max[:, None, :]) & (k_min[:, None, :] <= q_max[:, :, None])).any(0)

    def bounds(m):  # m [rows, cols] -> first and one past the last True column per row
        cols = m.shape[1]
        any_ = m.any(-1)
        lo = jnp.argmax(m, axis=-1)
        hi = cols - jnp.argmax(m[:, ::-1], axis=-1)
        return jnp.where(any_, lo, 0).astype(jnp.int32), jnp.where(any_, hi, 0).astype(jnp.int32)

    return bounds(meet), bounds(meet.T)


def block_segments(q_ids: Array, kv_ids: Array, valid: Optional[Array], bq: int, bk: int,
                   bwd_bq: int, bwd_bk: int) -> _Segments:
    """The segment bounds (:class:`_Segments`) of block-padded ids for both passes' block sizes:
    what :func:`block_forward` / :func:`block_backward` take as ``seg`` (ring attention computes
    them per block pair)."""
    (fwd_lo, fwd_hi), _ = _meet_bounds(q_ids, kv_ids, valid, bq, bk)
    _, (bwd_lo, bwd_hi) = _meet_bounds(q_ids, kv_ids, valid, bwd_bq, bwd_bk)
    return _Segments(q_ids, kv_ids, fwd_lo, fwd_hi, bwd_lo, bwd_hi)


def _tile_mask(causal: bool, valid: Optional[Array], offset: Array, q0, k0, bq: int, bk: int,
               seg: Optional[_Segments] = None):
    """Boolean [B or 1, 1, 1, Q, C] of visible (query, key) pairs in the tile at (q0, k0), or
    None when every pair is visible (``causal`` False: the tile is below the diagonal)."""
    mask = None
    if seg is not None:
        qs = lax.dynamic_slice_in_dim(seg.q, q0, bq, axis=1)  # [B, Q]
        ks = lax.dynamic_slice_in_dim(seg.kv, k0, bk, axis=1)  # [B, C]
        mask = (qs[:, :, None] == ks[:, None, :])[:, None, None]
    if causal:
        i = q0 + lax.broadcasted_iota(jnp.int32, (bq, bk), 0)
        j = k0 + lax.broadcasted_iota(jnp.int32, (bq, bk), 1)
        causal_mask = (j <= i + offset)[None, None, None]
        mask = causal_mask if mask is None else mask & causal_mask
    if valid is not None:
        keep = lax.dynamic_slice_in_dim(valid, k0, bk, axis=1)[:, None, None, None, :]  # [B,1,1,1,C]
        mask = keep if mask is None else mask & keep
    return mask


def _kv_blocks_seen(cfg: Config, offset: Array, q0, bq: int, bk: int, nk: int):
    """Number of key blocks (from block 0) that query rows [q0, q0 + Q) can see."""
    if not cfg.is_causal:
        return nk
    last_row = jnp.minimum(q0 + bq, cfg.t) - 1  # padded query rows need no keys
    return jnp.clip((last_row + offset) // bk + 1, 0, nk)


def _kv_blocks_full(cfg: Config, offset: Array, q0, bk: int, seen):
    """Number of key blocks (from block 0, at most ``seen``) that *every* row from q0 sees: they
    need no causal mask."""
    if not cfg.is_causal:
        return seen
    return jnp.clip((q0 + offset + 1) // bk, 0, seen)


def _q_block_range(cfg: Config, offset: Array, k0, bq: int, bk: int, nq: int):
    """(first query block with a row that sees key k0, first query block whose rows all see
    keys [k0, k0 + C)): the blocks in between need the causal mask."""
    if not cfg.is_causal:
        return 0, 0
    first = jnp.clip((k0 - offset) // bq, 0, nq)
    full = jnp.clip(-(-(k0 + bk - 1 - offset) // bq), first, nq)
    return first, full


def block_forward(cfg: Config, q: Array, k: Array, v: Array, valid: Optional[Array], offset: Array,
                  seg: Optional[_Segments] = None):
    """The online-softmax forward over whole blocks, with its log-sum-exp (what a ring step
    merges, goat_jax/kernels/ring.py): q [B, K, G, Tp, Hqk], k [B, K, Sp, Hqk], v [B, K, Sp, Hv]
    (Tp, Sp whole blocks), ``valid`` [B or 1, Sp] the keys not padded, ``offset`` the causal one.
    Returns (out [B, K, G, Tp, Hv] in v.dtype, lse [B, K, G, Tp] float32)."""
    b, kh, g, tp, _ = q.shape
    sp, hv = k.shape[2], v.shape[-1]
    bq, bk = cfg.bq, cfg.bk
    nq, nk = tp // bq, sp // bk
    q_blocks = jnp.moveaxis(q.reshape(b, kh, g, nq, bq, -1), 3, 0)  # [nq, B, K, G, Q, Hqk]

    def one_query_block(_, xs):
        qi, iq = xs
        q0 = iq * bq

        def step(causal, jk, carry):
            m, l, acc = carry
            k0 = jk * bk
            kj = lax.dynamic_slice_in_dim(k, k0, bk, axis=2)  # [B, K, C, Hqk]
            vj = lax.dynamic_slice_in_dim(v, k0, bk, axis=2)  # [B, K, C, Hv]
            s = _dot(qi, kj, "bkgqh,bkch->bkgqc", cfg.precision) * cfg.scale  # [B, K, G, Q, C]
            mask = _tile_mask(causal, valid, offset, q0, k0, bq, bk, seg)
            if mask is not None:
                s = jnp.where(mask, s, -jnp.inf)
            m_new = jnp.maximum(m, s.max(-1))
            m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # rows with nothing visible yet
            p = jnp.exp(s - m_safe[..., None])
            alpha = jnp.exp(m - m_safe)
            l = alpha * l + p.sum(-1)
            acc = alpha[..., None] * acc + _dot(p.astype(v.dtype), vj, "bkgqc,bkch->bkgqh", cfg.precision)
            return m_new, l, acc

        init = (jnp.full((b, kh, g, bq), -jnp.inf, jnp.float32), jnp.zeros((b, kh, g, bq), jnp.float32),
                jnp.zeros((b, kh, g, bq, hv), jnp.float32))
        start, seen = 0, _kv_blocks_seen(cfg, offset, q0, bq, bk, nk)
        full = _kv_blocks_full(cfg, offset, q0, bk, seen)
        if seg is not None:  # only the key blocks whose ids can meet this block's
            start, seen = seg.fwd_lo[iq], jnp.minimum(seen, seg.fwd_hi[iq])
            full = jnp.clip(full, start, jnp.maximum(start, seen))
        # Blocks below the diagonal skip the causal mask; blocks above it are never visited.
        carry = lax.fori_loop(start, full, functools.partial(step, False), init)
        m, l, acc = lax.fori_loop(full, seen, functools.partial(step, cfg.is_causal), carry)
        seen = l > 0  # False: every key of the row is masked -> zero output, zero gradient
        out = jnp.where(seen[..., None], acc / jnp.where(seen, l, 1.0)[..., None], 0.0)
        lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), jnp.inf)
        return None, (out.astype(jnp.float32 if cfg.keep_f32 else v.dtype), lse)

    _, (out, lse) = lax.scan(one_query_block, None, (q_blocks, jnp.arange(nq)))
    out = jnp.moveaxis(out, 0, 3).reshape(b, kh, g, tp, hv)
    lse = jnp.moveaxis(lse, 0, 3).reshape(b, kh, g, tp)
    return out, lse


def block_backward(cfg: Config, q, k, v, valid, offset, out, lse, do, seg=None):
    """The recomputing backward over whole blocks, driven by a given log-sum-exp ``lse`` (the
    global one, under ring attention): gradients (dq, dk, dv) in the input dtypes; see the module
    docstring for the math."""
    b, kh, g, tp, hqk = q.shape
    sp, hv = k.shape[2], v.shape[-1]
    bq, bk = cfg.bwd_bq, cfg.bwd_bk
    nq, nk = tp // bq, sp // bk
    # D_i = rowsum(do * o): the softmax-Jacobian term, one float per query row.
    delta = jnp.sum(do.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)  # [B, K, G, Tp]
    # lse = +inf marks rows with no visible key: exp(s - inf) = 0 keeps their gradient zero.
    k_blocks = jnp.moveaxis(k.reshape(b, kh, nk, bk, hqk), 2, 0)  # [nk, B, K, C, Hqk]
    v_blocks = jnp.moveaxis(v.reshape(b, kh, nk, bk, hv), 2, 0)  # [nk, B, K, C, Hv]

    def one_key_block(dq, xs):
        kj, vj, jk = xs
        k0 = jk * bk

        def step(causal, iq, carry):
            dk, dv, dq = carry
            q0 = iq * bq
            qi = lax.dynamic_slice_in_dim(q, q0, bq, axis=3)  # [B, K, G, Q, Hqk]
            doi = lax.dynamic_slice_in_dim(do, q0, bq, axis=3)  # [B, K, G, Q, Hv]
            lse_i = lax.dynamic_slice_in_dim(lse, q0, bq, axis=3)  # [B, K, G, Q]
            d_i = lax.dynamic_slice_in_dim(delta, q0, bq, axis=3)
            s = _dot(qi, kj, "bkgqh,bkch->bkgqc", cfg.precision) * cfg.scale
            mask = _tile_mask(causal, valid, offset, q0, k0, bq, bk, seg)
            p = jnp.exp(s - lse_i[..., None])  # [B, K, G, Q, C]
            if mask is not None:
                p = jnp.where(mask, p, 0.0)
            dv = dv + _dot(p.astype(do.dtype), doi, "bkgqc,bkgqh->bkch", cfg.precision)
            dp = _dot(doi, vj, "bkgqh,bkch->bkgqc", cfg.precision)
            ds = p * (dp - d_i[..., None]) * cfg.scale
            dk = dk + _dot(ds.astype(q.dtype), qi, "bkgqc,bkgqh->bkch", cfg.precision)
            dq_i = lax.dynamic_slice_in_dim(dq, q0, bq, axis=3)
            dq_i = dq_i + _dot(ds.astype(k.dtype), kj, "bkgqc,bkch->bkgqh", cfg.precision)
            dq = lax.dynamic_update_slice_in_dim(dq, dq_i, q0, axis=3)
            return dk, dv, dq

        init = (jnp.zeros((b, kh, bk, hqk), jnp.float32), jnp.zeros((b, kh, bk, hv), jnp.float32), dq)
        first, full = _q_block_range(cfg, offset, k0, bq, bk, nq)
        last = nq
        if seg is not None:  # only the query blocks whose ids can meet this block's
            first, last = jnp.maximum(first, seg.bwd_lo[jk]), seg.bwd_hi[jk]
            full = jnp.clip(full, first, jnp.maximum(first, last))
        carry = lax.fori_loop(first, full, functools.partial(step, cfg.is_causal), init)
        dk, dv, dq = lax.fori_loop(full, last, functools.partial(step, False), carry)
        if cfg.keep_f32:
            return dq, (dk, dv)
        return dq, (dk.astype(k.dtype), dv.astype(v.dtype))

    dq0 = jnp.zeros((b, kh, g, tp, hqk), jnp.float32)
    dq, (dk, dv) = lax.scan(one_key_block, dq0, (k_blocks, v_blocks, jnp.arange(nk)))
    dk = jnp.moveaxis(dk, 0, 2).reshape(b, kh, sp, hqk)
    dv = jnp.moveaxis(dv, 0, 2).reshape(b, kh, sp, hv)
    return (dq if cfg.keep_f32 else dq.astype(q.dtype)), dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(cfg: Config, q, k, v, valid, offset, seg):
    return block_forward(cfg, q, k, v, valid, offset, seg)[0]


def _flash_fwd(cfg, q, k, v, valid, offset, seg):
    out, lse = block_forward(cfg, q, k, v, valid, offset, seg)
    return out, (q, k, v, valid, offset, seg, out, lse)


def _flash_bwd(cfg, res, do):
    q, k, v, valid, offset, seg, out, lse = res
    dq, dk, dv = block_backward(cfg, q, k, v, valid, offset, out, lse, do, seg)
    return dq, dk, dv, None, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def _pad_to(x: Array, length: int, axis: int) -> Array:
    pad = length - x.shape[axis]
    if pad == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths)


def flash_attention(
    q: Array,
    k: Array,
    v: Array,
    *,
    scale: float = 1.0,
    mask: Optional[AttentionMask] = None,
    per_example: Optional[bool] = None,
    block_q: int = DEFAULT_BLOCK_Q,
    block_k: int = DEFAULT_BLOCK_K,
    bwd_block_q: int = DEFAULT_BWD_BLOCK_Q,
    bwd_block_k: int = DEFAULT_BWD_BLOCK_K,
) -> Array:
    """``softmax(scale * q . k + mask) v`` in O(T + S) memory, differentiable (custom VJP).

    Args:
      q: [B, T, N, Hqk]; k: [B, S, K, Hqk]; v: [B, S, K, Hv], N % K == 0 (GQA/MQA).
      scale: logit scale (GOAT's packed q/k run at 1).
      mask: the :class:`goat_jax.kernels.mask.AttentionMask` (None: every key visible); its
        causal offset may be traced. With segment ids, tiles whose id ranges cannot meet are
        skipped (module doc). A window is not taken (the capability table refuses it).
      per_example: with segment ids and B > 1, run the examples one after another
        (``lax.map``), each skipping its own tiles, instead of all at once over the union of
        their tiles: rows packed differently share few skippable tiles (on the CPU, 4 packed
        Jargon rows of 2048 tokens: the union ran as slow as no segments, per example 0.71x
        of it). But a loop over a batch sharded over devices makes XLA all-gather the batch
        (every device would compute every example), so None (default) means True only when
        JAX has a single device.
      block_q, block_k: forward tile lengths; bwd_block_q, bwd_block_k: backward ones. Lengths
        need not be multiples (inputs are zero-padded to whole blocks, padded keys masked).
    Returns:
      [B, T, N, Hv] in v's dtype; rows with no visible key are zeros.
    """
    mask = AttentionMask() if mask is None else mask
    if mask.window is not None:
        raise ValueError("flash_attention takes no sliding window; use implementation='xla' or 'dense'.")
    is_causal, causal_offset = mask.causal, mask.offset
    q_segment_ids, kv_segment_ids = mask.q_segment_ids, mask.kv_segment_ids
    b, t, n, hqk = q.shape
    s, kh, hv = k.shape[1], k.shape[2], v.shape[-1]
    g = n // kh
    precision = lax.Precision.HIGHEST if jnp.result_type(q, k, v) == jnp.float32 else None
    bq, bk = _block(t, block_q), _block(s, block_k)
    bwd_bq, bwd_bk = _block(t, bwd_block_q), _block(s, bwd_block_k)
    # One padded length must suit both passes' blocks: pad to a common multiple.
    tp = -(-t // math.lcm(bq, bwd_bq)) * math.lcm(bq, bwd_bq)
    sp = -(-s // math.lcm(bk, bwd_bk)) * math.lcm(bk, bwd_bk)
    cfg = Config(float(scale), bool(is_causal), t, bq, bk, bwd_bq, bwd_bk, precision)

    valid = None  # [B or 1, Sp] bool, True = a real, unmasked key
    keep = mask.key_keep(s)  # the mask's own rule for padding and lengths
    if sp != s or keep is not None:
        valid = (jnp.arange(sp) < s)[None, :]
        if keep is not None:
            valid = valid & _pad_to(keep, sp, 1)

    qb = _pad_to(jnp.moveaxis(q.reshape(b, t, kh, g, hqk), 1, 3), tp, 3)  # [B, K, G, Tp, Hqk]
    kb = _pad_to(jnp.moveaxis(k, 1, 2), sp, 2)  # [B, K, Sp, Hqk]
    vb = _pad_to(jnp.moveaxis(v, 1, 2), sp, 2)  # [B, K, Sp, Hv]
    offset = jnp.asarray(causal_offset, jnp.int32)
    seg = None
    if q_segment_ids is not None:
        # Edge padding: padded rows repeat the last id, so they widen no block's id range
        # (padded keys are masked by `valid` anyway, padded query rows are sliced off).
        q_ids = jnp.pad(jnp.asarray(q_segment_ids, jnp.int32), [(0, 0), (0, tp - t)], mode="edge")
        kv_ids = jnp.pad(jnp.asarray(kv_segment_ids, jnp.int32), [(0, 0), (0, sp - s)], mode="edge")
        if per_example is None:
            per_example = jax.device_count() == 1
        if per_example and b > 1:
            # One example at a time, each with its own tile bounds (module doc).
            valid_b = None if valid is None else jnp.broadcast_to(valid, (b, sp))

            def one(xs):
                qx, kx, vx, val, qi, ki = xs
                val = None if val is None else val[None]
                sx = block_segments(qi[None], ki[None], val, bq, bk, bwd_bq, bwd_bk)
                return _flash(cfg, qx[None], kx[None], vx[None], val, offset, sx)[0]

            out = lax.map(one, (qb, kb, vb, valid_b, q_ids, kv_ids))
            return jnp.moveaxis(out[:, :, :, :t], 3, 1).reshape(b, t, n, hv)
        seg = block_segments(q_ids, kv_ids, valid, bq, bk, bwd_bq, bwd_bk)
    out = _flash(cfg, qb, kb, vb, valid, offset, seg)  # [B, K, G, Tp, Hv]
    return jnp.moveaxis(out[:, :, :, :t], 3, 1).reshape(b, t, n, hv)


def attention(q: Array, k: Array, v: Array, *, scale: float, mask: AttentionMask, bias: Optional[Array] = None,
              mesh: Any = None) -> Array:
    """The 'flash' kernel behind :func:`goat_jax.kernels.attend`: :func:`flash_attention` with
    its default blocks; ``bias`` is refused by the capability table before this runs, ``mesh``
    is unused (XLA partitions the loops itself)."""
    del bias, mesh
    return flash_attention(q, k, v, scale=scale, mask=mask)


@dataclasses.dataclass(frozen=True)
class FlashBlocks:
    """This kernel's block loops (:func:`block_forward` / :func:`block_backward`) as the block
    kernels of ring attention (the interface of :mod:`goat_jax.kernels.ring_blocks`): tiles of
    ``block`` tokens, float32 results. Frozen: the ring's static configuration holds one."""

    block: int
    precision: Any = None
    static_masks = False  # masks built before the run (a switch per kind), not from the traced offset
    lane_dense_sums = False  # the ring keeps its gradient sums dense over TPU lanes (ring._lanes)

    def _cfg(self, scale: float, pair) -> Config:
        b = self.block
        return Config(scale, pair.causal, pair.run, b, b, b, b, self.precision, keep_f32=True)

    def _segments(self, q_ids, kv_ids, valid):
        if q_ids is None:
            return None
        b = self.block
        return block_segments(q_ids, kv_ids, valid, b, b, b, b)

    def forward(self, scale, pair, q, k, v, valid, offset, q_ids, kv_ids):
        """The pair's (out float32, lse with -inf for rows that saw no key) (ring_blocks' module doc)."""
        out, lse = block_forward(self._cfg(scale, pair), q, k, v, valid, offset, self._segments(q_ids, kv_ids, valid))
        return out, jnp.where(jnp.isinf(lse), -jnp.inf, lse)

    def backward(self, scale, pair, q, k, v, valid, offset, q_ids, kv_ids, out, lse, do):
        """The pair's float32 (dq, dk, dv) under the global ``out`` / ``lse`` (ring_blocks' module doc)."""
        return block_backward(self._cfg(scale, pair), q, k, v, valid, offset, out, lse, do,
                              self._segments(q_ids, kv_ids, valid))


# A ring's blocks on this kernel's loops (also those of a ring under 'xla', which has none of its own).
RING_BLOCKS = caps.RingBlocks(math="flash", make=FlashBlocks)

ROW = caps.Capability(
    name="flash", platforms=caps.ANY, features=("segment_ids", "ragged_segments", "traced_offset"),
    why_not={"bias": caps.NO_BIAS, "window": caps.NO_WINDOW, "return_probs": caps.NO_PROBS},
    summary="pure-JAX online-softmax attention with a recomputing custom VJP: memory linear in T and S, "
            "masked blocks skipped (goat_jax/kernels/flash.py)",
    attention=attention, fallback=0, ring_blocks=RING_BLOCKS)
