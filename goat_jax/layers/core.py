"""The attention call, written once for every layer shell (Flax Linen and Flax NNX).

:func:`run` is the projections-free work of one call: resolving the call (defaults, segment
ids, head bookkeeping), planning (validation and the kernel choice, before any parameter),
positions, encoding q/k (GOAT's packing, a baseline encoding), log-n scaling, the KV-cache
arithmetic, the kernel call, masking and the output projection. It never touches a framework:
it asks the layer it is given (the *shell*) for parameters and projections. Two shells exist,
:class:`goat_jax.layers.linen.AttentionBase` (Linen) and :mod:`goat_jax.nnx` (NNX); the variant
logic (how positions enter: GOAT's ``GoatLogic`` in :mod:`goat_jax.layers.goat`, the baselines'
``PositionalLogic`` in :mod:`goat_jax.layers.positional`) is a plain mixin both shells inherit,
so neither re-implements packing, encodings or masking.

The shell contract (what :func:`run` reads from ``layer``):

* fields: ``num_heads, kv_num_heads, head_dim, out_features, use_bias, dtype, param_dtype,
  implementation, decode, kernel_init_std, logn_scaling, max_documents_per_row, plan``;
* the variant (:class:`AttentionLogic` and a subclass mixin): ``_plan``, ``_positions``,
  ``_encode``, ``_training_len``;
* parameters: ``param(name, init, *args)`` (encodings' own parameters, Linen's signature) and
  ``_projection(name, spec, x, kernel_shape, kernel_axes, fan_in_dims, dtype)`` (q/k/v/out);
* decoding and sowing: ``_attended_length(key_len)``, ``_open_cache(**kw)`` (a
  :class:`DecodeCache` or None), ``_wants_attention_maps(implementation)``,
  ``_sow_maps(probs, keys, values)``, ``_sow_probs(probs)``.

Shape legend: B batch, T new tokens, S keys, E model dim, N query heads, K kv heads, H head dim.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Tuple

import jax
import jax.numpy as jnp

from goat_jax import kernels
from goat_jax.kernels import mesh as kernels_mesh
from goat_jax import prior as prior_lib
from goat_jax.config.fields import Int, check_section
from goat_jax.layers.call import (
    AttentionCall, CallOptions, Encoded, KernelRequest, LayerShape, apply_logn, check_logn, logn_factors,
    resolve_call_segments)
from goat_jax.plan import AttentionPlan

Array = jax.Array


# The layers' fields checked when a layer is built (both shells), before any call; the rest are
# checked by the call's plan, which needs the inputs.
FIELD_SPECS = {
    "max_documents_per_row": Int(min=1, optional=True, doc="documents per row cuDNN's packed layout is sized "
                                                          "for (goat_jax/kernels/cudnn_packed.py); None: its default"),
}


def check_fields(layer: Any) -> None:
    """Raises a one-line ValueError naming ``Layer.field`` when a field of :data:`FIELD_SPECS`
    is invalid (``max_documents_per_row`` of 0, -3, 2.5 or "4": before, 0 became cuDNN's default
    silently and the others failed later inside the kernel)."""
    check_section({name: getattr(layer, name) for name in FIELD_SPECS}, FIELD_SPECS, None,
                  owner=type(layer).__name__)


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


class DecodeCache(NamedTuple):
    """The cache variables of a decoding layer (objects with a ``.value``) and the index before
    this call. Keys are stored as the kernel sees them (packed for GOAT, rotated for RoPE)."""

    keys: Any
    values: Any
    index: Any
    start: Array

    @property
    def length(self) -> int:
        """The cache's capacity in tokens (the length it was sized for at init)."""
        return self.keys.value.shape[1]


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


def append_to_cache(cache: DecodeCache, k: Array, v: Array):
    """Writes the new keys/values at the cache index and returns what to attend over.

    Returns ``(keys [B, S, K, Hqk], values [B, S, K, Hv], causal_offset, kv_lengths, is_causal)``:
    keys past the last written slot are masked by the causal offset (= the index); a single new
    token becomes "keys up to the index", which cuDNN masks natively via ``kv_lengths``.
    """
    t = k.shape[1]
    keys = jax.lax.dynamic_update_slice(cache.keys.value, k.astype(cache.keys.value.dtype), (0, cache.start, 0, 0))
    values = jax.lax.dynamic_update_slice(cache.values.value, v.astype(cache.values.value.dtype), (0, cache.start, 0, 0))
    cache.keys.value, cache.values.value = keys, values
    cache.index.value = cache.start + t
    if t == 1:
        return keys, values, cache.start, jnp.full((k.shape[0],), cache.start + 1, jnp.int32), False
    return keys, values, cache.start, None, True


def poison_overflow(cache: DecodeCache, t: int, out: Array) -> Array:
    """NaN outputs once the cache overflows: ``dynamic_update_slice`` would clamp the write
    silently, and an overflow must not go unnoticed."""
    return jnp.where(cache.start + t > cache.length, jnp.nan, out)


