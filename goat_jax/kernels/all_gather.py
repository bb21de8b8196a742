"""Context parallelism: one sequence sharded over the ``context`` mesh axis (docs/training.md,
Long context), the all-gather strategy.

With ``mesh.context = c > 1`` every activation ``[B, T, ...]`` is split over T (the logical
axis ``'length'`` maps to ``'context'``, :data:`goat_jax.train.sharding.DEFAULT_RULES`), so a
device holds T / c tokens of each of its sequences. Everything in the model is token-wise except
attention, which here runs under ``jax.shard_map``: queries stay sharded, keys and values are
all-gathered over ``context`` (MaxText's default strategy) and every device attends its own
queries to all keys with the ordinary kernels. GOAT's prior travels inside the packed key
channels, so gathering K gathers the prior with it; an additive bias (ALiBi as a bias, Kerple,
FIRE) is sharded by its query rows like the queries.

Positions are global. The layers compute positions in the global program (``arange(T)``, or the
explicit positions a batch carries), before the shard_map splits anything, so every shard sees
the positions of the unsharded run. Only the causal mask depends on where a shard's queries sit:
a shard's queries start at its index times T / c, which moves the mask's offset
(:meth:`goat_jax.kernels.mask.AttentionMask.shifted`). Under load balancing
(:mod:`goat_jax.kernels.balance`) a shard holds two chunks; the gathered keys are put back in
sequence order and each chunk attends with its own offset.

What cannot run sharded is refused with the field to change: decoding and cross-attention (keys
of another length than the queries), attention probabilities (``return_probs``), FoX under load
balancing (its forget gates are a cumulative sum along the sequence order), and a length that is
not a multiple of ``c`` (``2c`` balanced; times 128 for splash).
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from goat_jax.kernels import mesh as mesh_lib
from goat_jax.kernels import strategies
from goat_jax.kernels.balance import check_length, natural_order
from goat_jax.kernels.capabilities import CAPABILITIES
from goat_jax.kernels.local import attend_local
from goat_jax.kernels.mask import AttentionMask
from goat_jax.kernels.plan import AttentionPlan

Array = jax.Array

NAME = "all_gather"


def check_shardable(t: int, s: int, mask: AttentionMask, c: int, balanced: bool, implementation: str,
                    strategy: str) -> None:
    """Raises ValueError naming the fix when attention of ``t`` queries and ``s`` keys under
    ``mask`` cannot be split over ``c`` context shards (either strategy): keys of another length
    than the queries (decoding against a cache, cross-attention), a traced causal offset, or a
    length the shards (and their chunks) do not divide."""
    how = f"mesh.context={c}" + ("" if strategy == NAME else f" with context_strategy={strategy!r}")
    if t != s:
        raise ValueError(
            f"{how} shards self-attention over one sequence, but the queries have {t} positions and the "
            f"keys {s} (decoding against a cache, or cross-attention). Run decoding and cross-attention "
            "with mesh.context=1.")
    if not mask.static_offset:
        raise ValueError(f"{how} needs a static causal offset (got a traced one, as while decoding); "
                         "decode with mesh.context=1.")
    check_length(t, c, balanced, implementation, field="sequence length")


def attend(q: Array, k: Array, v: Array, *, mask: AttentionMask, bias: Optional[Array], mesh: Any,
           plan: AttentionPlan, implementation: str, scale: float) -> Array:
    """Attention with the sequence sharded over ``mesh``'s context axis (module doc; the
    signature of every strategy, :mod:`goat_jax.kernels.strategies`): queries sharded, keys,
    values, key masks and key segment ids all-gathered, each device's queries attending with the
    causal offset of their place, on kernel ``implementation``
    (:func:`goat_jax.kernels.local.attend_local`); q [B, T, N, H] with T == S; the sequences are
    in load-balanced order when ``plan.load_balanced``."""
    axis, balanced = plan.context_axis, plan.load_balanced
    c = mesh_lib.context_shards(mesh, axis)
    b, t, n, _ = q.shape
    s, kh = k.shape[1], k.shape[2]
    check_shardable(t, s, mask, c, balanced, implementation, NAME)
    # The batch and head axes as splash splits them (never the context axis); c > 1, so a layout.
    layout = mesh_lib.partition(mesh, b, n, kh, axis)
    shard_specs = layout.specs(length=axis)
    bx, hx = shard_specs.batch[0], shard_specs.q[2]
    q_spec, kv_spec, row_spec = shard_specs.q, shard_specs.kv, shard_specs.rows

    def local(q_, k_, v_, mask_, bias_):
        return attend_local(q_, k_, v_, mask_, bias_, implementation=implementation, scale=scale, plan=plan)

    names, args, specs = [], [], []

    def add(name, value, spec):
        if value is not None:
            names.append(name)
            args.append(value)
            specs.append(spec)

    add("q", q, q_spec)
    add("k", k, kv_spec)
    add("v", v, kv_spec)
    add("key_padding", mask.key_padding, row_spec)
    add("kv_lengths", mask.kv_lengths, shard_specs.batch)
    add("q_segment_ids", mask.q_segment_ids, row_spec)
    add("kv_segment_ids", mask.kv_segment_ids, row_spec)
    if bias is not None:
        add("bias", bias, P(bx if bias.shape[0] == b else None, hx if bias.shape[1] == n else None, axis, None))

    local_t = t // c
    chunk = t // (2 * c)

    def gather(x, dim):
        x = jax.lax.all_gather(x, axis, axis=dim, tiled=True)
        return natural_order(x, c, dim) if balanced else x

    def gathered(values):
        """This device's arrays, keys and their masks all-gathered (in sequence order)."""
        a = dict(zip(names, values))
        for name in ("k", "v", "key_padding", "kv_segment_ids"):
            if name in a:
                a[name] = gather(a[name], 1)
        if balanced and "bias" in a:
            a["bias"] = natural_order(a["bias"], c, 3)  # its key axis, whole on every device
        return a

    def shard_fn(index, a):
        """One device: its queries (and their bias rows / ids) against all keys, the shard's
        place ``index`` given statically (splash) or traced (every other kernel)."""
        # The queries' runs of sequence positions: (start, first row, rows).
        if balanced:
            runs = ((index * chunk, 0, chunk), ((2 * c - 1 - index) * chunk, chunk, chunk))
        else:
            runs = ((index * local_t, 0, local_t),)
        if not mask.causal and mask.window is None and len(runs) > 1:
            runs = ((0, 0, local_t),)  # no mask depends on where the queries are
        whole = mask.replace(key_padding=a.get("key_padding"), kv_lengths=a.get("kv_lengths"),
                             kv_segment_ids=a.get("kv_segment_ids"))
        outs = []
        for start, row, rows in runs:
            cut = lambda x, dim: jax.lax.slice_in_dim(x, row, row + rows, axis=dim)
            part = whole.shifted(start, 0)
            if "q_segment_ids" in a:
                part = part.replace(q_segment_ids=cut(a["q_segment_ids"], 1))
            outs.append(local(cut(a["q"], 1), a["k"], a["v"], part,
                              None if "bias" not in a else cut(a["bias"], 2)))
        return outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=1)

    static_offsets = CAPABILITIES[implementation].static_masks and mask.causal

    def run(*values):
        a = gathered(values)  # once, outside any branch
        index = jax.lax.axis_index(axis)
        if static_offsets:  # splash builds its masks statically: one branch per place
            branches = [functools.partial(shard_fn, j) for j in range(c)]
            return jax.lax.switch(index, branches, a)
        return shard_fn(index, a)

    return jax.shard_map(run, mesh=layout.mesh, in_specs=tuple(specs), out_specs=q_spec,
                         check_vma=False)(*args)


STRATEGY = strategies.Strategy(
    name=NAME, attend=attend, summary="every device gathers all keys and values (K/V memory O(T)); any kernel",
    detour="gathered_causal", ragged_segments=True)  # each shard's causal mask sits at its own offset (a row's detours say how it runs it)
