"""Pallas TPU splash attention behind :func:`goat_jax.kernels.attend` ('splash', and
'splash_interpret': the same kernel in interpret mode, on any backend), on one device or a mesh.

The kernel is vmapped over the batch (and over KV heads for GQA/MQA, one MQA call per KV head),
with padding folded into segment ids (splash masks through SegmentIds only). Inside a mesh of
more than one device it runs under ``jax.shard_map`` (:func:`partition`): XLA cannot partition a
Mosaic kernel ("Mosaic kernels cannot be automatically partitioned. Please wrap the call in a
shard_map."), so each device runs it on its own examples (and heads).
"""

from __future__ import annotations

import functools
from typing import Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

BLOCK = 128  # splash block sizes must be multiples of the TPU lane count


def partition(b: int, n: int, kh: int):
    """How splash runs on the mesh in context: ``(mesh, batch_axes, head_axes, shard_kv)``, or
    None outside a mesh of more than one device. The ``context`` axis splits neither the batch
    nor the heads (:mod:`goat_jax.context` splits the sequence over it).

    Mosaic kernels cannot be partitioned by XLA, so on a mesh splash runs under
    ``jax.shard_map``, each device on its own examples (and heads). The batch dim is split over
    the mesh axes the logical rules in context give ``'batch'`` (Flax's
    ``nn.logical_axis_rules``, as the trainer sets them; without rules the axes named
    ``data``/``fsdp``, else every axis but ``tensor``/``model``), the query heads over those of
    ``'heads'`` (without rules: ``tensor``); an axis is kept only while the product still divides
    the dimension. The key/value heads are split with the query heads when their number divides
    too (each device keeps its query heads' KV heads: GQA groups are contiguous), kept whole for
    one KV head (MQA), and otherwise the heads are not split (every device of those axes repeats
    the heads' work: correct, only redundant). Axes that are already manual (the layer called
    inside the caller's own ``shard_map``) are left alone; with none other of size > 1: None."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return None
    # Axes already manual (inside the caller's own shard_map) hold this device's shard already.
    manual = set(getattr(mesh, "manual_axes", ()))
    names = tuple(a for a in mesh.axis_names if a not in manual)
    if np.prod([mesh.shape[a] for a in names], dtype=int) <= 1:
        return None
    names = tuple(a for a in names if a != "context")

    def from_rules(logical: str) -> Optional[Tuple[str, ...]]:
        try:
            import flax.linen as nn  # pylint: disable=g-import-not-at-top
            if not nn.get_logical_axis_rules():
                return None
            spec = nn.logical_to_mesh_axes((logical,))
        except Exception:  # pylint: disable=broad-except  # rules naming axes of another mesh
            return None
        if spec is None or not len(spec) or spec[0] is None:
            return ()
        axes = spec[0] if isinstance(spec[0], tuple) else (spec[0],)
        return tuple(a for a in axes if a in names)

    def dividing(axes, dim, used=()):
        kept, size = [], 1
        for a in axes:
            if a not in used and dim % (size * mesh.shape[a]) == 0:
                kept.append(a)
                size *= mesh.shape[a]
        return tuple(kept), size

    batch = from_rules("batch")
    if batch is None:
        batch = tuple(a for a in ("data", "fsdp") if a in names) or tuple(
            a for a in names if a not in ("tensor", "model"))
    batch, _ = dividing(batch, b)
    heads = from_rules("heads")
    if heads is None:
        heads = tuple(a for a in ("tensor", "model") if a in names)
    heads, m = dividing(heads, n, used=batch)
    shard_kv = bool(heads) and kh % m == 0
    if heads and not shard_kv and kh != 1:
        heads = ()
    return mesh, batch, heads, shard_kv


_MASK_CACHE_SIZE = 512
_mask_cache_widened = False


def _widen_mask_cache() -> None:
    """Makes jax's cache of processed splash masks hold :data:`_MASK_CACHE_SIZE` masks (jax
    keeps 12). Building a splash kernel processes its mask block by block in NumPy for the
    forward and both backward kernels (seconds at long T); context parallelism (2 masks per
    shard, goat_jax/context.py) with rematerialized layers needs far more than 12, so every
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


def splash_attention(q, k, v, scale, is_causal, causal_offset, key_padding_mask, kv_lengths, segments, *,
            interpret):
    """Pallas TPU splash attention, vmapped over the batch (and KV heads for GQA); under
    ``jax.shard_map`` over the batch (and head) axes inside a mesh of several devices
    (:func:`partition`). Lengths must be whole blocks: :func:`goat_jax.kernels.attend` pads
    others exactly (:func:`goat_jax.kernels.pad_lengths`)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    b, t, n, _ = q.shape
    s, kh = k.shape[1], k.shape[2]
    if t % BLOCK or s % BLOCK:
        raise ValueError(
            f"splash attention needs query and key lengths that are multiples of {BLOCK}; "
            f"got T={t}, S={s}. Call goat_jax.kernels.attend, which pads them exactly, or pad the sequence."
        )
    if is_causal and not isinstance(causal_offset, (int, np.integer)):
        raise ValueError(
            "splash attention builds its causal mask statically and needs an integer "
            "causal_offset (got a traced value, e.g. a KV-cache index). Decode with "
            "implementation='xla'/'cudnn'."
        )
    block = lambda length: max(BLOCK, min(512, length) // BLOCK * BLOCK)
    bq, bkv = block(t), block(s)
    while t % bq:
        bq -= BLOCK
    while s % bkv:
        bkv -= BLOCK

    pad = None
    if key_padding_mask is not None:
        pad = key_padding_mask.astype(bool)
    if kv_lengths is not None:
        beyond = jnp.arange(s)[None, :] >= kv_lengths[:, None]
        pad = beyond if pad is None else pad | beyond

    # Splash masks through SegmentIds only (a key is seen iff its id equals the query's), so
    # padding is folded into the ids: padded keys get an id no query has.
    seg_q = seg_kv = None
    if segments is not None:
        seg_q, seg_kv = segments
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
    layout = partition(b, n, kh)
    if layout is None:
        out = run(qs, ks, vs, *seg)
    else:
        mesh, batch, heads, shard_kv = layout
        ax = lambda axes: None if not axes else (axes[0] if len(axes) == 1 else axes)
        q_spec = P(ax(batch), ax(heads), None, None)
        kv_spec = P(ax(batch), ax(heads) if shard_kv else None, None, None)
        seg_spec = P(ax(batch), None)
        out = jax.shard_map(run, mesh=mesh, out_specs=q_spec,
                            in_specs=(q_spec, kv_spec, kv_spec) + (seg_spec,) * len(seg),
                            check_vma=False)(qs, ks, vs, *seg)
    return jnp.moveaxis(out, 1, 2).astype(v.dtype)  # [B, T, N, Hv]
