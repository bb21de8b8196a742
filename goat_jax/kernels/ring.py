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

Per-block attention is one of the block kernels of :mod:`goat_jax.kernels.ring_blocks`, the
ones the row of ``implementation`` names (its ``ring_blocks``): splash kernels ('splash',
'splash_interpret'), cuDNN's fused calls ('cudnn'), the flash kernel's block loops ('flash',
'xla'); a row without ring blocks ('dense') cannot run in a ring. Each returns its block's
log-sum-exp for the merge, and its backward takes the global output and log-sum-exp. Under load
balancing (:mod:`goat_jax.kernels.balance`) each device holds two chunks, so a step is four chunk
pairs: a device's late chunk against another's early chunk is always full, its early chunk against
a late one always empty (skipped), and the other two depend on the step, so every device does the
same work. The flash loops take that as causal trip counts; blocks whose masks are static (splash,
cuDNN) run the first step apart (its diagonal pairs causal) and, in every later step, the one
diagonal-chunk pair that is full, chosen by which runs it reads, so no pair switches over masks
(:func:`_work`; the memory this saves is in benchmarks/context.md).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple, Optional, Tuple

import jax
import jax.numpy as jnp
from jax import lax

from goat_jax.kernels import capabilities as caps
from goat_jax.kernels import mesh as mesh_lib
from goat_jax.kernels import ring_blocks
from goat_jax.kernels import strategies
from goat_jax.kernels.balance import STRATEGY_FIELD
from goat_jax.kernels.all_gather import check_shardable
from goat_jax.kernels.mask import AttentionMask
from goat_jax.kernels.plan import AttentionPlan

Array = jax.Array
NAME = "ring"
_BLOCK = 512  # the largest flash tile a run is cut into (flash.DEFAULT_BLOCK_Q)
_LANES = 128  # a TPU vector register's lanes: the last axis of an array is tiled by them


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
    axis: str  # the context mesh axis the ring runs along
    blocks: Any = None  # the block kernels (goat_jax/kernels/ring_blocks.py); None: flash's loops


def _start(cfg: _Ring, device, r):
    """Sequence index of the first token of run ``r`` (static or traced) of ``device`` (traced)."""
    if cfg.runs == 1:
        return device * cfg.run * (2 if cfg.balanced else 1)
    return jnp.where(r == 0, device, 2 * cfg.c - 1 - device) * cfg.run


def _blocks(cfg: _Ring):
    return cfg.blocks if cfg.blocks is not None else ring_blocks.FlashBlocks(cfg.block, cfg.precision)


def _run_of(x: Optional[Array], r, run: int, axis: int) -> Optional[Array]:
    """Run ``r`` (static or traced) of ``x`` along ``axis``."""
    if x is None:
        return None
    if isinstance(r, int):
        return lax.slice_in_dim(x, r * run, (r + 1) * run, axis=axis)
    return lax.dynamic_slice_in_dim(x, r * run, run, axis=axis)


def _query_runs(cfg: _Ring, x: Array):
    """``r -> run r of x`` (a per-query array, runs along axis 3): the static runs cut once,
    outside the ring's loop (as XLA plans the flash ring best), a traced run sliced where asked."""
    runs = [_run_of(x, r, cfg.run, 3) for r in range(cfg.runs)]
    return lambda r: runs[r] if isinstance(r, int) else _run_of(x, r, cfg.run, 3)


def _pick(runs, r):
    """Entry ``r`` (static, or traced with two runs) of per-run arrays."""
    return runs[r] if isinstance(r, int) else jax.tree.map(lambda a, b: jnp.where(r == 0, a, b), *runs)


def _put(runs, r, value):
    """``runs`` with entry ``r`` (static, or traced with two runs) replaced by ``value``."""
    if isinstance(r, int):
        return tuple(value if i == r else x for i, x in enumerate(runs))
    return tuple(jax.tree.map(lambda new, old, i=i: jnp.where(r == i, new, old), value, x) for i, x in enumerate(runs))


