"""Attention kernels behind one switch: ``implementation=`` 'xla' | 'flash' | 'cudnn' |
'splash' | 'splash_interpret' | 'dense' | None (automatic).

Every kernel here computes plain ``softmax(q . k * scale + mask) v`` with *no additive bias*:
GOAT's prior is packed into extra q/k channels (``goat_jax.attention``), so an unmodified flash
kernel runs it exactly. Shape legend: B batch, T queries, S keys, N query heads, K kv heads
(N % K == 0, grouped-query attention), Hqk q/k head dim, Hv value head dim.

Masking contract (shared by all kernels):
  * ``is_causal``: query ``i`` sees key ``j`` iff ``j <= i + causal_offset`` (sequence indices;
    ``causal_offset`` = position of query 0 minus position of key 0, e.g. the cache index
    while decoding). Offset 0 lets the kernels use their native causal mode.
  * ``key_padding_mask``: [B, S] bool, **True = padding (ignored)**, the PyTorch/official
    convention.
  * ``kv_lengths``: [B] int32, keys at index >= length are ignored (right padding; native on
    cuDNN).
  * ``segment_ids`` (document-aware packing): integer ids, query ``i`` sees key ``j`` only if
    ``q_segment_ids[b, i] == kv_segment_ids[b, j]``. Pass one ``segment_ids`` [B, T] for
    self-attention (T == S), or ``q_segment_ids`` [B, T] and ``kv_segment_ids`` [B, S] (a
    cache, cross-attention). Ids are compared for equality only: no value is reserved, any
    integers are exact on every kernel. Padding: exclude padded keys with
    ``key_padding_mask``/``kv_lengths`` as without segments, or give the padding its own id
    (the data packer, :mod:`goat_jax.data.packing`, gives trailing padding
    ``PAD_SEGMENT_ID`` = int32 max, so padding tokens see only each other and ids stay
    non-decreasing). 'flash' skips a tile when no query id of its block can equal a key id of
    its block (``[min, max]`` ranges per block; on one device each example on its own, see
    :func:`goat_jax.flash.flash_attention`); that is effective when each row's ids are
    non-decreasing along the sequence (packed documents), and still exact, only slower, when
    they are not. 'cudnn' refuses segment ids (see :func:`attend`).
Context parallelism: on a mesh whose ``context`` axis has more than one device, :func:`attend`
runs the kernel under ``jax.shard_map`` on each device's queries against all-gathered keys
(:mod:`goat_jax.context`), with the same contract and results.
A query row with no visible key (every key padded, before the first key under causal
masking with a negative offset, or no key of its segment) outputs **zeros on every kernel**,
and no gradient flows through it: the kernels themselves disagree there (NaN from a dense
softmax over ``-inf`` logits, a uniform average of the values from XLA and splash), so
:func:`attend` selects zeros for such rows after the kernel (:func:`rows_with_keys`,
O(B (S + T)), or O(B (S + T) log S) with segment ids; no T x S mask on flash paths).

Kernels: 'xla' (``jax.nn.dot_product_attention``'s XLA path: materializes the T x S logits),
'flash' (:mod:`goat_jax.flash`: pure-JAX online-softmax attention with a recomputing custom
VJP, memory linear in T and S, fully masked causal blocks skipped; any backend and dtype),
'cudnn' (GPU, bf16/fp16), 'splash' / 'splash_interpret' (Pallas TPU, :mod:`goat_jax.splash`;
interpret mode on CPU; under ``jax.shard_map`` on a mesh), 'dense' (the materialized float32
reference).

Automatic choice (``None``, for the devices the computation runs on: :func:`target_platform`):
cuDNN on GPU for bf16/fp16 when the packed head dim fits, splash on TPU for lengths of at least
128 (padded to whole 128-blocks, exactly; multiples of every chunk's blocks under context
parallelism); otherwise (CPU, or GPU in float32) 'flash' when XLA would materialize more than
``FLASH_THRESHOLD_BYTES`` (16 MiB) of float32 logits, ``B * N * T * S * 4`` bytes, else 'xla'.
Why 16 MiB: XLA keeps those logits and the probabilities (and their gradients while training),
so its memory grows as L^2 (2.1 GiB for one B=1, 8-head layer at L=4096), and on CPU the flash
kernel is already faster from L = 1024 at 8 heads (32 MiB of logits; benchmarks/attention.md);
below the threshold (short sequences, decoding one token against a cache) XLA's single fused
matmul has less loop overhead and its memory is small anyway.
"""

