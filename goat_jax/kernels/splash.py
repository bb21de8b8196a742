"""Pallas TPU splash attention behind :func:`goat_jax.kernels.attend` ('splash', and
'splash_interpret': the same kernel in interpret mode, on any backend), on one device or a mesh.

The kernel is vmapped over the batch (and over KV heads for GQA/MQA, one MQA call per KV head),
with padding folded into segment ids (splash masks through SegmentIds only). On a mesh of more
than one device it runs under ``jax.shard_map`` (:func:`goat_jax.kernels.mesh.partition`): XLA
cannot partition a Mosaic kernel ("Mosaic kernels cannot be automatically partitioned. Please
wrap the call in a shard_map."), so each device runs it on its own examples (and heads).
"""

from __future__ import annotations

import functools
from typing import Any, Optional, Tuple

import jax
import jax.numpy as jnp

from goat_jax.kernels import mesh as mesh_lib
from goat_jax.kernels import capabilities as caps
from goat_jax.kernels import ring_blocks
from goat_jax.kernels.mask import AttentionMask
from goat_jax.kernels.padding import pad_lengths

BLOCK = 128  # splash blocks: multiples of the TPU lane count
TPU_LANES = 128  # the TPU compiler tiles the last dim in 128 lanes
_TRACED_OFFSET = ("splash builds its causal mask statically and needs an integer causal offset (a "
                  "KV-cache index is traced); decode with 'xla' or 'flash'")
_MASK_CACHE_SIZE = 512
_mask_cache_widened = False


def _widen_mask_cache() -> None:
    """Makes jax's cache of processed splash masks hold :data:`_MASK_CACHE_SIZE` masks (jax
    keeps 12). Building a splash kernel processes its mask block by block in NumPy for the
    forward and both backward kernels (seconds at long T); context parallelism (2 masks per
    shard, goat_jax/kernels/all_gather.py) with rematerialized layers needs far more than 12, so every
    layer re-processed every mask and tracing grew with mesh.context (benchmarks/context.md).
    The cache holds NumPy mask descriptions only, as jax's does. A jax without these names is
    left alone (only slower)."""
    global _mask_cache_widened
    if _mask_cache_widened:
        return
    _mask_cache_widened = True
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask_info as info
    inner = getattr(getattr(info, "_process_mask", None), "__wrapped__", None)
    if inner is None or not hasattr(info, "process_mask") or not hasattr(info, "process_mask_dkv"):
        return
    cached = functools.lru_cache(maxsize=_MASK_CACHE_SIZE)(inner)
    info.process_mask = functools.partial(cached, is_dkv=False)
    info.process_mask_dkv = functools.partial(cached, is_dkv=True)


