"""The attention call, written once for every layer (Flax Linen and Flax NNX): values in, values out.

A call runs in two steps, both plain functions of values:

* :func:`prepare` ``(spec, encoding, query, key, value, cache_shape=..., **options)``: resolves
  the call (defaults, segment ids, head bookkeeping), validates it, lets the encoding (a value,
  :mod:`goat_jax.layers.encoding`) choose the kernel once, and returns a :class:`CallPlan`: what
  will run, and every parameter (:class:`goat_jax.layers.encoding.ParamDecl`) and cache slot
  (:class:`goat_jax.layers.encoding.CacheDecl`) the call needs, declared, before any is made.
* :func:`run` ``(plan, params, cache, want_maps)``: the projections, positions, the encoding, log-n
  scaling, the KV-cache arithmetic, the kernel and the output projection, from the parameter
  values and the cache values; returns a :class:`CallResult` (the output, the new cache values,
  the attention maps to sow).

The layers are thin shells around the two: the Linen one (:mod:`goat_jax.layers.linen`) makes the
declared parameters and cache slots as Linen variables, the NNX one (:mod:`goat_jax.layers.nnx`)
holds them as NNX variables made at construction from the same declarations. Neither step calls
anything on the layer.

Shape legend: B batch, T new tokens, S keys, E model dim, N query heads, K kv heads, H head dim.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Mapping, NamedTuple, Optional, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from goat_jax import kernels
from goat_jax.kernels import decode_merge
from goat_jax.kernels import mesh as kernels_mesh
from goat_jax import prior as prior_lib
from goat_jax.config.fields import Int, check_section
from goat_jax.layers.call import (
    AttentionCall, CallOptions, KernelRequest, LayerShape, apply_logn, check_logn, logn_factors,
    resolve_call_segments)
from goat_jax.layers.encoding import CacheDecl, Encoding, ParamDecl, Prepared, Sizes
from goat_jax.partitioning import with_logical_partitioning
from goat_jax.kernels.plan import AttentionPlan

Array = jax.Array


# The layers' fields checked when a layer is built (both shells), before any call; the rest are
# checked by the call's plan, which needs the inputs.
FIELD_SPECS = {
    "max_documents_per_row": Int(min=1, optional=True, doc="documents per row cuDNN's packed layout is sized "
                                                          "for (goat_jax/kernels/cudnn_packed.py); None: its default"),
}


@dataclasses.dataclass(frozen=True)
class LayerSpec:
    """The fields every attention layer has (their meaning: :class:`goat_jax.layers.linen.Attention`),
    as one value; ``owner`` names the layer's class in errors."""

    num_heads: int
    kv_num_heads: Optional[int] = None
    head_dim: Optional[int] = None
    out_features: Optional[int] = None
    use_bias: bool = True
    dtype: Any = None
    param_dtype: Any = jnp.float32
    implementation: Optional[str] = None
    decode: bool = False
    kernel_init_std: Optional[float] = None
    logn_scaling: Optional[str] = None
    max_documents_per_row: Optional[int] = None
    plan: Optional[AttentionPlan] = None
    owner: str = "Attention"

    @classmethod
    def of(cls, fields: Mapping[str, Any], owner: str) -> "LayerSpec":
        """The spec of a layer's ``fields`` (a mapping with at least these names; others ignored)."""
        return cls(**{f.name: fields[f.name] for f in dataclasses.fields(cls) if f.name != "owner"}, owner=owner)

    def check(self) -> None:
        """Raises a one-line ValueError naming ``Layer.field`` when a field of :data:`FIELD_SPECS`
        is invalid (``max_documents_per_row`` of 0, -3, 2.5 or "4": before, 0 became cuDNN's
        default silently and the others failed later inside the kernel)."""
        check_section({name: getattr(self, name) for name in FIELD_SPECS}, FIELD_SPECS, None, owner=self.owner)

    def attention_plan(self) -> AttentionPlan:
        """The layer's one plan: ``plan``, or without one the plan of its ``implementation`` /
        ``max_documents_per_row`` fields (a shorthand for a plan of those fields alone). A layer
        given both is refused (ValueError naming the fields and the fix): the plan holds them once."""
        given = {name: getattr(self, name) for name in ("implementation", "max_documents_per_row")
                 if getattr(self, name) is not None}
        if self.plan is None:
            return AttentionPlan(**given)
        if given:
            spelled = ", ".join(f"{name}={value!r}" for name, value in given.items())
            raise ValueError(f"{self.owner}: {spelled} and plan= given together; the plan holds how attention runs "
                             f"once: pass plan=plan.replace({spelled}) and drop the field(s).")
        return self.plan


