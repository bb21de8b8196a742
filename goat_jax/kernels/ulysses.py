"""All-to-all context parallelism over heads ("Ulysses", DeepSpeed-Ulysses;
``config.context_strategy = 'ulysses'``; docs/training.md, Long context).

With ``c`` context shards every device holds ``T / c`` positions of q, k and v for all its heads.
One ``jax.lax.all_to_all`` per array trades that for **all T positions of ``1 / c`` of the
heads**: device ``i`` sends head group ``j`` of its positions to device ``j`` and receives its own
head group ``i`` of every device's positions. Each device then runs the ordinary kernel on the
whole sequence (the mask is the global one: the native causal mode, cuDNN's packed layout for
segment ids, splash with its segment ids, flash, xla, dense; no per-shard offset, no ring blocks),
and a second all-to-all trades the output back to sequence shards. Both are inside the same
``jax.shard_map`` the other strategies use; the backward pass is JAX's transpose of the
exchanges (two all-to-alls of the gradients the other way) around the kernel's own backward.

Costs: per attention call, four all-to-alls forward (q, k, v out; the output back) and four
backward, each moving ``(c - 1) / c`` of a ``B x T / c x heads x d`` shard, i.e. about
``B x T x N x d / c`` per device per array; per-device K/V is the whole sequence of ``K / c``
KV heads, ``2 x B x T x K x d / c``, the ring's ``O(T / c)`` without its ``c`` sequential steps.

What it requires:

* **Query heads divisible by c** (per device: after the ``tensor`` axis splits them). Refused in
  one line naming ``model.num_heads`` and ``mesh.context``, before any work (:func:`check_run`)
  and again at trace time (:func:`attend`) for a hand-built layer.
* **KV heads**: when a device's ``K`` KV heads are not a multiple of ``c`` (fewer than c, say,
  MQA), each is repeated ``lcm(K, c) / K`` times before the exchange, so every device gets whole
  KV heads that match its query heads (GQA groups are contiguous). That multiplies the K/V each
  device exchanges and holds by the same factor; the first trace logs the bytes per layer.
* **No load balancing needed**: every device attends the whole sequence for its heads, so a
  causal mask gives every device the same work. ``context_load_balance=True`` is still exact (the
  gathered sequence is put back in natural order before the kernel, and the output back in
  balanced order after it: two reorders, no benefit); the log line says so.
* Self-attention over one sequence with a static causal offset: decoding against a KV cache and
  cross-attention are refused in one line (:func:`goat_jax.kernels.all_gather.check_shardable`).

GOAT's prior. The layer packs the prior into q/k in the global program, before attention is
called, so each shard packs its own positions and the exchange carries the packed width (66
lanes instead of 64 for q and k: +3% of the q/k bytes, none on v). Packing after the exchange
would save those 3% but need the layer to hand over unpacked q/k and the positions (the prior's
features for all T positions of ``N / c`` heads: the same work in total); the packed layout is
the kernels' contract, so the strategy takes it as it comes.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from goat_jax.kernels import capabilities as caps
from goat_jax.kernels import mesh as mesh_lib
from goat_jax.kernels import strategies
from goat_jax.kernels.balance import STRATEGY_FIELD, natural_order
from goat_jax.kernels.all_gather import check_shardable
from goat_jax.kernels.local import attend_local
from goat_jax.kernels.mask import AttentionMask
from goat_jax.kernels.plan import AttentionPlan

Array = jax.Array
NAME = "ulysses"


def kv_repeats(kv_heads: int, c: int) -> int:
    """How many times each of a device's ``kv_heads`` KV heads is repeated so that ``c`` devices
    get whole, matching KV heads: ``lcm(kv_heads, c) / kv_heads`` (1 when c divides them)."""
    return math.lcm(kv_heads, c) // kv_heads


def heads_refusal(heads: int, c: int, where: str) -> Optional[str]:
    """The one-line refusal of ``heads`` query heads per device (``where``: how the caller names
    them) over ``c`` context shards, or None when c divides them."""
    if heads % c == 0:
        return None
    divisors = [d for d in range(2, heads + 1) if heads % d == 0]
    return (f"{STRATEGY_FIELD}={NAME!r} splits the query heads over mesh.context={c}, but {where} is {heads}, "
            f"not a multiple of {c}: choose mesh.context among {divisors or 'none (one head)'}, or "
            f"{STRATEGY_FIELD}='ring' (or 'all_gather'), which split the sequence instead.")


def _repeat_note(kv_heads: int, c: int, kv_bytes: int) -> str:
    """The log line of KV heads repeated for the exchange (module doc): the factor and the bytes
    per device and layer it adds (``kv_bytes``: K and V of one device's head group at full length
    before repetition, both)."""
    r = kv_repeats(kv_heads, c)
    return (f"goat_jax: {STRATEGY_FIELD}={NAME!r} over mesh.context={c} repeats each of a device's {kv_heads} KV "
            f"heads {r}x (to {kv_heads * r}, so each device gets whole KV heads for its query heads): K/V exchanged "
            f"and held are {r}x an even split, +{(r - 1) * kv_bytes / 2**20:.1f} MiB per device and layer "
            f"(forward; as much again for their gradients).")


def _head_axes(spec_entry: Any, axis: str) -> Any:
    """A PartitionSpec entry splitting heads over the layout's head axes, then ``axis`` (the
    order the exchange splits a device's heads in: its contiguous groups)."""
    axes = () if spec_entry is None else (spec_entry if isinstance(spec_entry, tuple) else (spec_entry,))
    return axes + (axis,) if axes else axis