from __future__ import annotations

import contextlib
import logging
import math
from typing import Any, Iterator, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from goat_jax import context as context_lib
from goat_jax import flash as flash_lib
from goat_jax import splash as splash_lib

Array = jax.Array

IMPLEMENTATIONS = ("xla", "flash", "cudnn", "splash", "splash_interpret", "dense")
FLASH_THRESHOLD_BYTES = 16 * 2**20  # automatic choice: 'flash' above this many float32 logits bytes
_CUDNN_MAX_HEAD_DIM = 256  # Hopper; 128 on older GPUs.
_SPLASH_BLOCK = splash_lib.BLOCK  # splash block sizes must be multiples of the TPU lane count.

_logger = logging.getLogger("goat_jax")
_logged: set = set()
_choices: list = []  # the open record_choices() lists


@contextlib.contextmanager
def record_choices() -> Iterator[list]:
    """Collects every kernel choice made while tracing inside the ``with`` (one dict per
    :func:`resolve_implementation` call: implementation, packed q/k dim ``qk_dim``, dtype,
    platform and where it was read); :mod:`goat_jax.aot` reports what a compiled step uses."""
    found: list = []
    _choices.append(found)
    try:
        yield found
    finally:
        _choices.remove(found)


def _record(choice: str, dtype: Any, qk_dim: int, target: Tuple[str, str]) -> str:
    for found in _choices:
        found.append({"implementation": choice, "qk_dim": int(qk_dim), "dtype": jnp.dtype(dtype).name,
                      "platform": target[0], "devices_from": target[1]})
    return choice


def log_once(message: str) -> None:
    """Logs ``message`` at INFO level the first time it is seen in this process."""
    if message not in _logged:
        _logged.add(message)
        _logger.info(message)


_GPU_PLATFORMS = ("gpu", "cuda", "rocm")


def _normal(platform: str) -> str:
    return "gpu" if platform in _GPU_PLATFORMS else platform


def _array_platform(x: Any) -> Optional[Tuple[str, str]]:
    """The platform ``x`` lives on, from its own placement, or None when that is unknown (a
    tracer without a mesh in its type, a NumPy array)."""
    if x is None or not hasattr(x, "shape"):
        return None
    if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
        try:
            device = next(iter(x.sharding.device_set))
        except Exception:  # pylint: disable=broad-except  # deleted or unusual arrays
            return None
        return _normal(device.platform), f"the inputs' devices ({device.device_kind})"
    try:
        mesh = jax.typeof(x).sharding.mesh
    except Exception:  # pylint: disable=broad-except  # no sharding in the type
        return None
    device = getattr(mesh, "abstract_device", None)
    if getattr(mesh, "empty", True) or device is None:
        return None
    return _normal(device.platform), f"the inputs' mesh ({device.device_kind})"


def target_platform(*like: Any) -> Tuple[str, str]:
    """``(platform, where that was read)`` of the devices the computation being traced runs on:
    'cpu', 'gpu' or 'tpu'. The one place the kernels ask which hardware they are for.

    In order: the placement of the arrays ``like`` (concrete arrays' devices; a tracer whose type
    carries a mesh, under explicit sharding); the abstract mesh in context (``jax.set_mesh(mesh)``,
    ``jax.sharding.use_abstract_mesh``, the trainer's :func:`goat_jax.train.sharding.with_mesh_and_rules`),
    whose devices may be another machine's (a TPU topology compiled ahead of time on a CPU host,
    :mod:`goat_jax.aot`); a legacy ``with mesh:``; and only then JAX's default backend (the host's).
    """
    for x in like:
        found = _array_platform(x)
        if found is not None:
            return found
    abstract = jax.sharding.get_abstract_mesh()
    device = getattr(abstract, "abstract_device", None)
    if not abstract.empty and device is not None:
        return _normal(device.platform), f"the mesh in context ({device.device_kind})"
    try:  # `with mesh:` (deprecated) sets only the physical mesh
        from jax._src import mesh as mesh_lib  # pylint: disable=g-import-not-at-top
        physical = mesh_lib.thread_resources.env.physical_mesh
        if not physical.empty:
            device = physical.devices.flat[0]
            return _normal(device.platform), f"the mesh in context ({device.device_kind})"
    except (ImportError, AttributeError):
        pass
    return _normal(jax.default_backend()), "JAX's default backend: no mesh in context"