def head_dims(num_heads: int, kv_num_heads: Optional[int], head_dim: Optional[int], embed_dim: int) -> Tuple[int, int]:
    """Validated ``(kv_heads, head_dim)``; ``head_dim`` defaults to ``embed_dim / num_heads``."""
    kv = kv_num_heads or num_heads
    if num_heads < 1 or kv < 1 or num_heads % kv:
        raise ValueError(f"num_heads={num_heads} must be a positive multiple of kv_num_heads={kv}.")
    if head_dim is None:
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim={embed_dim} is not divisible by num_heads={num_heads}; set "
                             "head_dim explicitly or change num_heads.")
        head_dim = embed_dim // num_heads
    return kv, head_dim


def check_qkv(query: Array, key: Array, value: Array) -> None:
    """Raises unless query/key/value are rank-3 ``[batch, length, features]``."""
    if query.ndim != 3 or key.ndim != 3 or value.ndim != 3:
        raise ValueError(f"query/key/value must be [batch, length, features]; got {query.shape}, "
                         f"{key.shape}, {value.shape}.")


def check_decode_call(*, query: Array, key: Array, is_causal: bool, positions_given: bool,
                      key_padding_mask: Optional[Array]) -> None:
    """Raises ValueError for a ``decode=True`` call the KV cache cannot take (either shell)."""
    if query is not key or not is_causal:
        raise ValueError("decode=True supports causal self-attention only (call with is_causal=True).")
    if positions_given:
        raise ValueError("decode=True takes positions from the cache index; do not pass positions.")
    if key_padding_mask is not None:
        raise ValueError("key_padding_mask is not supported while decoding.")


def check_cache_batch(cache_batch: int, call_batch: int, resize: str) -> None:
    """Raises ValueError, before anything is written, when a decoding call's batch is not the
    cache's: a smaller batch would be written into the cache's first rows (moving its index)
    before the kernel refused it, a larger one fails inside ``dynamic_update_slice``. ``resize``
    says how this shell sizes its cache for a batch ("layer.init_cache({b}, max_length)")."""
    if call_batch != cache_batch:
        raise ValueError(
            f"decode=True: this call has batch {call_batch}, but the KV cache holds batch "
            f"{cache_batch} (sized when it was made); call with {cache_batch} rows, or size the "
            f"cache for {call_batch} with {resize.format(b=call_batch)} (which empties it).")


# ----------------------------------------------------------------------------------------------
# Projections, declared
# ----------------------------------------------------------------------------------------------


# The official module initializes each projection xavier-uniform over the whole [in, out]
# matrix (fans = E and N * H), which _xavier_over_matrix reproduces.
_xavier = nn.initializers.xavier_uniform()


def projection_init(fan_in_dims: int, init_std: Optional[float] = None):
    """A projection kernel's initializer: Xavier-uniform over the ``[fan_in, fan_out]`` matrix
    (``init_std=None``, the official module's own init) or ``N(0, init_std)`` elementwise (the
    GPT-2 recipes, e.g. the official C4 script's 0.02 on every Linear; docs/protocols.md)."""
    if init_std is None:
        return _xavier_over_matrix(fan_in_dims)
    if not init_std > 0:
        raise ValueError(f"init_std must be > 0 (or None for Xavier-uniform), got {init_std}.")
    return nn.initializers.normal(init_std)


