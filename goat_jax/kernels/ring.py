"""Ring attention: context parallelism whose keys and values travel around the ``context``
mesh axis instead of being all-gathered (``config.context_strategy = 'ring'``; docs/training.md,
Long context).

With ``c`` context shards every device keeps its ``T / c`` queries and, in ``c`` steps, sees
every shard's keys and values once: at each step it sends the block it holds to the next device
(``jax.lax.ppermute``, issued before the step's compute so XLA can overlap the transfer with it),
attends its queries to the block, and merges the partial result into its running output with
their log-sum-exps (the online softmax of FlashAttention, across devices). GOAT's packed keys
carry the prior, so the prior travels with them; segment ids and key masks travel with their
keys; positions are global (the layers compute them before the shard_map), and each block pair's
causal mask is the global one, through the mask's offset (``q_start - kv_start``). A device holds
two blocks of K/V at a time (the one it computes on and the one arriving), so per-device K/V
memory is O(T / c) rather than the all-gather strategy's O(T).

The backward pass (``jax.custom_vjp``) runs the ring again: the K/V blocks travel with their
dK/dV accumulators, each device adds its queries' contribution to the block it holds, and after
``c`` hops every accumulator is back at its owner; dQ stays local. Only the local q/k/v, the
output and its log-sum-exp are saved: nothing of size T.

Per-block attention is the flash kernel's block math (:mod:`goat_jax.kernels.flash`:
``block_forward`` / ``block_backward``, which return and take the log-sum-exp), for
``implementation='flash'`` and ``'xla'`` alike: the merge needs each block's log-sum-exp and its
backward needs the global one, which ``jax.nn.dot_product_attention`` (XLA or cuDNN) does not
give with gradients, and splash's residuals would need its backward kernels driven by a global
log-sum-exp (not done: splash and cuDNN are refused under ring, from the capability table; on
TPU and GPU the ring runs the flash block math, compiled by XLA). Under load balancing
(:mod:`goat_jax.kernels.balance`) each device holds two chunks, so a step is four chunk pairs;
a pair whose keys all lie after its queries is skipped by the flash loops' causal trip counts, so
every device does the same work.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from goat_jax.kernels import flash
from goat_jax.kernels import mesh as mesh_lib
from goat_jax.kernels.context import check_shardable
from goat_jax.kernels.mask import AttentionMask

Array = jax.Array
AXIS = mesh_lib.CONTEXT_AXIS
_BLOCK = 512  # the largest flash tile a run is cut into (flash.DEFAULT_BLOCK_Q)


class _Ring(NamedTuple):
    """Static parameters of one ring call."""

    c: int  # context shards
    balanced: bool
    causal: bool
    offset: int  # the mask's static causal offset
    scale: float
    run: int  # tokens per run (a device's chunk under balancing, its whole shard otherwise)
    runs: int  # runs per device (2 balanced and causal, else 1)
    block: int  # flash tile length (divides run)
    precision: Any


def _start(cfg: _Ring, device, r: int):
    """Sequence index of the first token of run ``r`` of ``device`` (traced device index)."""
    if cfg.runs == 1:
        return device * cfg.run * (2 if cfg.balanced else 1)
    return jnp.where(r == 0, device, 2 * cfg.c - 1 - device) * cfg.run


def _flash_cfg(cfg: _Ring) -> flash.Config:
    return flash.Config(cfg.scale, cfg.causal, cfg.run, cfg.block, cfg.block, cfg.block, cfg.block,
                        cfg.precision, keep_f32=True)


def _cut(x: Optional[Array], r: int, run: int, axis: int) -> Optional[Array]:
    return None if x is None else lax.slice_in_dim(x, r * run, (r + 1) * run, axis=axis)


def _pair(cfg: _Ring, q_ids, k_cur, v_cur, keep, kv_ids, me, src, qr: int, kr: int):
    """The flash block arguments of query run ``qr`` of this device against key run ``kr`` of
    the block from ``src``: (k, v, valid, offset, segments)."""
    k_r, v_r = _cut(k_cur, kr, cfg.run, 2), _cut(v_cur, kr, cfg.run, 2)
    valid = _cut(keep, kr, cfg.run, 1)
    offset = jnp.asarray(cfg.offset + _start(cfg, me, qr) - _start(cfg, src, kr), jnp.int32)
    seg = None
    if q_ids is not None:
        seg = flash.block_segments(_cut(q_ids, qr, cfg.run, 1), _cut(kv_ids, kr, cfg.run, 1), valid,
                                   cfg.block, cfg.block, cfg.block, cfg.block)
    return k_r, v_r, valid, offset, seg


def _rotate(cfg: _Ring, tree):
    """Each device's arrays to the next device of the ring."""
    return lax.ppermute(tree, AXIS, perm=[(j, (j + 1) % cfg.c) for j in range(cfg.c)])


