"""Pieces every attention layer shares: head bookkeeping, projections, the KV cache.

:class:`goat_jax.attention.GoatAttention` and :class:`goat_jax.positional.PositionalAttention`
use these so that they have the same parameter names, logical axes and cache collection and a
model can swap one for the other. Shape legend: B batch, T new tokens, S keys, E model dim,
N query heads, K kv heads, H head dim.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Tuple

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

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