class AttentionLogic:
    """The framework-free part of every layer, inherited by both shells: log-n checks and 1D
    positions. A variant mixin (GOAT's, the baselines') adds three steps, each called once per
    call by :func:`run` in this order:

    * ``_plan(call, shape, request)``: validates everything (before any parameter or cache is
      made), chooses the kernel once (``request.choose(qk_dim, bias)``,
      :class:`goat_jax.layers.call.KernelRequest`) and returns an object with ``qk_dim`` (the key
      width the kernel and cache see), ``implementation`` and ``choice`` (the
      :class:`goat_jax.kernels.Choice`), plus whatever the later steps need.
    * ``_positions(call, plan, t, s)``: ``(q_pos, k_pos)`` :class:`goat_jax.prior.Positions`;
      the default is 1D (:meth:`_positions_1d`).
    * ``_encode(call, shape, plan, q, k, q_pos, k_pos, cache)``: :class:`Encoded` from the raw
      projections q [B, T, N, H], k [B, S, K, H]; ``cache`` is None unless decoding.
    """

    def _training_len(self) -> Optional[int]:
        """The training context length log-n scaling divides by (subclasses say where it is)."""
        return None

    def _check_logn(self, call: AttentionCall) -> None:
        """Raises ValueError naming the field when ``logn_scaling`` cannot run on this call."""
        if self.logn_scaling is None:
            return
        check_logn(self.logn_scaling, self._training_len())
        if call.spatial_shape is not None:
            raise ValueError(f"logn_scaling={self.logn_scaling!r} is for 1D sequences; drop it for 2D "
                             "inputs (spatial_shape was given).")

    def _plan(self, call: AttentionCall, shape: LayerShape, request: KernelRequest) -> Any:
        raise NotImplementedError(f"{type(self).__name__} must define _plan (see AttentionLogic).")

    def _encode(self, call: AttentionCall, shape: LayerShape, plan: Any, q: Array, k: Array,
                q_pos: Any, k_pos: Any, cache: Optional[DecodeCache]) -> Encoded:
        raise NotImplementedError(f"{type(self).__name__} must define _encode (see AttentionLogic).")

    def _positions(self, call: AttentionCall, plan: Any, t: int, s: int):
        """``(q_pos, k_pos)``; subclasses with other position modes (GOAT's 2D) override."""
        return self._positions_1d(call, t, s)

    def _positions_1d(self, call: AttentionCall, t: int, s: int):
        """1D :class:`goat_jax.prior.Positions` of the T queries and S keys. Errors name what
        the caller passed: the explicit positions, the offset, or, while decoding, the KV cache
        (its index is the offset; its length is the length init / ``init_cache`` sized it for)."""
        out = []
        decoding = bool(getattr(self, "decode", False))
        for name, length, offset, explicit in (("q", t, call.position_offset_q, call.q_positions),
                                               ("k", s, call.position_offset_k, call.k_positions)):
            if isinstance(offset, (tuple, list)):
                raise ValueError(f"position_offset_{name} must be an integer (1D positions), got {offset}.")
            if decoding:
                offset_name, length_name = "the KV cache index", (
                    "the KV cache length (init's input length, or init_cache's max_length)")
            else:
                offset_name = f"position_offset_{name}"
                length_name = f"the {'query' if name == 'q' else 'key'} length"
            out.append(prior_lib.positions_1d(length, 0 if offset is None else offset, explicit,
                                              name=f"{name}_positions", offset_name=offset_name,
                                              length_name=length_name))
        return tuple(out)