def _merge(acc, part):
    """Online-softmax merge of (out [.., Hv] float32, lse [..], -inf: nothing seen yet)."""
    (o1, l1), (o2, l2) = acc, part
    top = jnp.maximum(l1, l2)
    safe = jnp.where(jnp.isfinite(top), top, 0.0)
    total = safe + jnp.log(jnp.exp(l1 - safe) + jnp.exp(l2 - safe))
    total = jnp.where(jnp.isfinite(top), total, -jnp.inf)
    w1 = jnp.where(jnp.isfinite(l1), jnp.exp(l1 - jnp.where(jnp.isfinite(total), total, 0.0)), 0.0)
    w2 = jnp.where(jnp.isfinite(l2), jnp.exp(l2 - jnp.where(jnp.isfinite(total), total, 0.0)), 0.0)
    return o1 * w1[..., None] + o2 * w2[..., None], total


def _forward(cfg: _Ring, q, k, v, keep, q_ids, kv_ids):
    """q [B, K, G, Tl, H], k/v [B, K, Tl, H*] (local): (out float32, lse with -inf for rows
    that saw no key)."""
    me = lax.axis_index(AXIS)
    fcfg = _flash_cfg(cfg)
    q_runs = [_cut(q, r, cfg.run, 3) for r in range(cfg.runs)]
    b, kh, g, _, _ = q.shape
    hv = v.shape[-1]
    init = [(jnp.zeros((b, kh, g, cfg.run, hv), jnp.float32), jnp.full((b, kh, g, cfg.run), -jnp.inf))
            for _ in range(cfg.runs)]

    def step(carry, s):
        block, acc = carry
        arriving = _rotate(cfg, block)  # issued first: the transfer overlaps this step's compute
        k_cur, v_cur, keep_cur, ids_cur = block
        src = (me - s) % cfg.c
        acc = list(acc)
        for qr in range(cfg.runs):
            for kr in range(cfg.runs):
                k_r, v_r, valid, offset, seg = _pair(cfg, q_ids, k_cur, v_cur, keep_cur, ids_cur, me, src,
                                                     qr, kr)
                out, lse = flash.block_forward(fcfg, q_runs[qr], k_r, v_r, valid, offset, seg)
                acc[qr] = _merge(acc[qr], (out, jnp.where(jnp.isinf(lse), -jnp.inf, lse)))
        return (arriving, tuple(acc)), None

    (_, acc), _ = lax.scan(step, ((k, v, keep, kv_ids), tuple(init)), jnp.arange(cfg.c))
    out = jnp.concatenate([o for o, _ in acc], axis=3)
    lse = jnp.concatenate([l for _, l in acc], axis=3)
    return out, lse


def _backward(cfg: _Ring, q, k, v, keep, q_ids, kv_ids, out, lse, do):
    """(dq, dk, dv) float32 of the local arrays; ``lse`` uses +inf for empty rows (flash's)."""
    me = lax.axis_index(AXIS)
    fcfg = _flash_cfg(cfg)
    cut_q = lambda x: [_cut(x, r, cfg.run, 3) for r in range(cfg.runs)]
    q_runs, out_runs, lse_runs, do_runs = cut_q(q), cut_q(out), cut_q(lse), cut_q(do)
    dq0 = tuple(jnp.zeros(x.shape, jnp.float32) for x in q_runs)

    def step(carry, s):
        block, grads, dq = carry
        k_cur, v_cur, keep_cur, ids_cur = block
        dk_cur, dv_cur = grads
        src = (me - s) % cfg.c
        dq = list(dq)
        for qr in range(cfg.runs):
            for kr in range(cfg.runs):
                k_r, v_r, valid, offset, seg = _pair(cfg, q_ids, k_cur, v_cur, keep_cur, ids_cur, me, src,
                                                     qr, kr)
                dq_p, dk_p, dv_p = flash.block_backward(fcfg, q_runs[qr], k_r, v_r, valid, offset,
                                                        out_runs[qr], lse_runs[qr], do_runs[qr], seg)
                dq[qr] = dq[qr] + dq_p
                at = kr * cfg.run
                dk_cur = lax.dynamic_update_slice_in_dim(
                    dk_cur, lax.dynamic_slice_in_dim(dk_cur, at, cfg.run, 2) + dk_p, at, axis=2)
                dv_cur = lax.dynamic_update_slice_in_dim(
                    dv_cur, lax.dynamic_slice_in_dim(dv_cur, at, cfg.run, 2) + dv_p, at, axis=2)
        # The block and its gradient move on together; after c hops each is home again.
        block, grads = _rotate(cfg, (block, (dk_cur, dv_cur)))
        return (block, grads, tuple(dq)), None

    grads0 = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
    (_, (dk, dv), dq), _ = lax.scan(step, ((k, v, keep, kv_ids), grads0, dq0), jnp.arange(cfg.c))
    return jnp.concatenate(dq, axis=3), dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring(cfg: _Ring, q, k, v, keep, q_ids, kv_ids):
    out, _ = _forward(cfg, q, k, v, keep, q_ids, kv_ids)
    return out.astype(v.dtype)