def _platform() -> str:
    return target_platform()[0]


# Why cuDNN never takes segment ids: said by the automatic choice and by attend's refusal.
_CUDNN_SEGMENTS_WHY = ("jax.nn.dot_product_attention (jax 0.10.2) passes cuDNN only per-example query/key "
                       "lengths (right padding), not its packed-segment offsets")


def _refusal(implementation: str, dtype: Any, qk_dim: int, target: Tuple[str, str]) -> Optional[str]:
    """Why ``implementation`` cannot run for ``dtype``, ``qk_dim`` on ``target`` (see
    :func:`target_platform`), or None: the one list of reasons an explicit choice is refused."""
    platform, where = target
    dtype = jnp.dtype(dtype)
    half = dtype in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    if implementation == "cudnn":
        if platform != "gpu":
            return (f"implementation='cudnn' needs a GPU, but the computation runs on '{platform}' "
                    f"({where}). Use implementation='xla' (or None for automatic choice).")
        if not half:
            return (f"implementation='cudnn' needs bfloat16 or float16 inputs, got {dtype.name}. Set "
                    "the module's dtype=jnp.bfloat16, or use implementation='xla'.")
        if -(-qk_dim // 8) * 8 > _CUDNN_MAX_HEAD_DIM:
            return (f"implementation='cudnn' supports head dims <= {_CUDNN_MAX_HEAD_DIM}; the packed "
                    f"q/k dim is {qk_dim}. Use fewer heads' dims or implementation='xla'.")
    if implementation == "splash" and platform != "tpu":
        hint = (" To compile for TPUs from this host, trace under a mesh of TPU devices "
                "(jax.set_mesh(mesh); docs/aot.md)." if where.startswith("JAX's default") else "")
        return (f"implementation='splash' needs a TPU, but the computation runs on '{platform}' "
                f"({where}). Use 'splash_interpret' to run the same Pallas kernel in interpret mode "
                f"(slow; for tests).{hint}")
    return None


def resolve_implementation(implementation: Optional[str], dtype: Any, qk_dim: int,
                           logits_shape: Optional[Tuple[int, int, int, int]] = None,
                           *, like: Tuple[Any, ...] = (), segments: bool = False) -> str:
    """Validates ``implementation`` or picks one automatically (logged once), for the devices
    the computation runs on (:func:`target_platform` of ``like``, the mesh in context, else the
    default backend): a TPU program traced on a CPU host gets TPU kernels.

    Automatic choice: cuDNN flash attention on GPU when the dtype is bf16/fp16, the packed
    q/k dim fits (<= 256 after padding to a multiple of 8) and the call has no segment ids
    (``segments``: jax's cuDNN path cannot take them); splash attention on TPU when the
    lengths of ``logits_shape`` are at least 128 (splash's block; padded to whole blocks,
    exactly) or, under context parallelism, multiples of every chunk's blocks; otherwise
    'flash' when ``logits_shape`` = (B, N, T, S) is given and ``B * N * T * S * 4`` exceeds
    ``FLASH_THRESHOLD_BYTES``, else XLA. An explicit choice that cannot run raises ValueError
    naming the reason (:func:`_refusal`).
    """
    dtype = jnp.dtype(dtype)
    half = dtype in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    target = target_platform(*like)
    platform = target[0]
    if implementation is None or implementation == "auto":
        padded = -(-qk_dim // 8) * 8
        # Under context parallelism every chunk a device attends must be whole splash blocks.
        multiple = context_lib.length_multiple(context_lib.shards(), context_lib.is_balanced(), "splash")
        multiple = max(multiple, _SPLASH_BLOCK)
        # Outside context parallelism any length >= one block is padded to whole blocks, exactly
        # (pad_lengths): < 2x the tiles.
        splash_fits = (logits_shape is None or not (logits_shape[2] % multiple or logits_shape[3] % multiple)
                       or (multiple == _SPLASH_BLOCK and min(logits_shape[2:]) >= _SPLASH_BLOCK))
        if platform == "gpu" and half and padded <= _CUDNN_MAX_HEAD_DIM and not segments:
            choice, why = "cudnn", f"GPU, {dtype.name}, packed head dim {padded}"
        elif platform == "tpu" and splash_fits:
            choice, why = "splash", "TPU"
        else:
            reasons = []
            if platform == "tpu":
                reasons.append(f"TPU, but splash needs lengths of at least {_SPLASH_BLOCK} (padded to whole "
                               f"blocks) or, under context parallelism, multiples of {multiple} "
                               f"(T={logits_shape[2]}, S={logits_shape[3]})")
            if platform == "gpu" and not half:
                reasons.append(f"{dtype.name} (cuDNN needs bf16/fp16)")
            if platform == "gpu" and padded > _CUDNN_MAX_HEAD_DIM:
                reasons.append(f"packed head dim {padded} > {_CUDNN_MAX_HEAD_DIM}")
            if platform == "gpu" and segments:
                reasons.append(f"segment ids ({_CUDNN_SEGMENTS_WHY})")
            logits_bytes = 4 * math.prod(logits_shape) if logits_shape is not None else 0
            if logits_bytes > FLASH_THRESHOLD_BYTES:
                choice = "flash"
                reasons.append(f"{logits_bytes / 2**20:.0f} MiB of T x S logits > "
                               f"{FLASH_THRESHOLD_BYTES / 2**20:.0f} MiB")
            else:
                choice = "xla"
            why = ", ".join(reasons) or f"platform {platform}"
        log_once(f"goat_jax: attention implementation '{choice}' ({why}; devices from {target[1]}).")
        return _record(choice, dtype, qk_dim, target)
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"Unknown implementation={implementation!r}; choose one of {IMPLEMENTATIONS} or None "
            "(automatic)."
        )
    refusal = _refusal(implementation, dtype, qk_dim, target)
    if refusal is not None:
        raise ValueError(refusal)
    return _record(implementation, dtype, qk_dim, target)


def _explicit_mask(
    t: int, s: int, is_causal: bool, causal_offset: Any, key_padding_mask: Optional[Array],
    kv_lengths: Optional[Array], segments: Optional[Tuple[Array, Array]] = None,
) -> Optional[Array]:
    """Boolean [B or 1, 1, T, S] mask (True = attend) from the masking contract, or None.
    ``segments``: (q_segment_ids [B, T], kv_segment_ids [B, S]) or None."""
    mask = None
    if segments is not None:
        mask = (segments[0][:, :, None] == segments[1][:, None, :])[:, None]
    if is_causal:
        i = jnp.arange(t)[:, None]
        j = jnp.arange(s)[None, :]
        causal = (j <= i + causal_offset)[None, None]
        mask = causal if mask is None else mask & causal
    if key_padding_mask is not None:
        keep = ~key_padding_mask.astype(bool)[:, None, None, :]
        mask = keep if mask is None else mask & keep
    if kv_lengths is not None:
        keep = (jnp.arange(s)[None, :] < kv_lengths[:, None])[:, None, None, :]
        mask = keep if mask is None else mask & keep
    return mask


def rows_with_keys(
    t: int, s: int, is_causal: bool, causal_offset: Any, key_padding_mask: Optional[Array],
    kv_lengths: Optional[Array], segments: Optional[Tuple[Array, Array]] = None,
) -> Optional[Array]:
    """[B or 1, T] bool: whether query row ``i`` sees at least one key under the masking
    contract; None when every row certainly does (no padding, no lengths, no segment ids,
    causal offset a static integer >= 0).

    Every bound on a visible key ``j`` is an upper bound (``j <= i + causal_offset``,
    ``j < kv_length``) except "not padded" and "same segment", so a row sees some key iff it
    sees the first unpadded key of its segment. With ``segments`` (q ids [B, T], kv ids
    [B, S]) that key is found by a stable sort of the kept keys by id and a binary search,
    for any ids (no contiguity assumed).
    """
    static_offset_ok = isinstance(causal_offset, (int, np.integer)) and causal_offset >= 0
    if (key_padding_mask is None and kv_lengths is None and segments is None
            and (not is_causal or static_offset_ok)):
        return None
    keep = None  # [B, S] bool, True = a key some query may see
    if key_padding_mask is not None:
        keep = ~key_padding_mask.astype(bool)
    if kv_lengths is not None:
        within = jnp.arange(s)[None, :] < kv_lengths[:, None]
        keep = within if keep is None else keep & within
    if segments is not None:
        first = _first_key_of_segment(segments[0], segments[1], keep)  # [B, T]
    elif keep is not None:
        first = jnp.where(keep.any(axis=-1), jnp.argmax(keep, axis=-1), s)[:, None]  # [B, 1]
    else:
        first = jnp.zeros((1, 1), jnp.int32)
    visible = jnp.broadcast_to(first < s, (first.shape[0], t))  # [B|1, T]
    if is_causal:
        visible = visible & (first <= jnp.arange(t)[None, :] + causal_offset)
    return visible


def _first_key_of_segment(q_seg: Array, kv_seg: Array, keep: Optional[Array]) -> Array:
    """[B, T] int32: index of the first kept key with query i's id, or S if there is none."""
    b, s = kv_seg.shape
    index = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    dropped = jnp.zeros((b, s), bool) if keep is None else ~jnp.broadcast_to(keep, (b, s))
    # Kept keys first, by id, ties by index: a binary search then finds each id's first key.
    order = jnp.lexsort((index, kv_seg, dropped), axis=-1)
    ids = jnp.take_along_axis(kv_seg, order, axis=-1)
    n_kept = jnp.sum(~dropped, axis=-1, keepdims=True)
    # Dropped keys sit after the kept ones; the search must not stop inside them.
    top = jnp.iinfo(ids.dtype).max
    search = jnp.where(index < n_kept, ids, top)
    at = jax.vmap(lambda a, v: jnp.searchsorted(a, v, side="left"))(search, q_seg)
    at_c = jnp.minimum(at, s - 1)
    found = (at < n_kept) & (jnp.take_along_axis(ids, at_c, axis=-1) == q_seg)
    return jnp.where(found, jnp.take_along_axis(order, at_c, axis=-1), s).astype(jnp.int32)


def _zero_empty_rows(out: Array, visible: Optional[Array]) -> Array:
    """Zeros the rows of ``out`` [B, T, N, H] without a visible key (a select: zero cotangent)."""
    if visible is None:
        return out
    return jnp.where(visible[:, :, None, None], out, jnp.zeros((), out.dtype))


def _is_static_zero(x: Any) -> bool:
    return isinstance(x, (int, np.integer)) and int(x) == 0


def _check_inputs(q: Array, k: Array, v: Array, key_padding_mask, kv_lengths):
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(
            f"q, k, v must be [B, T, N, H], [B, S, K, H], [B, S, K, Hv]; got {q.shape}, {k.shape}, {v.shape}."
        )
    b, t, n, d = q.shape
    if k.shape[0] != b or k.shape[3] != d or v.shape[:3] != k.shape[:3]:
        raise ValueError(f"Incompatible q {q.shape}, k {k.shape}, v {v.shape}.")
    if n % k.shape[2]:
        raise ValueError(
            f"{n} query heads are not a multiple of {k.shape[2]} key/value heads; choose "
            "kv_num_heads among the divisors of num_heads."
        )
    if key_padding_mask is not None and key_padding_mask.shape != (b, k.shape[1]):
        raise ValueError(
            f"key_padding_mask must have shape [B, S] = {(b, k.shape[1])}, got {key_padding_mask.shape}."
        )
    if kv_lengths is not None and kv_lengths.shape != (b,):
        raise ValueError(f"kv_lengths must have shape [B] = {(b,)}, got {kv_lengths.shape}.")


def resolve_segments(
    q_shape: Tuple[int, ...], k_shape: Tuple[int, ...], segment_ids: Optional[Array] = None,
    q_segment_ids: Optional[Array] = None, kv_segment_ids: Optional[Array] = None,
) -> Optional[Tuple[Array, Array]]:
    """Checks the segment-id arguments of :func:`attend` and returns ``(q_ids [B, T], kv_ids
    [B, S])`` as int32, or None without segments.

    Raises:
      ValueError naming the argument: both forms given, only one side of the pair, a shape
      other than [B, T] / [B, S], ``segment_ids`` for T != S, or a non-integer dtype.
    """
    b, t, s = q_shape[0], q_shape[1], k_shape[1]
    if segment_ids is not None:
        if q_segment_ids is not None or kv_segment_ids is not None:
            raise ValueError(
                "Pass either segment_ids (self-attention) or q_segment_ids and kv_segment_ids, "
                "not both.")
        if t != s:
            raise ValueError(
                f"segment_ids is for self-attention (T == S) but T={t}, S={s}; pass "
                "q_segment_ids [B, T] and kv_segment_ids [B, S] instead.")
        q_segment_ids = kv_segment_ids = segment_ids
    if q_segment_ids is None and kv_segment_ids is None:
        return None
    if q_segment_ids is None or kv_segment_ids is None:
        missing = "q_segment_ids" if q_segment_ids is None else "kv_segment_ids"
        raise ValueError(f"{missing} is missing: pass both q_segment_ids and kv_segment_ids "
                         "(or one segment_ids for self-attention).")
    out = []
    for name, ids, shape in (("q_segment_ids", q_segment_ids, (b, t)),
                             ("kv_segment_ids", kv_segment_ids, (b, s))):
        ids = jnp.asarray(ids) if not isinstance(ids, jax.Array) else ids
        if not jnp.issubdtype(ids.dtype, jnp.integer):
            raise ValueError(f"{name} must be integer ids (int32), got dtype {ids.dtype}; "
                             "cast with .astype(jnp.int32).")
        if ids.shape != shape:
            raise ValueError(f"{name} must have shape {shape} ([B, {'T' if name[0] == 'q' else 'S'}]), "
                             f"got {ids.shape}.")
        out.append(ids.astype(jnp.int32))
    return out[0], out[1]


def attend(
    q: Array,
    k: Array,
    v: Array,
    *,
    implementation: str,
    scale: float = 1.0,
    is_causal: bool = False,
    causal_offset: Any = 0,
    key_padding_mask: Optional[Array] = None,
    kv_lengths: Optional[Array] = None,
    segment_ids: Optional[Array] = None,
    q_segment_ids: Optional[Array] = None,
    kv_segment_ids: Optional[Array] = None,
    bias: Optional[Array] = None,
    return_probs: bool = False,
) -> Any:
    """``softmax(scale * q . k [+ bias] + mask) v`` on the chosen kernel.

    Args:
      q: [B, T, N, Hqk]; k: [B, S, K, Hqk]; v: [B, S, K, Hv].
      implementation: a resolved name (see :func:`resolve_implementation`).
      segment_ids: [B, T] integer ids for self-attention, or ``q_segment_ids`` [B, T] with
        ``kv_segment_ids`` [B, S]: a query sees only keys of its id (module doc). Not on
        'cudnn': ``jax.nn.dot_product_attention`` (jax 0.10.2) exposes only per-example
        query/key lengths (right padding), not cuDNN's packed-segment layout, and a T x S
        mask would undo its memory savings; use 'flash' or 'xla'.
      bias: optional additive [B or 1, N or 1, T, S] float bias, only for 'xla' and 'dense' (the
        materialized baselines: ALiBi-as-bias, naive L x L prior). Flash kernels get none.
      return_probs: also return the attention probabilities (only 'dense' materializes them;
        evaluations read them through the modules' sown 'intermediates').
    Returns:
      [B, T, N, Hv] in v's dtype; zeros for query rows without a visible key (module doc).
      With ``return_probs``: ``(out, probs)``, probs [B, N, T, S] float32 (zero rows likewise).
    """
    _check_inputs(q, k, v, key_padding_mask, kv_lengths)
    if implementation == "splash":  # Mosaic needs a TPU: say so, not a compiler error
        refusal = _refusal(implementation, q.dtype, q.shape[-1], target_platform(q))
        if refusal is not None:
            raise ValueError(refusal)
    segments = resolve_segments(q.shape, k.shape, segment_ids, q_segment_ids, kv_segment_ids)
    if segments is not None and implementation == "cudnn":
        raise ValueError(
            f"implementation='cudnn' cannot honour segment_ids: {_CUDNN_SEGMENTS_WHY}. Use "
            "implementation='flash' (segment-aware, skips tiles across documents) or 'xla'.")
    if context_lib.shards() > 1:  # the sequence is split over the mesh's context axis
        if return_probs:
            raise ValueError(
                f"return_probs materializes the T x S probabilities, which mesh.context="
                f"{context_lib.shards()} does not shard; read them with mesh.context=1.")

        def local(q, k, v, *, causal_offset, key_padding_mask, kv_lengths, segments, bias):
            seg = {} if segments is None else dict(q_segment_ids=segments[0], kv_segment_ids=segments[1])
            return attend(q, k, v, implementation=implementation, scale=scale, is_causal=is_causal,
                          causal_offset=causal_offset, key_padding_mask=key_padding_mask,
                          kv_lengths=kv_lengths, bias=bias, **seg)

        return context_lib.attend(q, k, v, local=local, is_causal=is_causal, causal_offset=causal_offset,
                                  key_padding_mask=key_padding_mask, kv_lengths=kv_lengths,
                                  segments=segments, bias=bias, implementation=implementation)
    visible = rows_with_keys(q.shape[1], k.shape[1], is_causal, causal_offset, key_padding_mask,
                             kv_lengths, segments)
    if return_probs:
        if implementation != "dense":
            raise ValueError(
                f"return_probs needs implementation='dense' (the only kernel that materializes "
                f"the probabilities), got {implementation!r}.")
        mask = _explicit_mask(q.shape[1], k.shape[1], is_causal, causal_offset, key_padding_mask,
                              kv_lengths, segments)
        out, probs = _dense(q, k, v, scale, bias, mask, return_probs=True)
        if visible is not None:
            probs = jnp.where(visible[:, None, :, None], probs, 0.0)
        return _zero_empty_rows(out, visible), probs
    return _zero_empty_rows(_attend(q, k, v, implementation, scale, is_causal, causal_offset,
                                    key_padding_mask, kv_lengths, bias, segments), visible)


def _attend(q, k, v, implementation, scale, is_causal, causal_offset, key_padding_mask,
            kv_lengths, bias, segments=None) -> Array:
    """:func:`attend` before empty rows are zeroed."""
    if bias is not None and implementation not in ("xla", "dense"):
        raise ValueError(
            f"An additive bias is only supported by implementation='xla' or 'dense', not "
            f"{implementation!r} (flash kernels take packed q/k instead)."
        )
    if implementation == "dense":
        return _dense(q, k, v, scale, bias, _explicit_mask(
            q.shape[1], k.shape[1], is_causal, causal_offset, key_padding_mask, kv_lengths,
            segments))
    if implementation == "flash":
        seg = {} if segments is None else dict(q_segment_ids=segments[0], kv_segment_ids=segments[1])
        return flash_lib.flash_attention(q, k, v, scale=scale, is_causal=is_causal, causal_offset=causal_offset,
                                         key_padding_mask=key_padding_mask, kv_lengths=kv_lengths, **seg)
    t_real = q.shape[1]
    if implementation in ("splash", "splash_interpret"):
        q, k, v, key_padding_mask, kv_lengths, segments = pad_lengths(
            q, k, v, key_padding_mask, kv_lengths, segments, _SPLASH_BLOCK)
        out = splash_lib.splash_attention(q, k, v, scale, is_causal, causal_offset, key_padding_mask,
                                          kv_lengths, segments, interpret=implementation == "splash_interpret")
        return out[:, :t_real]
    if implementation == "cudnn":
        q, k, v, key_padding_mask, kv_lengths, _ = pad_lengths(q, k, v, key_padding_mask, kv_lengths, None, 2)
    # jax.nn.dot_product_attention needs equal q/k and v head dims: pad v with zero columns.
    hv, hqk = v.shape[-1], q.shape[-1]
    if implementation == "cudnn" and hqk % 8:
        pad = -(-hqk // 8) * 8 - hqk  # cuDNN wants head dims that are multiples of 8
        q = jnp.pad(q, [(0, 0)] * 3 + [(0, pad)])
        k = jnp.pad(k, [(0, 0)] * 3 + [(0, pad)])
        hqk += pad
    if hv < hqk:
        v = jnp.pad(v, [(0, 0)] * 3 + [(0, hqk - hv)])
    elif hv > hqk:
        q = jnp.pad(q, [(0, 0)] * 3 + [(0, hv - hqk)])
        k = jnp.pad(k, [(0, 0)] * 3 + [(0, hv - hqk)])
    native_causal = is_causal and _is_static_zero(causal_offset)
    mask = _explicit_mask(q.shape[1], k.shape[1], is_causal and not native_causal, causal_offset,
                          key_padding_mask, None, segments)
    out = jax.nn.dot_product_attention(
        q, k, v, bias=bias, mask=mask, scale=scale, is_causal=native_causal,
        key_value_seq_lengths=None if kv_lengths is None else kv_lengths.astype(jnp.int32),
        implementation=implementation,
    )
    return out[:, :t_real, :, :hv]


def pad_lengths(q: Array, k: Array, v: Array, key_padding_mask: Optional[Array], kv_lengths: Optional[Array],
                segments: Optional[Tuple[Array, Array]], multiple: int):
    """``(q, k, v, key_padding_mask, kv_lengths, segments)`` with the query and key lengths
    padded to multiples of ``multiple``, exactly: the caller drops the extra query rows'
    outputs, and the extra keys are masked out (``kv_lengths`` = the real length when no mask
    was given, or ``key_padding_mask`` extended with True, "ignored"). An extra query row copies
    the last real row's segment id (and sits below it in the causal order), so it attends to a
    superset of that row's keys: never an empty row, whose gradient could be NaN. Lengths
    already multiples are returned unchanged.

    Why, per kernel: splash (``multiple`` 128, its block) would otherwise leave a ViT's 197
    tokens (196 patches + CLS) the blockwise fallback on TPU, whose compile takes tens of
    minutes (padding to 256 costs splash 30% more tiles); cuDNN (``multiple`` 2): jax 0.10.2's
    cuDNN attention, under differentiation, checks every call as one with a bias (its forward
    rule is handed an empty placeholder for "no bias"), and biased cuDNN attention needs even
    lengths, so training a ViT on a GPU failed at the first step ("Unsupported sequence length
    Q 197, KV 197")."""
    t, s = q.shape[1], k.shape[1]
    tp, sp = -(-t // multiple) * multiple, -(-s // multiple) * multiple
    seg_q, seg_kv = segments if segments is not None else (None, None)
    if tp != t:
        q = jnp.pad(q, [(0, 0), (0, tp - t), (0, 0), (0, 0)])
        if seg_q is not None:
            seg_q = jnp.pad(seg_q, [(0, 0), (0, tp - t)], mode="edge")
    if sp != s:
        k = jnp.pad(k, [(0, 0), (0, sp - s), (0, 0), (0, 0)])
        v = jnp.pad(v, [(0, 0), (0, sp - s), (0, 0), (0, 0)])
        if seg_kv is not None:
            seg_kv = jnp.pad(seg_kv, [(0, 0), (0, sp - s)], mode="edge")  # the padding mask hides them
        if key_padding_mask is not None:
            key_padding_mask = jnp.pad(key_padding_mask.astype(bool), [(0, 0), (0, sp - s)], constant_values=True)
        elif kv_lengths is None:
            kv_lengths = jnp.full((k.shape[0],), s, jnp.int32)
    return q, k, v, key_padding_mask, kv_lengths, None if seg_q is None else (seg_q, seg_kv)


def _dense(q, k, v, scale, bias, mask, return_probs: bool = False) -> Any:
    """The materialized reference: float32 logits at highest precision, then softmax.
    Returns the output, and the probabilities [B, N, T, S] too if ``return_probs``."""
    g = q.shape[2] // k.shape[2]
    k = jnp.repeat(k, g, axis=2)
    v = jnp.repeat(v, g, axis=2)
    real = jnp.promote_types(q.dtype, jnp.float32)
    logits = jnp.einsum("btnh,bsnh->bnts", q.astype(real), k.astype(real),
                        precision=jax.lax.Precision.HIGHEST) * scale
    if bias is not None:
        logits = logits + bias.astype(real)
    if mask is not None:
        logits = jnp.where(mask, logits, -jnp.inf)
        # A row without visible keys would be softmax(all -inf) = NaN, and NaN * 0 poisons the
        # value gradient even after attend() zeroes the row: give it finite logits instead.
        logits = jnp.where(mask.any(axis=-1, keepdims=True), logits, 0.0)
    probs = jax.nn.softmax(logits, axis=-1)
    out = jnp.einsum("bnts,bsnh->btnh", probs, v.astype(real), precision=jax.lax.Precision.HIGHEST)
    return (out.astype(v.dtype), probs) if return_probs else out.astype(v.dtype)
