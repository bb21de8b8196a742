"""Context parallelism: one sequence sharded over the ``context`` mesh axis (docs/training.md,
Long context).

With ``mesh.context = c > 1`` every activation ``[B, T, ...]`` is split over T (the logical
axis ``'length'`` maps to ``'context'``, :data:`goat_jax.train.sharding.DEFAULT_RULES`), so a
device holds T / c tokens of each of its sequences. Everything in the model is token-wise except
attention, which here runs under ``jax.shard_map``: queries stay sharded, keys and values are
all-gathered over ``context`` (MaxText's default strategy) and every device attends its own
queries to all keys with the ordinary kernels of :mod:`goat_jax.kernels`. GOAT's prior travels
inside the packed key channels, so gathering K gathers the prior with it; an additive bias
(ALiBi as a bias, Kerple, FIRE) is sharded by its query rows like the queries.

Positions are global. The layers compute positions in the global program (``arange(T)``, or the
explicit positions a batch carries), before the shard_map splits anything, so every shard sees
the positions of the unsharded run. Only the causal mask depends on where a shard's queries sit:
the mask of the kernels is "key ``j`` is seen iff ``j <= i + offset``" in sequence indices, and
a shard's queries start at its index times T / c, which is the ``offset`` it passes.

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

What cannot run sharded is refused with the field to change: decoding and cross-attention (keys
of another length than the queries), attention probabilities (``return_probs``), FoX under load
balancing (its forget gates are a cumulative sum along the sequence order), and a length that is
not a multiple of ``c`` (``2c`` balanced; times 128 for splash).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from typing import Any, Callable, Dict, Iterator, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

Array = jax.Array

AXIS = "context"  # the mesh axis a sequence is split over
BALANCE_FIELD = "context_load_balance"  # the config field (top level) that turns balancing on
_SPLASH = ("splash", "splash_interpret")  # the kernels with static masks and 128-token blocks

_balanced: contextvars.ContextVar = contextvars.ContextVar("goat_jax_context_balanced", default=False)


@contextlib.contextmanager
def load_balanced(on: bool = True) -> Iterator[None]:
    """While tracing inside the ``with``, attention under context parallelism expects its
    sequences in :func:`balance_order` (the engine enters it when ``context_load_balance`` is
    set, around the same function whose batch :func:`balance_batch` reordered)."""
    token = _balanced.set(bool(on))
    try:
        yield
    finally:
        _balanced.reset(token)


def is_balanced() -> bool:
    """Whether the code being traced runs in :func:`load_balanced` order."""
    return bool(_balanced.get())


def shards() -> int:
    """The size of the ``context`` axis of the mesh in context, 1 when there is none (no mesh,
    no such axis, or the axis already manual: inside a shard_map every device holds its shard)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or AXIS not in mesh.axis_names or AXIS in set(getattr(mesh, "manual_axes", ())):
        return 1
    return int(mesh.shape[AXIS])