def _kernel(mqa: bool, heads: int, t: int, s: int, is_causal: bool, offset: int, bq: int, bkv: int,
            interpret: bool):
    """The splash kernel of one static mask (its processed mask cached, :func:`_widen_mask_cache`)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    _widen_mask_cache()
    sizes = sk.BlockSizes(block_q=bq, block_kv=bkv, block_kv_compute=bkv, block_q_dkv=bq,
                          block_kv_dkv=bkv, block_kv_dkv_compute=bkv, block_q_dq=bq, block_kv_dq=bkv)
    base = sm.CausalMask((t, s), offset=offset) if is_causal else sm.FullMask((t, s))
    make = sk.make_splash_mqa_single_device if mqa else sk.make_splash_mha_single_device
    return make(sm.MultiHeadMask([base] * heads), block_sizes=sizes, interpret=interpret)


def attention(q, k, v, *, scale: float, mask: AttentionMask, bias=None, mesh: Any = None,
              interpret: bool = False):
    """Pallas TPU splash attention of q [B, T, N, Hqk], k [B, S, K, Hqk], v [B, S, K, Hv] under
    ``mask``, vmapped over the batch (and KV heads for GQA); under ``jax.shard_map`` over the
    batch (and head) axes on a ``mesh`` of several devices (:func:`goat_jax.kernels.mesh.partition`).
    Lengths are padded to whole blocks exactly (:func:`goat_jax.kernels.padding.pad_lengths`).
    The capability table refuses a bias and a traced causal offset before this runs."""
    del bias  # refused by the capability table (goat_jax/kernels/capabilities.py)
    t_real = q.shape[1]
    q, k, v, mask = pad_lengths(q, k, v, mask, BLOCK)
    return _splash(q, k, v, scale, mask, mesh, interpret)[:, :t_real]


def _splash(q, k, v, scale, mask: AttentionMask, mesh, interpret):
    """:func:`attention` on lengths that are whole blocks."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk

    b, t, n, _ = q.shape
    s, kh = k.shape[1], k.shape[2]
    if t % BLOCK or s % BLOCK:
        raise ValueError(
            f"splash attention needs query and key lengths that are multiples of {BLOCK}; "
            f"got T={t}, S={s}. Call goat_jax.kernels.attend, which pads them exactly, or pad the sequence."
        )
    is_causal, causal_offset = mask.causal, mask.offset
    if not mask.static_offset:
        raise ValueError(_TRACED_OFFSET + ".")
    block = lambda length: max(BLOCK, min(512, length) // BLOCK * BLOCK)
    bq, bkv = block(t), block(s)
    while t % bq:
        bq -= BLOCK
    while s % bkv:
        bkv -= BLOCK

    keep = mask.key_keep(s)
    pad = None if keep is None else ~keep

    # Splash masks through SegmentIds only (a key is seen iff its id equals the query's), so
    # padding is folded into the ids: padded keys get an id no query has.
    seg_q = seg_kv = None
    if mask.segments is not None:
        seg_q, seg_kv = mask.segments
        if pad is not None:
            # An id below every query id of the row (above them all if the minimum is int32's).
            low = jnp.min(seg_q, axis=-1, keepdims=True)
            high = jnp.max(seg_q, axis=-1, keepdims=True)
            never = jnp.where(low > jnp.iinfo(jnp.int32).min, low - 1, high + 1)
            seg_kv = jnp.where(pad, never, seg_kv)
    elif pad is not None:
        # Padded keys get segment 1, queries segment 0: they never match.
        seg_q, seg_kv = jnp.zeros((b, t), jnp.int32), pad.astype(jnp.int32)

    # Splash does not scale q; layouts are (heads, length, dim) per example.
    qs = jnp.moveaxis(q * jnp.asarray(scale, q.dtype), 1, 2)  # [B, N, T, H]
    ks = jnp.moveaxis(k, 1, 2)  # [B, K, S, H]
    vs = jnp.moveaxis(v, 1, 2)

    def run(qs, ks, vs, *seg):
        """Splash on (a device's shard of) the batch: [b, n, T, H] queries, [b, kh, S, H] keys."""
        n_, kh_ = qs.shape[1], ks.shape[1]
        g = n_ // kh_
        mqa = kh_ == 1 or g > 1
        kernel = _kernel(mqa, g if mqa else n_, t, s, bool(is_causal), int(causal_offset) if is_causal else 0,
                         bq, bkv, bool(interpret))

        def one(qb, kb, vb, sq=None, skv=None):
            ids = None if sq is None else sk.SegmentIds(q=sq, kv=skv)
            if mqa:  # qb [n, T, H] -> [kh, g, T, H]; one MQA call per KV head
                qg = qb.reshape(kh_, g, t, -1)
                return jax.vmap(lambda qq, kk, vv: kernel(qq, kk, vv, segment_ids=ids))(
                    qg, kb, vb).reshape(n_, t, -1)
            return kernel(qb, kb, vb, segment_ids=ids)

        return jax.vmap(one)(qs, ks, vs, *seg)

    seg = () if seg_q is None else (seg_q, seg_kv)
    layout = mesh_lib.partition(mesh, b, n, kh)
    if layout is None:
        out = run(qs, ks, vs, *seg)
    else:
        specs = layout.specs(heads_at=1)  # [B, N, T, H]
        out = jax.shard_map(run, mesh=layout.mesh, out_specs=specs.q,
                            in_specs=(specs.q, specs.kv, specs.kv) + (specs.rows,) * len(seg),
                            check_vma=False)(qs, ks, vs, *seg)
    return jnp.moveaxis(out, 1, 2).astype(v.dtype)  # [B, T, N, Hv]


def _why_not() -> dict:
    return {"bias": caps.NO_BIAS, "traced_offset": _TRACED_OFFSET, "window": caps.NO_WINDOW,
            "return_probs": caps.NO_PROBS}


def lane_width(compute_capability: Optional[Tuple[int, int]], width: int) -> int:
    """The q/k width splash runs a ``width``-wide head at on a TPU: the compiler tiles the last
    dim in :data:`TPU_LANES` lanes, so ``width`` rounded up to them (goat_jax/kernels/widths.py)."""
    del compute_capability  # a TPU's rule
    return -(-width // TPU_LANES) * TPU_LANES


def _ring_blocks(block: int, precision: Any, *, interpret: bool = False) -> ring_blocks.SplashBlocks:
    """Splash kernels as a ring's blocks (they tile each run themselves: ``block`` and
    ``precision`` are flash's), with jax's mask cache widened as for this module's own kernels."""
    del block, precision
    _widen_mask_cache()
    return ring_blocks.SplashBlocks(interpret=interpret)


ROW = caps.Capability(
    name="splash", platforms=("tpu",), features=("segment_ids", "ragged_segments"), why_not=_why_not(),
    summary="Pallas TPU splash attention, under jax.shard_map on a mesh (goat_jax/kernels/splash.py)",
    attention=attention, length_multiple=BLOCK, auto_min_length=BLOCK, preferred_on=("tpu",), static_masks=True,
    platform_hint="Use 'splash_interpret' to run the same Pallas kernel in interpret mode (slow; for tests).",
    host_hint=("To compile for TPUs from this host, trace under a mesh of TPU devices "
               "(jax.set_mesh(mesh); docs/aot.md)."),
    ring_blocks=caps.RingBlocks(math="splash", make=_ring_blocks),
    fast_widths=caps.FastWidths(width=lane_width, where="a TPU's splash kernel (128-lane tiles)",
                                cost="benchmarks/packed_head_dim.md"))
INTERPRET_ROW = caps.Capability(
    name="splash_interpret", platforms=caps.ANY, features=("segment_ids", "ragged_segments"), why_not=_why_not(),
    summary="the splash kernel in Pallas interpret mode, on any backend (slow; for tests)",
    attention=functools.partial(attention, interpret=True), length_multiple=BLOCK, auto_min_length=BLOCK,
    static_masks=True, ring_blocks=caps.RingBlocks(math="splash", make=functools.partial(_ring_blocks, interpret=True)))