def _ring_fwd(cfg, q, k, v, keep, q_ids, kv_ids):
    out, lse = _forward(cfg, q, k, v, keep, q_ids, kv_ids)
    out = out.astype(v.dtype)
    lse = jnp.where(jnp.isfinite(lse), lse, jnp.inf)  # flash's mark of a row that saw no key
    return out, (q, k, v, keep, q_ids, kv_ids, out, lse)


def _ring_bwd(cfg, res, do):
    q, k, v, keep, q_ids, kv_ids, out, lse = res
    dq, dk, dv = _backward(cfg, q, k, v, keep, q_ids, kv_ids, out, lse, do)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, None


_ring.defvjp(_ring_fwd, _ring_bwd)


def block_kernel(implementation: str) -> str:
    """The kernel whose block math computes a ring's blocks when the layer asks for
    ``implementation`` (module doc): flash's for every kernel a ring takes ('flash', 'xla')."""
    del implementation  # every kernel a ring takes runs flash's block math today
    return "flash"


def block_length(run: int) -> int:
    """The flash tile of a ring run: the largest divisor of ``run`` up to 512 that is a multiple
    of 8, else the whole run (tiles cut the run exactly: no padding inside a ring)."""
    for size in range(min(_BLOCK, run), 0, -1):
        if run % size == 0 and (size % 8 == 0 or size == run):
            return size
    return run


def attend(q: Array, k: Array, v: Array, *, mask: AttentionMask, bias: Optional[Array], mesh: Any,
           balanced: bool, implementation: str, scale: float) -> Array:
    """Attention of q [B, T, N, H] over k/v [B, T, K, H*] with the sequence sharded over
    ``mesh``'s ``context`` axis, keys and values passing around the ring (module doc). The
    mask's key padding and kv lengths travel with their keys as one validity mask; segment ids
    travel too. Returns [B, T, N, Hv]; rows with no visible key are zeros (no gradient)."""
    c = mesh_lib.context_shards(mesh)
    b, t, n, hqk = q.shape
    s, kh = k.shape[1], k.shape[2]
    check_shardable(t, s, mask, c, balanced, implementation, strategy="ring")
    if bias is not None:
        raise ValueError("context_strategy='ring' cannot take an additive bias (ALiBi as a bias, FIRE, Kerple): "
                         "the bias would travel as a T x T tensor. Use context_strategy='all_gather' or an "
                         "encoding packed into q/k ('alibi_packed', GOAT, RoPE).")
    if mask.window is not None:
        raise ValueError("context_strategy='ring' takes no sliding window (goat_jax.kernels.local_window).")
    runs = 2 if balanced and mask.causal else 1
    run = t // c // runs
    precision = lax.Precision.HIGHEST if jnp.result_type(q, k, v) == jnp.float32 else None
    cfg = _Ring(c, balanced, mask.causal, int(mask.offset) if mask.causal else 0, float(scale), run, runs,
                block_length(run), precision)
    keep = mask.key_keep(s)  # [B, S] or None: padding and lengths, as one mask that travels
    layout = mesh_lib.partition(mesh, b, n, kh)
    bx, hx = mesh_lib.spec_axes(layout.batch_axes), mesh_lib.spec_axes(layout.head_axes)
    kvh = hx if layout.shard_kv else None

    def local(q_, k_, v_, keep_, q_ids_, kv_ids_):
        bl, tl, nl, _ = q_.shape
        khl = k_.shape[2]
        qb = jnp.moveaxis(q_.reshape(bl, tl, khl, nl // khl, q_.shape[-1]), 1, 3)  # [B, K, G, Tl, H]
        out = _ring(cfg, qb, jnp.moveaxis(k_, 1, 2), jnp.moveaxis(v_, 1, 2), keep_, q_ids_, kv_ids_)
        return jnp.moveaxis(out, 3, 1).reshape(bl, tl, nl, v_.shape[-1])

    args = [q, k, v, keep, mask.q_segment_ids, mask.kv_segment_ids]
    row = P(bx, AXIS)
    specs = [P(bx, AXIS, hx, None), P(bx, AXIS, kvh, None), P(bx, AXIS, kvh, None), row, row, row]
    present = [a is not None for a in args]
    fn = lambda *xs: local(*_fill(xs, present))
    out = jax.shard_map(fn, mesh=layout.mesh, in_specs=tuple(sp for sp, p in zip(specs, present) if p),
                        out_specs=P(bx, AXIS, hx, None), check_vma=False)(*[a for a in args if a is not None])
    # A row that saw no key in any block is already zero with zero gradient (its weights in the
    # merge are 0, and its log-sum-exp is +inf in the backward): the kernels' contract holds
    # without a T x S look, which the load-balanced order would also make wrong here.
    return out


def _fill(xs, present):
    """The positional arguments with None where an optional one was left out."""
    it = iter(xs)
    return [next(it) if p else None for p in present]