def run(layer: Any, query: Array, key: Optional[Array] = None, value: Optional[Array] = None, *,
        skip_kernel: bool = False, **options: Any) -> Array:
    """One attention call of ``layer`` (a shell, see the module docstring); ``options`` are the
    layers' call keywords (:class:`goat_jax.layers.call.CallOptions`, declared once; their
    meaning: :class:`goat_jax.layers.linen.AttentionBase`). Returns [B, T, out_features or E].

    ``skip_kernel``: make every parameter the call makes, but attend nothing (the output is the
    output projection of zeros): how the NNX shell creates its parameters at construction.
    """
    (is_causal, key_padding_mask, spatial_shape, has_cls_token, position_offset_q, position_offset_k,
     q_positions, k_positions, segment_ids, kv_segment_ids) = CallOptions.of(type(layer).__name__, options)
    key = query if key is None else key
    value = key if value is None else value
    check_qkv(query, key, value)
    # Before any parameter or cache write (decoding on such a mesh failed in the cache update).
    kernels_mesh.check_axis_types(kernels_mesh.ambient_mesh())
    # Narrow integer positions and offsets become int32 here, where they enter (prior_lib.widen).
    w = prior_lib.widen
    call = AttentionCall(query, key, value, is_causal, key_padding_mask, spatial_shape, has_cls_token,
                         w(position_offset_q), w(position_offset_k), w(q_positions), w(k_positions))
    call = resolve_call_segments(call, segment_ids, kv_segment_ids, layer.decode)
    embed_dim = query.shape[-1]
    kv_heads, head_dim = head_dims(layer.num_heads, layer.kv_num_heads, layer.head_dim, embed_dim)
    shape = LayerShape(layer.num_heads, kv_heads, head_dim,
                       layer.dtype or jnp.result_type(query.dtype, layer.param_dtype), embed_dim,
                       (query.shape[0], layer.num_heads, query.shape[1], layer._attended_length(key.shape[1])))
    # The call's plan (the layer's, or its fields'), and its mask before encoding, from which the
    # variant's plan chooses the kernel once.
    attention_plan = AttentionPlan.merged(layer.plan, implementation=layer.implementation,
                                          max_documents_per_row=layer.max_documents_per_row)
    call_mask = kernels.AttentionMask.build(
        query.shape[0], query.shape[1], key.shape[1], is_causal=is_causal, key_padding_mask=key_padding_mask,
        q_segment_ids=call.q_segment_ids, kv_segment_ids=call.kv_segment_ids, window=attention_plan.window)
    plan = layer._plan(call, shape, KernelRequest(attention_plan, call_mask, bool(layer.decode), shape.dtype,
                                                  shape.logits_shape))
    layer._check_logn(call)

    def proj(x, name, heads, axes):
        return layer._projection(name, "ble,enh->blnh", x, (x.shape[-1], heads, head_dim),
                                 ("embed",) + tuple(axes), 1, shape.dtype)

    q = proj(query, "q_proj", layer.num_heads, ("heads", "kv"))  # [B, T, N, H]
    k = proj(key, "k_proj", kv_heads, ("kv_heads", "kv"))  # [B, S, K, H]
    v = proj(value, "v_proj", kv_heads, ("kv_heads", "kv"))  # [B, S, K, H]
    b, t, s = q.shape[0], q.shape[1], k.shape[1]

    cache = None
    if layer.decode:
        cache = layer._open_cache(
            query=query, key=key, is_causal=is_causal,
            positions_given=q_positions is not None or position_offset_q is not None,
            key_padding_mask=key_padding_mask, key_shape=(b, s, kv_heads, plan.qk_dim),
            value_shape=(b, s, kv_heads, head_dim), dtype=shape.dtype)
        if cache is not None:
            call = call._replace(position_offset_q=cache.start, position_offset_k=cache.start)
    q_pos, k_pos = layer._positions(call, plan, t, s)
    if call.q_segment_ids is not None and (q_pos.is_2d or k_pos.is_2d):
        raise ValueError("segment_ids are for 1D sequences (packed documents); 2D (patch-grid) "
                         "positions have no documents to restart at. Drop segment_ids, or use "
                         "1D positions.")
    enc = layer._encode(call, shape, plan, q, k, q_pos, k_pos, cache)
    if layer.logn_scaling is not None:
        if q_pos.is_2d:
            raise ValueError(f"logn_scaling={layer.logn_scaling!r} is for 1D positions; this call "
                             "uses 2D (row, col) positions.")
        keys_seen = s
        if call.q_segment_ids is not None and not is_causal:
            # Each query's n is the key count of its own document, as when it runs alone.
            keys_seen = jnp.sum(call.q_segment_ids[:, :, None] == call.kv_segment_ids[:, None, :],
                                axis=-1).astype(jnp.float32)  # [B, T]
        enc = apply_logn(enc, logn_factors(q_pos.index, is_causal, keys_seen, layer._training_len()),
                         layer.logn_scaling)

    keys, causal_offset, kv_lengths = enc.k, enc.causal_offset, None
    if cache is not None:
        keys, v, causal_offset, kv_lengths, is_causal = append_to_cache(cache, keys, v)
    sow = layer._wants_attention_maps(plan.implementation)
    if skip_kernel:
        out = jnp.zeros((b, t, layer.num_heads, v.shape[-1]), shape.dtype)
    else:
        # The one mask value of this call, handed to whichever kernel runs it.
        mask = kernels.AttentionMask.build(
            b, t, keys.shape[1], is_causal=is_causal, causal_offset=causal_offset,
            key_padding_mask=key_padding_mask, kv_lengths=kv_lengths,
            q_segment_ids=call.q_segment_ids, kv_segment_ids=call.kv_segment_ids,
            window=attention_plan.window, max_documents=attention_plan.max_documents_per_row)
        out = kernels.attend(enc.q, keys, v, choice=plan.choice, plan=attention_plan, scale=enc.scale,
                             mask=mask, bias=enc.bias, return_probs=sow)  # [B, T, N, Hv]
    if sow:
        out, probs = out
        if cache is None:
            layer._sow_maps(probs, enc.content_keys, v)
        else:
            layer._sow_probs(probs)
    if cache is not None:
        out = poison_overflow(cache, t, out)
    features = layer.out_features or embed_dim
    out = out.astype(shape.dtype)
    return layer._projection("out_proj", "btnh,nhe->bte", out, (out.shape[-2], out.shape[-1], features),
                             ("heads", "kv", "embed"), 2, shape.dtype)