def _xavier_over_matrix(fan_in_dims: int):
    """Xavier-uniform over the [prod(shape[:fan_in_dims]), prod(rest)] matrix, reshaped to the
    full kernel shape. Initializing at the full shape (rather than DenseGeneral's flattened 2D
    one) keeps a logical-name box valid under a global mesh, where Flax constrains the boxed
    value to its names as soon as the initializer returns."""
    def init(rng, shape, dtype=jnp.float32):
        rows = int(np.prod(shape[:fan_in_dims]))
        return _xavier(rng, (rows, int(np.prod(shape)) // rows), dtype).reshape(shape)
    return init


class Projection(NamedTuple):
    """One of the layer's four projections: ``y = einsum(spec, x, kernel) + bias``, its kernel
    ``kernel_shape`` with logical axes ``kernel_axes``, the first ``fan_in_dims`` dims its input."""

    name: str
    spec: str
    kernel_shape: Tuple[int, ...]
    kernel_axes: Tuple[str, ...]
    fan_in_dims: int

    def declarations(self, use_bias: bool, param_dtype: Any, init_std: Optional[float]) -> Tuple[ParamDecl, ...]:
        """``name/kernel`` (:func:`projection_init`) and, with ``use_bias``, ``name/bias`` (zeros),
        each logically named."""
        kernel = ParamDecl((self.name, "kernel"), with_logical_partitioning(
            projection_init(self.fan_in_dims, init_std), self.kernel_axes), (self.kernel_shape, param_dtype))
        if not use_bias:
            return (kernel,)
        n = self.fan_in_dims
        return (kernel, ParamDecl((self.name, "bias"), with_logical_partitioning(
            nn.initializers.zeros, self.kernel_axes[n:]), (self.kernel_shape[n:], param_dtype)))


def project(projection: Projection, params: Mapping[str, Any], x: Array, dtype: Any) -> Array:
    """Applies ``projection`` with its parameters from ``params`` (``{'q_proj/kernel': ...}``) in
    ``dtype`` (Flax's promotion rules)."""
    kernel, bias = params[f"{projection.name}/kernel"], params.get(f"{projection.name}/bias")
    x, kernel, bias = nn.dtypes.promote_dtype(x, kernel, bias, dtype=dtype)
    y = jnp.einsum(projection.spec, x, kernel)
    return y if bias is None else y + bias


def projections(shape: LayerShape, kv_features: int, out_features: int) -> Tuple[Projection, ...]:
    """q, k, v and out projections of a layer of ``shape`` (E -> N x H, E' -> K x H, N x H -> F)."""
    n, kh, h = shape.num_heads, shape.kv_heads, shape.head_dim
    return (Projection("q_proj", "ble,enh->blnh", (shape.embed_dim, n, h), ("embed", "heads", "kv"), 1),
            Projection("k_proj", "ble,enh->blnh", (kv_features, kh, h), ("embed", "kv_heads", "kv"), 1),
            Projection("v_proj", "ble,enh->blnh", (kv_features, kh, h), ("embed", "kv_heads", "kv"), 1),
            Projection("out_proj", "btnh,nhe->bte", (n, h, out_features), ("heads", "kv", "embed"), 2))


# How the Linen layer sizes its cache (named in check_cache_batch's error).
LINEN_RESIZE = "init (its 'cache' collection) on an input of batch {b} and the full length"


# ----------------------------------------------------------------------------------------------
# Step 1: the plan of one call
# ----------------------------------------------------------------------------------------------


class CallPlan(NamedTuple):
    """What :func:`prepare` decided: the resolved call, its head bookkeeping, the run's attention
    plan, the encoding and its :class:`goat_jax.layers.encoding.Prepared`, the projections, and
    every parameter and cache slot the call needs (declared, in creation order)."""

    spec: LayerSpec
    encoding: Encoding
    call: AttentionCall
    shape: LayerShape
    attention_plan: AttentionPlan
    prepared: Prepared
    projections: Tuple[Projection, ...]
    params: Tuple[ParamDecl, ...]
    cache: Tuple[CacheDecl, ...]


def sizes_of(spec: LayerSpec, embed_dim: int, kv_features: Optional[int] = None) -> Sizes:
    """The :class:`goat_jax.layers.encoding.Sizes` of a layer of ``spec`` on inputs of width
    ``embed_dim`` (query) and ``kv_features`` (key/value; default ``embed_dim``)."""
    kv_heads, head_dim = head_dims(spec.num_heads, spec.kv_num_heads, spec.head_dim, embed_dim)
    return Sizes(spec.num_heads, kv_heads, head_dim, kv_features or embed_dim, spec.param_dtype, bool(spec.decode))


def prepare(spec: LayerSpec, encoding: Encoding, query: Array, key: Optional[Array] = None,
            value: Optional[Array] = None, *, cache_shape: Optional[Tuple[int, ...]] = None,
            resize: str = LINEN_RESIZE, **options: Any) -> CallPlan:
    """Validates one call of a layer of ``spec`` holding ``encoding`` and plans it (module
    docstring); ``options``: the call keywords (:class:`goat_jax.layers.call.CallOptions`).
    ``cache_shape``: while decoding, the shape of the cache's keys once the cache exists (None
    at Linen's ``init``, which sizes it); ``resize``: how the shell sizes its cache for a batch
    ``{b}`` (named when a call's batch is not the cache's). Nothing is made or written."""
    (is_causal, key_padding_mask, spatial_shape, has_cls_token, position_offset_q, position_offset_k,
     q_positions, k_positions, segment_ids, kv_segment_ids) = CallOptions.of(spec.owner, options)
    key = query if key is None else key
    value = key if value is None else value
    check_qkv(query, key, value)
    # Before any parameter or cache write (decoding on such a mesh failed in the cache update).
    kernels_mesh.check_axis_types(kernels_mesh.ambient_mesh())
    # Narrow integer positions and offsets become int32 here, where they enter (prior_lib.widen).
    w = prior_lib.widen
    call = AttentionCall(query, key, value, is_causal, key_padding_mask, spatial_shape, has_cls_token,
                         w(position_offset_q), w(position_offset_k), w(q_positions), w(k_positions))
    call = resolve_call_segments(call, segment_ids, kv_segment_ids, spec.decode)
    embed_dim = query.shape[-1]
    sizes = sizes_of(spec, embed_dim, key.shape[-1])
    dtype = spec.dtype or jnp.result_type(query.dtype, spec.param_dtype)
    # S attended: the cache's length while decoding, so that a chunk of queries against a long
    # cache gets the memory-linear kernel, not T x S_cache logits.
    attended = cache_shape[1] if spec.decode and cache_shape is not None else key.shape[1]
    shape = LayerShape(spec.num_heads, sizes.kv_heads, sizes.head_dim, dtype, embed_dim,
                       (query.shape[0], spec.num_heads, query.shape[1], attended))
    # The call's plan (the layer's, or its fields'), and its mask before encoding, from which the
    # encoding chooses the kernel once.
    attention_plan = spec.attention_plan()
    call_mask = kernels.AttentionMask.build(
        query.shape[0], query.shape[1], key.shape[1], is_causal=is_causal, key_padding_mask=key_padding_mask,
        q_segment_ids=call.q_segment_ids, kv_segment_ids=call.kv_segment_ids, window=attention_plan.window)
    prepared = encoding.prepare(call, shape, KernelRequest(attention_plan, call_mask, bool(spec.decode), dtype,
                                                           shape.logits_shape), sizes)
    if spec.logn_scaling is not None:
        check_logn(spec.logn_scaling, encoding.training_len)
        if spatial_shape is not None:
            raise ValueError(f"logn_scaling={spec.logn_scaling!r} is for 1D sequences; drop it for 2D "
                             "inputs (spatial_shape was given).")
    cache: Tuple[CacheDecl, ...] = ()
    b, s = query.shape[0], key.shape[1]
    if spec.decode:
        check_decode_call(query=query, key=key, is_causal=is_causal,
                          positions_given=q_positions is not None or position_offset_q is not None,
                          key_padding_mask=key_padding_mask)
        if cache_shape is not None:
            check_cache_batch(cache_shape[0], b, resize)
        cache = (CacheDecl("cached_key", jnp.zeros, ((b, s, sizes.kv_heads, prepared.qk_dim), dtype)),
                 CacheDecl("cached_value", jnp.zeros, ((b, s, sizes.kv_heads, sizes.head_dim), dtype)),
                 CacheDecl("cache_index", _zero_index, ())) + tuple(prepared.cache)
    projs = projections(shape, key.shape[-1], spec.out_features or embed_dim)
    declare = lambda p: p.declarations(spec.use_bias, spec.param_dtype, spec.kernel_init_std)
    params = (*declare(projs[0]), *declare(projs[1]), *declare(projs[2]), *prepared.params, *declare(projs[3]))
    return CallPlan(spec, encoding, call, shape, attention_plan, prepared, projs, params, cache)


def _zero_index() -> Array:
    return jnp.array(0, jnp.int32)


def declarations(spec: LayerSpec, encoding: Encoding, in_features: int, kv_features: Optional[int] = None,
                 **options: Any) -> Tuple[ParamDecl, ...]:
    """Every parameter a layer of ``spec`` holding ``encoding`` has on inputs of widths
    ``in_features`` / ``kv_features``, in creation order, checked as its first call would be (a
    short self-attention call of :func:`prepare`; ``options`` as the call's, e.g. a 2D encoding's
    ``spatial_shape``): how the NNX layer makes its parameters at construction."""
    kv_features = kv_features or in_features
    length = options.pop("length", 1)
    # Planning reads only the inputs' shapes and dtypes.
    query = jax.ShapeDtypeStruct((1, length, in_features), spec.param_dtype)
    key = None if kv_features == in_features else jax.ShapeDtypeStruct((1, length, kv_features), spec.param_dtype)
    return prepare(spec, encoding, query, key, is_causal=True, **options).params


# ----------------------------------------------------------------------------------------------
# Step 2: the call
# ----------------------------------------------------------------------------------------------


class CallResult(NamedTuple):
    """What :func:`run` returns: ``out`` [B, T, F], the cache's new values (``{slot: value}``;
    None when not decoding) and the attention maps to sow (``{name: value}``; empty unless asked
    and the kernel materializes them)."""

    out: Array
    cache: Optional[Dict[str, Any]]
    maps: Dict[str, Array]


def run(plan: CallPlan, params: Mapping[str, Any], cache: Optional[Mapping[str, Any]] = None,
        want_maps: bool = False) -> CallResult:
    """One attention call as :func:`prepare` planned it, from the parameter values ``params``
    (``{declaration name: value}``, unboxed) and, while decoding, the cache values ``cache``
    (``{slot: value}`` of :attr:`CallPlan.cache`; None at Linen's ``init``, an ordinary forward).
    ``want_maps``: the caller collects attention maps (the 'dense' kernel sows them:
    ``attention_probs`` [B, N, T, S] float32 after masking, and, when not decoding, the content
    ``attention_keys`` [B, S, K, Hk] before any position encoding and ``attention_values``)."""
    spec, call, shape, prepared = plan.spec, plan.call, plan.shape, plan.prepared
    q_proj, k_proj, v_proj, out_proj = plan.projections
    q = project(q_proj, params, call.query, shape.dtype)  # [B, T, N, H]
    k = project(k_proj, params, call.key, shape.dtype)  # [B, S, K, H]
    v = project(v_proj, params, call.value, shape.dtype)  # [B, S, K, H]
    t, s = q.shape[1], k.shape[1]
    start = None
    if cache is not None:
        start = cache["cache_index"]
        call = call._replace(position_offset_q=start, position_offset_k=start)
    q_pos, k_pos = plan.encoding.positions(call, prepared, t, s, bool(spec.decode))
    if call.q_segment_ids is not None and (q_pos.is_2d or k_pos.is_2d):
        raise ValueError("segment_ids are for 1D sequences (packed documents); 2D (patch-grid) "
                         "positions have no documents to restart at. Drop segment_ids, or use "
                         "1D positions.")
    own = {d.path[-1]: params[d.name] for d in prepared.params}
    enc, updates = plan.encoding.encode(call, shape, prepared, own, q, k, q_pos, k_pos, cache)
    if spec.logn_scaling is not None:
        if q_pos.is_2d:
            raise ValueError(f"logn_scaling={spec.logn_scaling!r} is for 1D positions; this call "
                             "uses 2D (row, col) positions.")
        keys_seen = s
        if call.q_segment_ids is not None and not call.is_causal:
            # Each query's n is the key count of its own document, as when it runs alone.
            keys_seen = jnp.sum(call.q_segment_ids[:, :, None] == call.kv_segment_ids[:, None, :],
                                axis=-1).astype(jnp.float32)  # [B, T]
        enc = apply_logn(enc, logn_factors(q_pos.index, call.is_causal, keys_seen, plan.encoding.training_len),
                         spec.logn_scaling)

    split = cache is not None and kernels_mesh.context_shards(
        kernels_mesh.ambient_mesh(), plan.attention_plan.context_axis) > 1
    attend = _attend_split_cache if split else _attend
    keys, v, out, maps = attend(plan, call, enc, v, cache, start, want_maps)
    new_cache = None
    if cache is not None:
        new_cache = {**dict(cache), **updates, "cached_key": keys, "cached_value": v, "cache_index": start + t}
        # NaN outputs once the cache overflows: the write clamps (one device) or drops (split)
        # what is past its end silently, and an overflow must not go unnoticed.
        out = jnp.where(start + t > keys.shape[1], jnp.nan, out)
    out = project(out_proj, params, out.astype(shape.dtype), shape.dtype)
    return CallResult(out, new_cache, maps)


def _attend(plan: CallPlan, call: AttentionCall, enc: Any, v: Array, cache: Optional[Mapping[str, Any]],
            start: Optional[Array], want_maps: bool) -> Tuple[Array, Array, Array, Dict[str, Array]]:
    """The kernel of :func:`run` on one device's whole keys: ``(keys, values, out [B, T, N, Hv],
    maps)``, the keys and values the new cache's while decoding (the new ones written at the
    cache index, the whole cache attended)."""
    b, t = enc.q.shape[0], enc.q.shape[1]
    keys, is_causal, causal_offset, kv_lengths = enc.k, call.is_causal, enc.causal_offset, None
    if cache is not None:
        # Keys past the last written slot are masked by the causal offset (= the index); a single
        # new token becomes "keys up to the index", which cuDNN masks natively via kv_lengths.
        cached_k, cached_v = cache["cached_key"], cache["cached_value"]
        keys = jax.lax.dynamic_update_slice(cached_k, keys.astype(cached_k.dtype), (0, start, 0, 0))
        v = jax.lax.dynamic_update_slice(cached_v, v.astype(cached_v.dtype), (0, start, 0, 0))
        causal_offset, is_causal = start, t > 1
        if t == 1:
            kv_lengths = jnp.full((b,), start + 1, jnp.int32)
    sow = want_maps and kernels.returns_probs(plan.prepared.implementation)  # the kernel's row says
    # The one mask value of this call, handed to whichever kernel runs it.
    mask = kernels.AttentionMask.build(
        b, t, keys.shape[1], is_causal=is_causal, causal_offset=causal_offset,
        key_padding_mask=call.key_padding_mask, kv_lengths=kv_lengths,
        q_segment_ids=call.q_segment_ids, kv_segment_ids=call.kv_segment_ids,
        window=plan.attention_plan.window)
    out = kernels.attend(enc.q, keys, v, choice=plan.prepared.choice, plan=plan.attention_plan, scale=enc.scale,
                         mask=mask, bias=enc.bias, return_probs=sow)  # [B, T, N, Hv]
    maps: Dict[str, Array] = {}
    if sow:
        out, probs = out
        maps = {"attention_probs": probs} if cache is not None else {
            "attention_probs": probs, "attention_keys": enc.content_keys, "attention_values": v}
    return keys, v, out, maps


def _attend_split_cache(plan: CallPlan, call: AttentionCall, enc: Any, v: Array, cache: Mapping[str, Any],
                        start: Array, want_maps: bool) -> Tuple[Array, Array, Array, Dict[str, Array]]:
    """:func:`_attend` while decoding under a mesh that splits sequences over ``context``: the
    cache's slots are split over the shards, each shard writes the new positions it owns and
    scores its own slots, and the partial softmaxes are merged with three small collectives
    (:mod:`goat_jax.kernels.decode_merge`; docs/training.md, "Decoding with a sharded cache").
    No key is gathered: the queries are the only thing every shard sees whole."""
    axis = plan.attention_plan.context_axis
    shards = kernels_mesh.context_shards(kernels_mesh.ambient_mesh(), axis)
    how = f"decoding with the KV cache split over mesh.{axis}={shards}"
    if enc.bias is not None:
        raise ValueError(f"{how}: this position encoding adds a materialized [N, T, S] bias, which the split "
                         "cache's merge does not take; decode it with mesh.context=1, or use a packed encoding "
                         "(GOAT, RoPE, 'alibi_packed', FoX, NoPE).")
    if plan.attention_plan.window is not None:
        raise ValueError(f"{how}: a sliding window (plan.window={plan.attention_plan.window}) is not supported "
                         "there; decode with mesh.context=1.")
    if want_maps and kernels.returns_probs(plan.prepared.implementation):
        raise ValueError(f"{how}: attention probabilities are never formed whole there; read them with "
                         "mesh.context=1.")
    b, t = enc.q.shape[0], enc.q.shape[1]
    keys, values = decode_merge.write_cache(cache["cached_key"], cache["cached_value"], enc.k, v, start, axis=axis)
    positions = jnp.broadcast_to(start + jnp.arange(t, dtype=jnp.int32), (b, t))
    out = decode_merge.decode_attention(enc.q, keys, values, q_positions=positions,
                                        kv_length=jnp.full((b,), start + t, jnp.int32), scale=enc.scale, axis=axis)
    return keys, values, out, {}
