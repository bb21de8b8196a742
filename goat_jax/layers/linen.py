"""The Linen side of every attention layer: projections, the
KV cache as Linen variables, sowing, and :class:`AttentionBase`, the Linen shell of
:func:`goat_jax.layers.core.run` (the call itself, shared with the NNX shell) that
:class:`goat_jax.layers.goat.GoatAttention` and :class:`goat_jax.layers.positional.PositionalAttention` extend, so that they have the same parameter
names, logical axes and cache collection and a model can swap one for the other.

Shape legend: B batch, T new tokens, S keys, E model dim, N query heads, K kv heads, H head dim.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from goat_jax.layers import core as attention_core
from goat_jax.partitioning import with_logical_partitioning
from goat_jax.plan import AttentionPlan
from goat_jax.layers.core import DecodeCache

Array = jax.Array
Dtype = Any


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


def projection(param, spec: str, x: Array, kernel_shape: Tuple[int, ...], kernel_axes: Tuple[str, ...],
               fan_in_dims: int, use_bias: bool, dtype: Dtype, param_dtype: Dtype,
               init_std: Optional[float] = None) -> Array:
    """``y = einsum(spec, x, kernel) + bias``, the one projection of every shell: ``param(name,
    init, shape, dtype)`` makes or reads the ``kernel`` (full rank, logically named
    ``kernel_axes``, initialized by :func:`projection_init`) and the ``bias`` (zeros; named by the
    output axes) -- Linen's ``Module.param`` or the NNX shell's."""
    kernel = param("kernel", with_logical_partitioning(projection_init(fan_in_dims, init_std), kernel_axes),
                   kernel_shape, param_dtype)
    bias = None
    if use_bias:
        bias = param("bias", with_logical_partitioning(nn.initializers.zeros, kernel_axes[fan_in_dims:]),
                     kernel_shape[fan_in_dims:], param_dtype)
    x, kernel, bias = nn.dtypes.promote_dtype(x, kernel, bias, dtype=dtype)
    y = jnp.einsum(spec, x, kernel)
    return y if bias is None else y + bias


class _Projection(nn.Module):
    """:func:`projection` as a Linen submodule (``q_proj``, ``k_proj``, ``v_proj``, ``out_proj``)."""

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
        return projection(self.param, self.spec, x, self.kernel_shape, self.kernel_axes, self.fan_in_dims,
                          self.use_bias, self.dtype, self.param_dtype, self.init_std)


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


def open_decode_cache(module: nn.Module, *, query: Array, key: Array, is_causal: bool,
                      positions_given: bool, key_padding_mask: Optional[Array],
                      key_shape: Tuple[int, ...], value_shape: Tuple[int, ...], dtype: Dtype
                      ) -> Optional[DecodeCache]:
    """Validates a ``decode=True`` call and creates/reads the cache variables of ``module``.

    ``init`` with a full-length input sizes the cache (``key_shape`` [B, S, K, Hqk],
    ``value_shape`` [B, S, K, Hv]) and returns None: that call is an ordinary forward pass.
    Later calls return the cache to append to (:func:`append_to_cache`).
    """
    attention_core.check_decode_call(query=query, key=key, is_causal=is_causal, positions_given=positions_given,
                                     key_padding_mask=key_padding_mask)
    is_init = not module.has_variable("cache", "cached_key")
    keys = module.variable("cache", "cached_key", jnp.zeros, key_shape, dtype)
    values = module.variable("cache", "cached_value", jnp.zeros, value_shape, dtype)
    index = module.variable("cache", "cache_index", lambda: jnp.array(0, jnp.int32))
    if is_init:
        return None
    attention_core.check_cache_batch(keys.value.shape[0], key_shape[0],
                                     "init (its 'cache' collection) on an input of batch {b} and the full length")
    return DecodeCache(keys, values, index, index.value)


# ----------------------------------------------------------------------------------------------
# The shared attention layer: call signature, projections, positions, cache, kernel, sowing
# ----------------------------------------------------------------------------------------------


class AttentionBase(attention_core.AttentionLogic, nn.Module):
    """Multi-head attention, written once for every layer of this package: GOAT
    (:class:`goat_jax.layers.goat.GoatAttention`) and the position-encoding baselines
    (:class:`goat_jax.layers.positional.PositionalAttention`) differ only in how positions enter.

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
    * ``max_documents_per_row``: the most documents (runs of equal ``segment_ids``, padding
      counting as one) a row may hold, the static size of cuDNN's packed layout (segment ids on
      Hopper GPUs, goat_jax/kernels/cudnn_packed.py); None: the plan's. Other kernels ignore it.
    * ``plan``: how attention runs (:class:`goat_jax.plan.AttentionPlan`: the kernel, the context
      strategy and balancing, the documents bound, a window), as a model hands it to every layer;
      None: a plan of ``implementation`` and ``max_documents_per_row``. Given with either field,
      the two must agree (:meth:`goat_jax.plan.AttentionPlan.merged`).

    This class is the Linen *shell* of :func:`goat_jax.layers.core.run`, which does the work
    of a call: the fields, and the parameters, cache and sowing as Linen variables. A subclass
    adds its fields and a variant mixin (``_plan``, ``_positions``, ``_encode``:
    :class:`goat_jax.layers.core.AttentionLogic`), the same mixin the NNX shell
    (:mod:`goat_jax.nnx`) inherits.
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
    max_documents_per_row: Optional[int] = None
    plan: Optional[AttentionPlan] = None

    # The shell contract of attention_core.run: parameters, cache and sowing as Linen variables.

    def _projection(self, name: str, spec: str, x: Array, kernel_shape: Tuple[int, ...],
                    kernel_axes: Tuple[str, ...], fan_in_dims: int, dtype: Dtype) -> Array:
        """The projection ``name`` as a :class:`_Projection` submodule (its params: kernel, bias)."""
        return _Projection(spec, kernel_shape, kernel_axes, fan_in_dims, self.use_bias, dtype, self.param_dtype,
                           self.kernel_init_std, name=name)(x)

    def _attended_length(self, key_len: int) -> int:
        return attended_length(self, self.decode, key_len)

    def _open_cache(self, **kwargs) -> Optional[DecodeCache]:
        return open_decode_cache(self, **kwargs)

    def _wants_attention_maps(self, implementation: str) -> bool:
        return wants_attention_maps(self, implementation)

    def _sow_maps(self, probs: Array, keys: Array, values: Array) -> None:
        sow_attention_maps(self, probs, keys, values)

    def _sow_probs(self, probs: Array) -> None:
        sow_attention_probs(self, probs)

    @nn.compact
    def __call__(self, query: Array, key: Optional[Array] = None, value: Optional[Array] = None,
                 **options: Any) -> Array:
        """The call (the class docstring); ``options``: the keywords of
        :class:`goat_jax.layers.call.CallOptions`, declared there once."""
        return attention_core.run(self, query, key, value, **options)