def _balanced_order(x: Array, c: int, axis: int) -> Array:
    """The inverse of :func:`goat_jax.kernels.balance.natural_order` along ``axis``: the natural
    order of 2c chunks put back so shard ``i`` holds chunks ``i`` and ``2c - 1 - i``."""
    axis = axis % x.ndim
    m = x.shape[axis] // (2 * c)
    split = x.reshape(x.shape[:axis] + (2, c, m) + x.shape[axis + 1:])
    first = lax.index_in_dim(split, 0, axis, keepdims=False)  # chunks 0 .. c-1
    second = jnp.flip(lax.index_in_dim(split, 1, axis, keepdims=False), axis)  # 2c-1 .. c
    return jnp.stack([first, second], axis=axis + 1).reshape(x.shape)


def attend(q: Array, k: Array, v: Array, *, mask: AttentionMask, bias: Optional[Array], mesh: Any,
           plan: AttentionPlan, implementation: str, scale: float) -> Array:
    """Attention of q [B, T, N, H] over k/v [B, T, K, H*] with the sequence sharded over
    ``mesh``'s context axis, exchanged for whole sequences of ``1 / c`` of the heads (module doc;
    the signature of every strategy, :mod:`goat_jax.kernels.strategies`). Segment ids and key
    padding are all-gathered (``[B, T]`` integers and booleans), kv lengths and the bias's head
    groups go to their devices whole; kernel ``implementation`` runs on the whole sequence under
    the global mask. Returns [B, T, N, Hv]; rows with no visible key are zeros."""
    axis, balanced = plan.context_axis, plan.load_balanced
    c = mesh_lib.context_shards(mesh, axis)
    b, t, n, _ = q.shape
    s, kh = k.shape[1], k.shape[2]
    check_shardable(t, s, mask, c, balanced, implementation, NAME)
    layout = mesh_lib.partition(mesh, b, n, kh, axis)
    specs = layout.specs(length=axis)
    split = math.prod(int(mesh.shape[a]) for a in layout.head_axes)
    local_heads = n // split
    why = heads_refusal(local_heads, c, "model.num_heads" if split == 1 else
                        f"num_heads={n} over the head axes {layout.head_axes} ({split} devices), per device,")
    if why is not None:
        raise ValueError(why)
    local_kv = kh // split if layout.shard_kv else kh
    repeats = kv_repeats(local_kv, c)
    if repeats > 1:
        per_group = (b // math.prod(int(mesh.shape[a]) for a in layout.batch_axes)) * t * local_kv // c
        kv_bytes = per_group * (k.shape[-1] * k.dtype.itemsize + v.shape[-1] * v.dtype.itemsize)
        from goat_jax.kernels.choice import log_once  # pylint: disable=g-import-not-at-top  # choice imports the table
        log_once(_repeat_note(local_kv, c, kv_bytes))
    same_ids = mask.q_segment_ids is mask.kv_segment_ids  # self-attention: one array, as cuDNN's packed layout needs

    names, args, in_specs = [], [], []

    def add(name, value, spec):
        if value is not None:
            names.append(name)
            args.append(value)
            in_specs.append(spec)

    add("q", q, specs.q)
    add("k", k, specs.kv)
    add("v", v, specs.kv)
    add("key_padding", mask.key_padding, specs.rows)
    add("kv_lengths", mask.kv_lengths, specs.batch)
    add("q_segment_ids", mask.q_segment_ids, specs.rows)
    if not same_ids:
        add("kv_segment_ids", mask.kv_segment_ids, specs.rows)
    if bias is not None:  # [B|1, N|1, T, S]: each device's head group, whole
        bx = specs.batch[0]
        add("bias", bias, P(bx if bias.shape[0] == b else None,
                            _head_axes(specs.q[2], axis) if bias.shape[1] == n else None, None, None))

    def whole(x, dim):
        """The gathered sequence along ``dim``, in natural order."""
        return natural_order(x, c, dim) if balanced else x

    def local(*values):
        a = dict(zip(names, values))
        q_, k_, v_ = a["q"], a["k"], a["v"]
        if repeats > 1:
            k_, v_ = jnp.repeat(k_, repeats, axis=2), jnp.repeat(v_, repeats, axis=2)
        # [B, T/c, heads, H] -> [B, T, heads/c, H]: this device's head group, every position.
        to_heads = lambda x: whole(lax.all_to_all(x, axis, 2, 1, tiled=True), 1)
        gather = lambda x: whole(lax.all_gather(x, axis, axis=1, tiled=True), 1)
        ids = gather(a["q_segment_ids"]) if "q_segment_ids" in a else None
        kv_ids = gather(a["kv_segment_ids"]) if "kv_segment_ids" in a else ids
        full = mask.replace(key_padding=gather(a["key_padding"]) if "key_padding" in a else None,
                            kv_lengths=a.get("kv_lengths"), q_segment_ids=ids, kv_segment_ids=kv_ids)
        bias_ = a.get("bias")
        if bias_ is not None and balanced:
            bias_ = natural_order(natural_order(bias_, c, 2), c, 3)
        out = attend_local(to_heads(q_), to_heads(k_), to_heads(v_), full, bias_, implementation=implementation,
                           scale=scale, plan=plan)
        if balanced:
            out = _balanced_order(out, c, 1)
        return lax.all_to_all(out, axis, 1, 2, tiled=True)  # back: [B, T/c, heads, Hv]

    return jax.shard_map(local, mesh=layout.mesh, in_specs=tuple(in_specs), out_specs=specs.q,
                         check_vma=False)(*args)


def check_run(run: strategies.Run) -> None:
    """Ulysses's refusals of a run's config before any work (the strategy's ``check_run``): query
    heads (per device, after ``mesh.tensor`` splits them) that ``mesh.context`` does not divide.
    KV heads it does not divide are repeated, not refused (module doc; logged when traced)."""
    if run.num_heads is None:
        return
    per_device, where = run.num_heads, "model.num_heads"
    if run.head_shards > 1 and run.num_heads % run.head_shards == 0:
        per_device //= run.head_shards
        where = f"model.num_heads={run.num_heads} over mesh.tensor={run.head_shards}, per device,"
    why = heads_refusal(per_device, run.num_shards, where)
    if why is not None:
        raise ValueError(why)


def _report(row: caps.Capability) -> dict:
    """What the choice's log line and compile.json say of Ulysses on kernel ``row``: the kernel
    each device runs on the whole sequence (``whole_sequence``: the row's own name)."""
    return {"whole_sequence": row.name}


STRATEGY = strategies.Strategy(
    name=NAME, attend=attend,
    summary=("all-to-all over heads: each device runs any kernel on the whole sequence for 1 / c of the heads "
             "(K/V memory O(T K / c)); heads divisible by c"),
    check_run=check_run, report=_report, whole_sequences=True)