def length_multiple(num_shards: int, balanced: bool, implementation: Optional[str] = None) -> int:
    """What a sequence length must be a multiple of to run over ``num_shards`` context shards:
    the shards (twice as many chunks when ``balanced``), times splash's 128-token blocks when the
    kernel is splash (every chunk a shard attends must be whole blocks)."""
    if num_shards <= 1:
        return 1
    chunks = num_shards * (2 if balanced else 1)
    if implementation in _SPLASH:
        from goat_jax import splash as splash_lib  # pylint: disable=g-import-not-at-top
        chunks *= splash_lib.BLOCK
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
        if implementation in _SPLASH:
            parts.append("splash's 128-token blocks per chunk")
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
    (:func:`balance_batch`) and traced inside :func:`load_balanced`, so attention knows the order."""
    @functools.wraps(step)
    def wrapped(first, batch):
        with load_balanced():
            return step(first, balance_batch(batch, seq_len, num_shards))
    return wrapped


def balanced_if_asked(step: Callable[..., Any], config: Any, mesh: Any) -> Callable[..., Any]:
    """:func:`balanced_step` of ``step`` when the run's ``config`` asks for load balancing and
    ``mesh`` has a ``context`` axis of more than one device; else ``step`` itself."""
    num_shards = dict(mesh.shape).get(AXIS, 1)
    if num_shards <= 1 or not bool(config.get(BALANCE_FIELD, False)):
        return step
    return balanced_step(step, int(config.seq_len), num_shards)


def check_config(config: Any, num_shards: int, task_name: str) -> None:
    """The checks of ``mesh.context`` (resolved to ``num_shards``) and ``context_load_balance``
    of a run's config, before any work: a task with a ``seq_len``, which the shards (and their
    chunks, and splash's blocks) divide, and no encoding that cannot run reordered. Raises
    ValueError naming the field and the fix."""
    if num_shards <= 1:
        return  # one shard: nothing is split, and the balanced order is the identity
    balanced = bool(config.get(BALANCE_FIELD, False))
    if "seq_len" not in config:
        raise ValueError(
            f"mesh.context={num_shards} splits each sequence over devices, but the {task_name!r} task "
            "has no seq_len (sequences of its own length, e.g. a ViT's patches); use mesh.context=1.")
    model = config.get("model") or {}
    check_length(int(config.seq_len), num_shards, balanced, model.get("implementation"), field="seq_len")
    if balanced and model.get("position_encoding") == "fox":
        raise ValueError(
            f"{BALANCE_FIELD}=True reorders each sequence, but FoX's forget gates are a cumulative "
            f"sum along the sequence order (goat_jax/positional/fox.py). Set {BALANCE_FIELD}=False "
            "(FoX runs under mesh.context > 1 unbalanced).")


def _spec_axes(axes: Tuple[str, ...]) -> Any:
    return None if not axes else (axes[0] if len(axes) == 1 else axes)


def attend(q: Array, k: Array, v: Array, *, local: Callable[..., Array], is_causal: bool,
           causal_offset: Any, key_padding_mask: Optional[Array], kv_lengths: Optional[Array],
           segments: Optional[Tuple[Array, Array]], bias: Optional[Array],
           implementation: str) -> Array:
    """Attention with the sequence sharded over ``context`` (module doc): queries sharded, keys,
    values, key masks and key segment ids all-gathered, each device's queries attending with the
    causal offset of their place. ``local(q, k, v, causal_offset=, key_padding_mask=,
    kv_lengths=, segments=, bias=)`` is the kernel call on one device's arrays
    (:func:`goat_jax.kernels.attend`). Arguments and result as that function's; q [B, T, N, H]
    with T == S."""
    from goat_jax import splash as splash_lib  # pylint: disable=g-import-not-at-top  # the mesh layout

    c = shards()
    balanced = is_balanced()
    b, t, n, _ = q.shape
    s, kh = k.shape[1], k.shape[2]
    if t != s:
        raise ValueError(
            f"mesh.context={c} shards self-attention over one sequence, but the queries have {t} "
            f"positions and the keys {s} (decoding against a cache, or cross-attention). Run "
            "decoding and cross-attention with mesh.context=1.")
    if not isinstance(causal_offset, (int, np.integer)):
        raise ValueError(f"mesh.context={c} needs a static causal_offset (got a traced one, as "
                         "while decoding); decode with mesh.context=1.")
    check_length(t, c, balanced, implementation, field="sequence length")
    # The batch and head axes as splash splits them (never the context axis); c > 1, so a layout.
    mesh, batch_axes, head_axes, shard_kv = splash_lib.partition(b, n, kh)
    bx, hx = _spec_axes(batch_axes), _spec_axes(head_axes)
    kvh = hx if shard_kv else None
    q_spec = P(bx, AXIS, hx, None)
    kv_spec = P(bx, AXIS, kvh, None)
    row_spec = P(bx, AXIS)

    names, args, specs = [], [], []

    def add(name, value, spec):
        if value is not None:
            names.append(name)
            args.append(value)
            specs.append(spec)

    add("q", q, q_spec)
    add("k", k, kv_spec)
    add("v", v, kv_spec)
    add("key_padding_mask", key_padding_mask, row_spec)
    add("kv_lengths", kv_lengths, P(bx))
    if segments is not None:
        add("q_segments", segments[0], row_spec)
        add("kv_segments", segments[1], row_spec)
    if bias is not None:
        add("bias", bias, P(bx if bias.shape[0] == b else None, hx if bias.shape[1] == n else None, AXIS, None))

    local_t = t // c
    chunk = t // (2 * c)

    def gather(x, axis):
        x = jax.lax.all_gather(x, AXIS, axis=axis, tiled=True)
        return natural_order(x, c, axis) if balanced else x

    def gathered(values):
        """This device's arrays, keys and their masks all-gathered (in sequence order)."""
        a = dict(zip(names, values))
        for name in ("k", "v", "key_padding_mask", "kv_segments"):
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
        if not is_causal and len(runs) > 1:
            runs = ((0, 0, local_t),)  # no mask depends on where the queries are
        outs = []
        for start, row, rows in runs:
            cut = lambda x, axis: jax.lax.slice_in_dim(x, row, row + rows, axis=axis)
            seg = None if "kv_segments" not in a else (cut(a["q_segments"], 1), a["kv_segments"])
            outs.append(local(
                cut(a["q"], 1), a["k"], a["v"],
                causal_offset=causal_offset + start if is_causal else causal_offset,
                key_padding_mask=a.get("key_padding_mask"), kv_lengths=a.get("kv_lengths"), segments=seg,
                bias=None if "bias" not in a else cut(a["bias"], 2)))
        return outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=1)

    static_offsets = implementation in _SPLASH and is_causal

    def run(*values):
        a = gathered(values)  # once, outside any branch
        index = jax.lax.axis_index(AXIS)
        if static_offsets:  # splash builds its masks statically: one branch per place
            branches = [functools.partial(shard_fn, j) for j in range(c)]
            return jax.lax.switch(index, branches, a)
        return shard_fn(index, a)

    return jax.shard_map(run, mesh=mesh, in_specs=tuple(specs), out_specs=q_spec,
                         check_vma=False)(*args)