def _add_run(x: Array, r, run: int, axis: int, part: Array) -> Array:
    """``x`` with ``part`` added to its run ``r`` (static or traced) along ``axis``."""
    return lax.dynamic_update_slice_in_dim(x, lax.dynamic_slice_in_dim(x, r * run, run, axis) + part, r * run, axis)


def _peeled(cfg: _Ring) -> bool:
    """Whether the first step runs apart from the others: a causal ring at offset 0 on blocks
    with static masks (splash, cuDNN), whose first step holds the diagonal pairs (causal) and
    whose later steps hold only full and empty pairs, so each later pair's kind is static or
    chosen by which run it reads instead of a ``lax.switch`` over masks (whose conditionals cost
    0.28 GiB of temporaries on a 65,536-token splash ring; benchmarks/context.md). The flash
    loops take the traced offset as trip counts and need no switch; peeling would only add the
    first step's buffers beside the loop's (+38% temporaries at c = 2 on CPU)."""
    return cfg.causal and cfg.offset == 0 and _blocks(cfg).static_masks


def _known(cfg: _Ring, qr: int, kr: int) -> Optional[str]:
    """A pair's kind when the load-balanced layout fixes it: a device's late chunk comes after
    every device's early chunk (full), its early chunk before every late one (empty)."""
    if cfg.runs == 2 and cfg.offset == 0 and qr != kr:
        return "full" if qr == 1 else "empty"
    return None


def _work(cfg: _Ring, me, src, first: bool):
    """The block pairs of one ring step, as (query run, key run, static kind or None), runs
    static or traced; ``first``: the peeled first step (:func:`_peeled`), where ``src == me``.

    Peeled, the first step is the diagonal pair(s) (causal) and, load-balanced, the late run
    against the early one (full); every later step of a load-balanced ring is the late run
    against the early one and one diagonal-run pair that is full, early against early when the
    block comes from an earlier device and late against late otherwise (the other is empty), so
    splash and cuDNN run one static full kernel per pair instead of a switch over masks.
    Unbalanced, a later step is full or empty (a switch of two). Not peeled: every pair, with
    the kind the layout fixes or None (the block kernels switch over :func:`ring_blocks.kinds`)."""
    if not _peeled(cfg):
        return [(qr, kr, _known(cfg, qr, kr)) for qr in range(cfg.runs) for kr in range(cfg.runs)]
    if first:
        return [(r, r, "diagonal") for r in range(cfg.runs)] + ([(1, 0, "full")] if cfg.runs == 2 else [])
    if cfg.runs == 1:
        return [(0, 0, "off_diagonal")]
    sel = jnp.where(src < me, 0, 1).astype(jnp.int32)
    return [(1, 0, "full"), (sel, sel, "full")]


def _pair(cfg: _Ring, q_ids, k_cur, v_cur, keep, kv_ids, me, src, qr, kr, known):
    """The block arguments of query run ``qr`` of this device against key run ``kr`` of the
    block from ``src``: (pair, k, v, valid, offset, query ids, key ids)."""
    k_r, v_r = _run_of(k_cur, kr, cfg.run, 2), _run_of(v_cur, kr, cfg.run, 2)
    valid = _run_of(keep, kr, cfg.run, 1)
    offset = jnp.asarray(cfg.offset + _start(cfg, me, qr) - _start(cfg, src, kr), jnp.int32)
    pair = ring_blocks.Pair(cfg.causal, cfg.offset, cfg.run, known)
    return pair, k_r, v_r, valid, offset, _run_of(q_ids, qr, cfg.run, 1), _run_of(kv_ids, kr, cfg.run, 1)


def _rotate(cfg: _Ring, tree):
    """Each device's arrays to the next device of the ring."""
    return lax.ppermute(tree, cfg.axis, perm=[(j, (j + 1) % cfg.c) for j in range(cfg.c)])


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


def _steps(cfg: _Ring, step, carry):
    """Runs ``step(carry, s, first)`` for s = 0 .. c - 1: the first apart when peeled (its pairs'
    kinds differ from the others'), the rest in one scan."""
    rest = jnp.arange(cfg.c)
    if _peeled(cfg):
        carry = step(carry, jnp.int32(0), True)
        rest = rest[1:]
    carry, _ = lax.scan(lambda cr, s: (step(cr, s, False), None), carry, rest)
    return carry


