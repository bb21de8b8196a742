"""Pieces every attention layer shares: head bookkeeping, projections, the KV cache, and
:class:`AttentionBase`, the one layer shell (call signature, projections, positions, cache,
kernel call, sowing) that :class:`goat_jax.attention.GoatAttention` and
:class:`goat_jax.positional.PositionalAttention` extend, so that they have the same parameter
names, logical axes and cache collection and a model can swap one for the other.

Shape legend: B batch, T new tokens, S keys, E model dim, N query heads, K kv heads, H head dim.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Tuple

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from goat_jax import kernels
from goat_jax import prior as prior_lib
from goat_jax.attention_call import (
    LOGN_MODES, AttentionCall, Encoded, LayerShape, Offset, apply_logn, logn_factors, resolve_call_segments)

Array = jax.Array
Dtype = Any


class LogicallyPartitioned(nn.LogicallyPartitioned):
    """``nn.LogicallyPartitioned`` that also works from Flax NNX without a mesh.

    ``flax.nnx.bridge.ToNNX`` turns each box into an ``nnx.Variable``, which by default shards
    its value eagerly to the box's names and raises without a mesh ("An auto mesh context or
    metadata is required ..."). Without a mesh there is nothing to shard to, so the box asks for
    no eager sharding then; under a mesh it behaves exactly as Flax's own box.
    """

    def to_nnx_metadata(self) -> dict:
        """The ``nnx.Variable`` metadata; ``eager_sharding=False`` when no mesh is defined."""
        metadata = super().to_nnx_metadata()
        if self.mesh is None and not flax.core.meta.global_mesh_defined():
            metadata["eager_sharding"] = False
        return metadata


def with_logical_partitioning(fn, names: Tuple[Optional[str], ...]):
    """``nn.with_logical_partitioning`` with the NNX-friendly :class:`LogicallyPartitioned`."""
    def init(*args, **kwargs):
        return LogicallyPartitioned(fn(*args, **kwargs), names)
    return init


# The official module initializes each projection xavier-uniform over the whole [in, out]
# matrix (fans = E and N * H), which _xavier_over_matrix reproduces.
_xavier = nn.initializers.xavier_uniform()


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


class _Projection(nn.Module):
    """``y = einsum(spec, x, kernel) + bias`` with a full-rank logically named kernel
    (initialized by :func:`projection_init`; biases start at zero)."""

    spec: str
    kernel_shape: Tuple[int, ...]
    kernel_axes: Tuple[str, ...]
    fan_in_dims: int
    use_bias: bool
    dtype: Dtype
    param_dtype: Dtype
    init_std: Optional[float] = None

    @nn.compact
    def __call__(self, x: Array) -> Array:
        kernel = self.param("kernel", with_logical_partitioning(
            projection_init(self.fan_in_dims, self.init_std), self.kernel_axes), self.kernel_shape,
            self.param_dtype)
        bias = None
        if self.use_bias:
            out_shape = self.kernel_shape[self.fan_in_dims:]
            bias = self.param("bias", with_logical_partitioning(
                nn.initializers.zeros, self.kernel_axes[self.fan_in_dims:]), out_shape, self.param_dtype)
        x, kernel, bias = nn.dtypes.promote_dtype(x, kernel, bias, dtype=self.dtype)
        y = jnp.einsum(self.spec, x, kernel)
        return y if bias is None else y + bias


def project_heads(x: Array, name: str, heads: int, head_dim: int, axes: Tuple[str, str],
                  use_bias: bool, dtype: Dtype, param_dtype: Dtype,
                  init_std: Optional[float] = None) -> Array:
    """``[B, L, E] -> [B, L, heads, head_dim]`` (``q_proj``/``k_proj``/``v_proj``; kernel
    ``[E, heads, head_dim]``); ``axes`` are the logical names of the two output dims, e.g.
    ``('heads', 'kv')``. ``init_std``: see :func:`projection_init`."""
    return _Projection("ble,enh->blnh", (x.shape[-1], heads, head_dim), ("embed",) + tuple(axes), 1,
                       use_bias, dtype, param_dtype, init_std, name=name)(x)


def project_out(out: Array, features: int, use_bias: bool, dtype: Dtype, param_dtype: Dtype,
                init_std: Optional[float] = None) -> Array:
    """``[B, T, N, H] -> [B, T, features]`` (``out_proj``; kernel ``[N, H, features]``).
    ``init_std``: see :func:`projection_init`."""
    return _Projection("btnh,nhe->bte", (out.shape[-2], out.shape[-1], features), ("heads", "kv", "embed"), 2,
                       use_bias, dtype, param_dtype, init_std, name="out_proj")(out.astype(dtype))


def wants_attention_maps(module: nn.Module, implementation: str) -> bool:
    """True when ``module`` should sow its attention: the 'dense' kernel (the only one with
    materialized probabilities) and a mutable 'intermediates' collection (the caller asked)."""
    return implementation == "dense" and module.is_mutable_collection("intermediates")


def sow_attention_maps(module: nn.Module, probs: Array, keys: Array, values: Array) -> None:
    """Sows what evaluations read from any attention layer, in 'intermediates':
    ``attention_probs`` [B, N, T, S] float32 (after masking, the softmax the layer applied),
    ``attention_keys`` [B, S, K, Hk] (the content keys before any position encoding: GOAT's
    content dims, the raw projection for RoPE) and ``attention_values`` [B, S, K, H]."""
    module.sow("intermediates", "attention_probs", probs)
    module.sow("intermediates", "attention_keys", keys)
    module.sow("intermediates", "attention_values", values)


def sow_attention_probs(module: nn.Module, probs: Array) -> None:
    """While decoding (a chunk of T queries against the S cached slots), only
    ``attention_probs`` [B, N, T, S] float32 is sown: the cache holds keys as the kernel sees
    them (packed, rotated), not the content keys :func:`sow_attention_maps` promises."""
    module.sow("intermediates", "attention_probs", probs)


def attended_length(module: nn.Module, decode: bool, key_len: int) -> int:
    """S, the number of keys the kernel attends over: the cache's length while decoding (after
    ``init`` sized it), else ``key_len``. The automatic kernel choice reads it, so that a chunk
    of queries against a long cache gets the memory-linear kernel, not T x S_cache logits."""
    if decode and module.has_variable("cache", "cached_key"):
        return module.get_variable("cache", "cached_key").shape[1]
    return key_len


class DecodeCache(NamedTuple):
    """The 'cache' collection of a decoding layer (Flax variables) and the index before this
    call. Keys are stored as the kernel sees them (packed for GOAT, rotated for RoPE)."""

    keys: Any
    values: Any
    index: Any
    start: Array

    @property
    def length(self) -> int:
        return self.keys.value.shape[1]


def open_decode_cache(module: nn.Module, *, query: Array, key: Array, is_causal: bool,
                      positions_given: bool, key_padding_mask: Optional[Array],
                      key_shape: Tuple[int, ...], value_shape: Tuple[int, ...], dtype: Dtype
                      ) -> Optional[DecodeCache]:
    """Validates a ``decode=True`` call and creates/reads the cache variables of ``module``.

    ``init`` with a full-length input sizes the cache (``key_shape`` [B, S, K, Hqk],
    ``value_shape`` [B, S, K, Hv]) and returns None: that call is an ordinary forward pass.
    Later calls return the cache to append to (:func:`append_to_cache`).
    """
    if query is not key or not is_causal:
        raise ValueError("decode=True supports causal self-attention only (call with is_causal=True).")
    if positions_given:
        raise ValueError("decode=True takes positions from the cache index; do not pass positions.")
    if key_padding_mask is not None:
        raise ValueError("key_padding_mask is not supported while decoding.")
    is_init = not module.has_variable("cache", "cached_key")
    keys = module.variable("cache", "cached_key", jnp.zeros, key_shape, dtype)
    values = module.variable("cache", "cached_value", jnp.zeros, value_shape, dtype)
    index = module.variable("cache", "cache_index", lambda: jnp.array(0, jnp.int32))
    return None if is_init else DecodeCache(keys, values, index, index.value)


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


# ----------------------------------------------------------------------------------------------
# The shared attention layer: call signature, projections, positions, cache, kernel, sowing
# ----------------------------------------------------------------------------------------------


class AttentionBase(nn.Module):
    """Multi-head attention, written once for every layer of this package: GOAT
    (:class:`goat_jax.attention.GoatAttention`) and the position-encoding baselines
    (:class:`goat_jax.positional.PositionalAttention`) differ only in how positions enter.

    Call: ``module(query, key=None, value=None, *, is_causal=False, key_padding_mask=None,
    spatial_shape=None, has_cls_token=None, position_offset_q=None, position_offset_k=None,
    q_positions=None, k_positions=None, segment_ids=None, kv_segment_ids=None)`` with
    ``query`` [B, T, E] and ``key``/``value`` [B, S, E'] (default: ``query``, i.e.
    self-attention). Returns [B, T, out_features or E].

    * ``key_padding_mask``: [B, S] bool, True = padding (PyTorch/official convention).
    * 1D positions: ``arange + position_offset_*`` (default 0, and the cache index while
      decoding) or explicit integer ``q_positions`` / ``k_positions`` ([T] / [B, T]).
    * ``segment_ids`` [B, T] integer ids (document-aware packing; :func:`resolve_call_segments`):
      a query attends only to keys of its own id, and positions restart at 0 at each run of
      equal ids, so every encoding sees each document as if it ran alone. ``kv_segment_ids``
      [B, S] gives the keys' ids for cross-attention. Padding is a run of its own id
      (``goat_jax.data.packing.PAD_SEGMENT_ID``): it attends only to padding, never to a
      document, and its outputs carry weight 0 in the loss.
    * ``decode=True``: KV-cache decoding in the 'cache' collection (``cached_key``,
      ``cached_value``, ``cache_index``): ``init`` with a full-length input sizes the cache;
      each ``apply(..., mutable=['cache'])`` appends the new tokens at the cache index and
      attends causally over the cache, which holds keys as the kernel sees them.
    * With ``implementation='dense'`` and ``mutable=['intermediates']``, the layer sows its
      attention probabilities, content keys and values (:func:`sow_attention_maps`); while
      decoding, the probabilities of the chunk over the cache only.
    * ``kernel_init_std``: None draws the q/k/v/out projection kernels Xavier-uniform (the
      official module's own init); a float draws them ``N(0, kernel_init_std)``
      (:func:`projection_init`). Biases start at zero either way.
    * ``logn_scaling``: None, or log-n scaling of the logits (1D positions): each query row is
      multiplied by ``max(1, ln n / ln training_seq_len)`` (:func:`logn_factors`) before the
      kernel, so every kernel runs it; 'content' scales the content logits ``q . k`` only, 'all'
      the whole logit including a packed or materialized prior (:func:`apply_logn`).

    A subclass adds its fields and three steps, each called once per call in this order:

    * ``_plan(call, shape)``: validates everything (before any parameter or cache is made) and
      returns an object with ``qk_dim`` (the key width the kernel and cache see) and
      ``implementation`` (a resolved kernel name), plus whatever the later steps need.
    * ``_positions(call, plan, t, s)``: ``(q_pos, k_pos)`` :class:`goat_jax.prior.Positions`;
      the default is 1D (:meth:`_positions_1d`).
    * ``_encode(call, shape, plan, q, k, q_pos, k_pos, cache)``: :class:`Encoded` from the raw
      projections q [B, T, N, H], k [B, S, K, H]; ``cache`` is None unless decoding.
    """

    num_heads: int
    kv_num_heads: Optional[int] = None
    head_dim: Optional[int] = None
    out_features: Optional[int] = None
    use_bias: bool = True
    dtype: Optional[Dtype] = None
    param_dtype: Dtype = jnp.float32
    implementation: Optional[str] = None
    decode: bool = False
    kernel_init_std: Optional[float] = None
    logn_scaling: Optional[str] = None

    def _training_len(self) -> Optional[int]:
        """The training context length log-n scaling divides by (subclasses say where it is)."""
        return None

    def _check_logn(self, call: AttentionCall) -> None:
        """Raises ValueError naming the field when ``logn_scaling`` cannot run on this call."""
        if self.logn_scaling is None:
            return
        if self.logn_scaling not in LOGN_MODES:
            raise ValueError(f"logn_scaling must be None or one of {LOGN_MODES}, got {self.logn_scaling!r}.")
        length = self._training_len()
        if length is None or length < 2:
            raise ValueError(f"logn_scaling={self.logn_scaling!r} needs training_seq_len >= 2 (it scales "
                             f"logits by ln n / ln training_seq_len), got {length}.")
        if call.spatial_shape is not None:
            raise ValueError(f"logn_scaling={self.logn_scaling!r} is for 1D sequences; drop it for 2D "
                             "inputs (spatial_shape was given).")

    def _plan(self, call: AttentionCall, shape: LayerShape) -> Any:
        raise NotImplementedError(f"{type(self).__name__} must define _plan (see AttentionBase).")

    def _encode(self, call: AttentionCall, shape: LayerShape, plan: Any, q: Array, k: Array,
                q_pos: Any, k_pos: Any, cache: Optional["DecodeCache"]) -> Encoded:
        raise NotImplementedError(f"{type(self).__name__} must define _encode (see AttentionBase).")

    def _positions(self, call: AttentionCall, plan: Any, t: int, s: int):
        """``(q_pos, k_pos)``; subclasses with other position modes (GOAT's 2D) override."""
        return self._positions_1d(call, t, s)

    @staticmethod
    def _positions_1d(call: AttentionCall, t: int, s: int):
        """1D :class:`goat_jax.prior.Positions` of the T queries and S keys."""
        out = []
        for name, length, offset, explicit in (("q", t, call.position_offset_q, call.q_positions),
                                               ("k", s, call.position_offset_k, call.k_positions)):
            if isinstance(offset, (tuple, list)):
                raise ValueError(f"position_offset_{name} must be an integer (1D positions), got {offset}.")
            out.append(prior_lib.positions_1d(length, 0 if offset is None else offset, explicit,
                                              name=f"{name}_positions"))
        return tuple(out)

    @nn.compact
    def __call__(
        self,
        query: Array,
        key: Optional[Array] = None,
        value: Optional[Array] = None,
        *,
        is_causal: bool = False,
        key_padding_mask: Optional[Array] = None,
        spatial_shape: Optional[Tuple[int, ...]] = None,
        has_cls_token: Optional[bool] = None,
        position_offset_q: Offset = None,
        position_offset_k: Offset = None,
        q_positions: Optional[Array] = None,
        k_positions: Optional[Array] = None,
        segment_ids: Optional[Array] = None,
        kv_segment_ids: Optional[Array] = None,
    ) -> Array:
        key = query if key is None else key
        value = key if value is None else value
        check_qkv(query, key, value)
        call = AttentionCall(query, key, value, is_causal, key_padding_mask, spatial_shape, has_cls_token,
                             position_offset_q, position_offset_k, q_positions, k_positions)
        call = resolve_call_segments(call, segment_ids, kv_segment_ids, self.decode)
        embed_dim = query.shape[-1]
        kv_heads, head_dim = head_dims(self.num_heads, self.kv_num_heads, self.head_dim, embed_dim)
        shape = LayerShape(self.num_heads, kv_heads, head_dim,
                           self.dtype or jnp.result_type(query.dtype, self.param_dtype), embed_dim,
                           (query.shape[0], self.num_heads, query.shape[1],
                            attended_length(self, self.decode, key.shape[1])))
        plan = self._plan(call, shape)
        if (call.q_segment_ids is not None and plan.implementation == "cudnn"
                and self.implementation in (None, "auto")):
            # The automatic choice must not pick the one kernel that refuses segment ids.
            kernels.log_once("goat_jax: segment_ids use implementation 'flash' (cuDNN's fused "
                             "attention in jax cannot take them).")
            plan = plan._replace(implementation="flash")
        self._check_logn(call)

        proj = lambda x, name, heads, axes: project_heads(
            x, name, heads, head_dim, axes, self.use_bias, shape.dtype, self.param_dtype, self.kernel_init_std)
        q = proj(query, "q_proj", self.num_heads, ("heads", "kv"))  # [B, T, N, H]
        k = proj(key, "k_proj", kv_heads, ("kv_heads", "kv"))  # [B, S, K, H]
        v = proj(value, "v_proj", kv_heads, ("kv_heads", "kv"))  # [B, S, K, H]
        b, t, s = q.shape[0], q.shape[1], k.shape[1]

        cache = None
        if self.decode:
            cache = open_decode_cache(
                self, query=query, key=key, is_causal=is_causal,
                positions_given=q_positions is not None or position_offset_q is not None,
                key_padding_mask=key_padding_mask, key_shape=(b, s, kv_heads, plan.qk_dim),
                value_shape=(b, s, kv_heads, head_dim), dtype=shape.dtype)
            if cache is not None:
                call = call._replace(position_offset_q=cache.start, position_offset_k=cache.start)
        q_pos, k_pos = self._positions(call, plan, t, s)
        if call.q_segment_ids is not None and (q_pos.is_2d or k_pos.is_2d):
            raise ValueError("segment_ids are for 1D sequences (packed documents); 2D (patch-grid) "
                             "positions have no documents to restart at. Drop segment_ids, or use "
                             "1D positions.")
        enc = self._encode(call, shape, plan, q, k, q_pos, k_pos, cache)
        if self.logn_scaling is not None:
            if q_pos.is_2d:
                raise ValueError(f"logn_scaling={self.logn_scaling!r} is for 1D positions; this call "
                                 "uses 2D (row, col) positions.")
            keys_seen = s
            if call.q_segment_ids is not None and not is_causal:
                # Each query's n is the key count of its own document, as when it runs alone.
                keys_seen = jnp.sum(call.q_segment_ids[:, :, None] == call.kv_segment_ids[:, None, :],
                                    axis=-1).astype(jnp.float32)  # [B, T]
            enc = apply_logn(enc, logn_factors(q_pos.index, is_causal, keys_seen, self._training_len()),
                             self.logn_scaling)

        keys, causal_offset, kv_lengths = enc.k, enc.causal_offset, None
        if cache is not None:
            keys, v, causal_offset, kv_lengths, is_causal = append_to_cache(cache, keys, v)
        sow = wants_attention_maps(self, plan.implementation)
        out = kernels.attend(enc.q, keys, v, implementation=plan.implementation, scale=enc.scale,
                             is_causal=is_causal, causal_offset=causal_offset,
                             key_padding_mask=key_padding_mask, kv_lengths=kv_lengths, bias=enc.bias,
                             q_segment_ids=call.q_segment_ids, kv_segment_ids=call.kv_segment_ids,
                             return_probs=sow)  # [B, T, N, Hv]
        if sow:
            out, probs = out
            if cache is None:
                sow_attention_maps(self, probs, enc.content_keys, v)
            else:
                sow_attention_probs(self, probs)
        if cache is not None:
            out = poison_overflow(cache, t, out)
        return project_out(out, self.out_features or embed_dim, self.use_bias, shape.dtype, self.param_dtype,
                           self.kernel_init_std)