def _forward(cfg: _Ring, q, k, v, keep, q_ids, kv_ids):
    """q [B, K, G, Tl, H], k/v [B, K, Tl, H*] (local): (out float32, lse with -inf for rows
    that saw no key)."""
    me = lax.axis_index(cfg.axis)
    blocks = _blocks(cfg)
    b, kh, g, _, _ = q.shape
    q_run = _query_runs(cfg, q)
    init = tuple((jnp.zeros((b, kh, g, cfg.run, v.shape[-1]), jnp.float32), jnp.full((b, kh, g, cfg.run), -jnp.inf))
                 for _ in range(cfg.runs))

    def step(carry, s, first):
        block, acc = carry
        arriving = _rotate(cfg, block)  # issued first: the transfer overlaps this step's compute
        k_cur, v_cur, keep_cur, ids_cur = block
        src = (me - s) % cfg.c
        for qr, kr, known in _work(cfg, me, src, first):
            pair, k_r, v_r, valid, offset, qi, ki = _pair(cfg, q_ids, k_cur, v_cur, keep_cur, ids_cur, me, src,
                                                          qr, kr, known)
            part = blocks.forward(cfg.scale, pair, q_run(qr), k_r, v_r, valid, offset, qi, ki)
            acc = _put(acc, qr, _merge(_pick(acc, qr), part))
        return arriving, acc

    _, acc = _steps(cfg, step, ((k, v, keep, kv_ids), init))
    return jnp.concatenate([o for o, _ in acc], axis=3), jnp.concatenate([l for _, l in acc], axis=3)


def _backward(cfg: _Ring, q, k, v, keep, q_ids, kv_ids, out, lse, do):
    """(dq, dk, dv) float32 of the local arrays; ``lse`` uses +inf for empty rows (flash's)."""
    me = lax.axis_index(cfg.axis)
    blocks = _blocks(cfg)
    q_run, out_run, lse_run, do_run = (_query_runs(cfg, x) for x in (q, out, lse, do))
    dense = blocks.lane_dense_sums and cfg.run % _LANES == 0  # the sums' layout (_lanes)

    def step(carry, s, first):
        block, (dk_cur, dv_cur), dq = carry
        k_cur, v_cur, keep_cur, ids_cur = block
        src = (me - s) % cfg.c
        for qr, kr, known in _work(cfg, me, src, first):
            pair, k_r, v_r, valid, offset, qi, ki = _pair(cfg, q_ids, k_cur, v_cur, keep_cur, ids_cur, me, src,
                                                          qr, kr, known)
            dq_p, dk_p, dv_p = blocks.backward(cfg.scale, pair, q_run(qr), k_r, v_r, valid, offset, qi, ki,
                                               out_run(qr), lse_run(qr), do_run(qr))
            dq = _put(dq, qr, _pick(dq, qr) + _lanes(dq_p, dense))
            dk_cur = _add_lanes(dk_cur, kr, cfg.run, dk_p, dense)
            dv_cur = _add_lanes(dv_cur, kr, cfg.run, dv_p, dense)
        # The block and its gradient move on together; after c hops each is home again.
        block, grads = _rotate(cfg, (block, (dk_cur, dv_cur)))
        return block, grads, dq

    zeros = lambda x: _lanes(jnp.zeros(x.shape, jnp.float32), dense)
    dq0 = tuple(zeros(x) for x in (_run_of(q, r, cfg.run, 3) for r in range(cfg.runs)))
    _, (dk, dv), dq = _steps(cfg, step, ((k, v, keep, kv_ids), (zeros(k), zeros(v)), dq0))
    dq = jnp.concatenate([x.reshape(x.shape[:3] + (cfg.run, q.shape[-1])) for x in dq], axis=3)
    return dq, dk.reshape(k.shape), dv.reshape(v.shape)


def _lanes(x: Array, dense: bool) -> Array:
    """``x`` [..., T, H] as the ring's backward holds its float32 sums: [..., T * H / 128, 128]
    when ``dense`` (T a multiple of 128), else unchanged.

    A TPU tiles an array's last axis over 128 lanes, so a head dim of 64 (or GOAT's packed 66)
    stored last takes the memory of 128: a float32 [8, 8192, 64] sum takes 32 MiB, not 16. The
    flash loops' sums get a layout with the sequence last from XLA, but splash's kernels return
    the head dim last, and XLA keeps that layout for the dq / dk / dv sums the ring carries
    across its steps (and sends around it). Folding the head dim into whole rows of 128 makes
    them dense: 0.68 -> 0.53 GiB of temporaries on a 65,536-token splash ring (benchmarks/context.md);
    on flash blocks it cost (0.49 -> 0.52 GiB in a trial loop), so only splash blocks ask for it."""
    if not dense:
        return x
    t, h = x.shape[-2:]
    return x.reshape(x.shape[:-2] + (t * h // _LANES, _LANES))


def _add_lanes(x: Array, r, run: int, part: Array, dense: bool) -> Array:
    """``x`` (held as :func:`_lanes`) with ``part`` [..., run, H] added to its run ``r``."""
    if not dense:
        return _add_run(x, r, run, x.ndim - 2, part)
    rows = run * part.shape[-1] // _LANES
    return _add_run(x, r, rows, x.ndim - 2, part.reshape(part.shape[:-2] + (rows, _LANES)))


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


def kernel_gap(row: caps.Capability, key_masks: bool) -> Optional[Tuple[str, str]]:
    """What a ring cannot take of kernel ``row`` (the strategy's ``kernel_gap``): a row without
    ring blocks at all, or, when masks travel with the keys (``key_masks``: segment ids, key
    padding, kv lengths), blocks that take none (cuDNN's); as (what, why), or None."""
    ring = row.ring_blocks
    if ring is None:
        takers = ", ".join(repr(name) for name, r in caps.CAPABILITIES.items() if r.ring_blocks is not None)
        return (f"{STRATEGY_FIELD}={NAME!r}",
                f"ring attention merges blocks by their log-sum-exp, which {row.name!r} does not return (ring blocks: "
                f"goat_jax/kernels/ring_blocks.py); use implementation= one of {takers}, or "
                f"{STRATEGY_FIELD}='all_gather'")
    if key_masks and ring.no_key_masks is not None:
        return f"segment ids or key padding under {STRATEGY_FIELD}={NAME!r}", ring.no_key_masks
    return None


def check_run(run: strategies.Run) -> None:
    """The ring's refusals of a run's config before any work (the strategy's ``check_run``): an
    explicit kernel without ring blocks, and a position encoding that adds a materialized bias
    (it would travel around the ring whole). ValueError naming the fields and the fix."""
    gap = None if run.row is None else kernel_gap(run.row, key_masks=False)
    if gap is not None:
        raise ValueError(f"{STRATEGY_FIELD}={NAME!r} with model.implementation={run.implementation!r}: {gap[1]}.")
    if run.bias:
        raise ValueError(
            f"{STRATEGY_FIELD}={NAME!r} with model.position_encoding={run.position_encoding!r}: the encoding adds "
            "a materialized [N, T, S] bias, which would travel around the ring whole. Use "
            f"{STRATEGY_FIELD}='all_gather', or an encoding packed into q/k ('alibi_packed', 'goat', 'rope').")


def _report(row: caps.Capability) -> dict:
    """What the choice's log line and compile.json say of a ring on kernel ``row``: whose block
    math computes its blocks (the row's ``ring_blocks.math``: 'flash' for 'flash' and 'xla',
    'splash' for both splash rows, 'cudnn'; None without ring blocks)."""
    return {"ring_blocks": None if row.ring_blocks is None else row.ring_blocks.math}


def block_length(run: int) -> int:
    """The flash tile of a ring run: the largest divisor of ``run`` up to 512 that is a multiple
    of 8, else the whole run (tiles cut the run exactly: no padding inside a ring)."""
    for size in range(min(_BLOCK, run), 0, -1):
        if run % size == 0 and (size % 8 == 0 or size == run):
            return size
    return run


def attend(q: Array, k: Array, v: Array, *, mask: AttentionMask, bias: Optional[Array], mesh: Any,
           plan: AttentionPlan, implementation: str, scale: float, blocks: Any = None) -> Array:
    """Attention of q [B, T, N, H] over k/v [B, T, K, H*] with the sequence sharded over
    ``mesh``'s context axis, keys and values passing around the ring (module doc; the signature
    of every strategy, :mod:`goat_jax.kernels.strategies`). The mask's key padding and kv lengths
    travel with their keys as one validity mask; segment ids travel too. ``blocks``: the block
    kernels (:mod:`goat_jax.kernels.ring_blocks`); None: those of ``implementation``'s row
    (its ``ring_blocks``). Returns [B, T, N, Hv]; rows with no visible key are zeros (no
    gradient)."""
    axis, balanced = plan.context_axis, plan.load_balanced
    c = mesh_lib.context_shards(mesh, axis)
    b, t, n, hqk = q.shape
    s, kh = k.shape[1], k.shape[2]
    check_shardable(t, s, mask, c, balanced, implementation, strategy=NAME)
    if bias is not None:
        raise ValueError("context_strategy='ring' cannot take an additive bias (ALiBi as a bias, FIRE, Kerple): "
                         "the bias would travel as a T x T tensor. Use context_strategy='all_gather' or an "
                         "encoding packed into q/k ('alibi_packed', GOAT, RoPE).")
    if mask.window is not None:
        raise ValueError("context_strategy='ring' takes no sliding window (AttentionPlan.window).")
    runs = 2 if balanced and mask.causal else 1
    run = t // c // runs
    precision = lax.Precision.HIGHEST if jnp.result_type(q, k, v) == jnp.float32 else None
    if blocks is None:
        row = caps.CAPABILITIES[implementation]
        gap = kernel_gap(row, key_masks=False)
        if gap is not None:
            raise ValueError(f"implementation={implementation!r} cannot take {gap[0]}: {gap[1]}.")
        blocks = row.ring_blocks.make(block_length(run), precision)
    cfg = _Ring(c, balanced, mask.causal, int(mask.offset) if mask.causal else 0, float(scale), run, runs,
                block_length(run), precision, axis, blocks)
    keep = mask.key_keep(s)  # [B, S] or None: padding and lengths, as one mask that travels
    specs = mesh_lib.partition(mesh, b, n, kh, axis).specs(length=axis)

    def local(q_, k_, v_, keep_, q_ids_, kv_ids_):
        bl, tl, nl, _ = q_.shape
        khl = k_.shape[2]
        qb = jnp.moveaxis(q_.reshape(bl, tl, khl, nl // khl, q_.shape[-1]), 1, 3)  # [B, K, G, Tl, H]
        out = _ring(cfg, qb, jnp.moveaxis(k_, 1, 2), jnp.moveaxis(v_, 1, 2), keep_, q_ids_, kv_ids_)
        return jnp.moveaxis(out, 3, 1).reshape(bl, tl, nl, v_.shape[-1])

    args = [q, k, v, keep, mask.q_segment_ids, mask.kv_segment_ids]
    in_specs = [specs.q, specs.kv, specs.kv, specs.rows, specs.rows, specs.rows]
    present = [a is not None for a in args]
    fn = lambda *xs: local(*_fill(xs, present))
    out = jax.shard_map(fn, mesh=mesh, in_specs=tuple(sp for sp, p in zip(in_specs, present) if p),
                        out_specs=specs.q, check_vma=False)(*[a for a in args if a is not None])
    # A row that saw no key in any block is already zero with zero gradient (its weights in the
    # merge are 0, and its log-sum-exp is +inf in the backward): the kernels' contract holds
    # without a T x S look, which the load-balanced order would also make wrong here.
    return out


def _fill(xs, present):
    """The positional arguments with None where an optional one was left out."""
    it = iter(xs)
    return [next(it) if p else None for p in present]


STRATEGY = strategies.Strategy(
    name=NAME, attend=attend,
    summary="keys and values pass around the ring (K/V memory O(T / c)); blocks on splash, cuDNN or flash",
    kernel_gap=kernel_gap, check_run=check_run, report=_report)
