"""The Linen attention layer: :class:`Attention`, the Linen shell of :mod:`goat_jax.layers.core`.

It holds a position encoding (a value, :mod:`goat_jax.layers.encoding`) and, at each call, plans
the call (:func:`goat_jax.layers.core.prepare`), makes the declared parameters and cache slots as
Linen variables, runs the call (:func:`goat_jax.layers.core.run`) on their values, writes the
cache's new values back and sows the attention maps it returns. The public layers are this class
with their encodings' settings as fields: :class:`goat_jax.layers.goat.GoatAttention` and
:class:`goat_jax.layers.positional.PositionalAttention`; they have the same parameter names,
logical axes and cache collection, so a model can swap one for the other.

Shape legend: B batch, T new tokens, S keys, E model dim, N query heads, K kv heads, H head dim.
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Optional, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from goat_jax.layers import core as attention_core
from goat_jax.layers.encoding import Encoding, ParamDecl
from goat_jax.kernels.plan import AttentionPlan

Array = jax.Array
Dtype = Any


class _ParamGroup(nn.Module):
    """The parameters declared under one name (``q_proj``, ``prior``): a Linen submodule of that
    name making them in declaration order, so the Linen tree is ``{group: {param: ...}}``."""

    decls: Tuple[Tuple[str, Any, Tuple[Any, ...]], ...]

    @nn.compact
    def __call__(self) -> Dict[str, Any]:
        return {name: self.param(name, init, *args) for name, init, args in self.decls}


def make_params(module: nn.Module, decls: Tuple[ParamDecl, ...]) -> Dict[str, Any]:
    """Makes (at ``init``) or reads the declared parameters of ``module``: ``{decl.name: value}``.
    A one-part path is a parameter of ``module`` itself; a two-part path ``(group, name)`` a
    parameter of the submodule ``group`` (its declarations made together, in order)."""
    values: Dict[str, Any] = {}
    groups: Dict[str, list] = {}
    for decl in decls:
        if len(decl.path) == 1:
            values[decl.name] = module.param(decl.path[0], decl.init, *decl.args)
        elif len(decl.path) == 2:
            groups.setdefault(decl.path[0], []).append((decl.path[1], decl.init, tuple(decl.args)))
        else:
            raise ValueError(f"{type(module).__name__}: parameter {decl.name} is nested deeper than one group.")
    for group, group_decls in groups.items():
        made = _ParamGroup(tuple(group_decls), name=group)()
        values.update({f"{group}/{name}": value for name, value in made.items()})
    return values


def layer_spec(module: nn.Module) -> attention_core.LayerSpec:
    """The common fields of a Linen attention layer as a :class:`goat_jax.layers.core.LayerSpec`."""
    return attention_core.LayerSpec.of(vars(module), type(module).__name__)


class Attention(nn.Module):
    """Multi-head attention with a position encoding held as a value (``encoding``, or the one a
    subclass builds from its fields in :meth:`attention_encoding`): GOAT
    (:class:`goat_jax.layers.goat.GoatAttention`) and the baselines
    (:class:`goat_jax.layers.positional.PositionalAttention`) are this layer.

    Call: ``module(query, key=None, value=None, *, is_causal=False, key_padding_mask=None,
    spatial_shape=None, has_cls_token=None, position_offset_q=None, position_offset_k=None,
    q_positions=None, k_positions=None, segment_ids=None, kv_segment_ids=None)`` with
    ``query`` [B, T, E] and ``key``/``value`` [B, S, E'] (default: ``query``, i.e.
    self-attention). Returns [B, T, out_features or E].

    * ``key_padding_mask``: [B, S] bool, True = padding (PyTorch/official convention).
    * 1D positions: ``arange + position_offset_*`` (default 0, and the cache index while
      decoding) or explicit integer ``q_positions`` / ``k_positions`` ([T] / [B, T]).
    * ``segment_ids`` [B, T] integer ids (document-aware packing;
      :func:`goat_jax.layers.call.resolve_call_segments`): a query attends only to keys of its own
      id, and positions restart at 0 at each run of equal ids, so every encoding sees each
      document as if it ran alone. ``kv_segment_ids`` [B, S] gives the keys' ids for
      cross-attention. Padding is a run of its own id (``goat_jax.data.packing.PAD_SEGMENT_ID``):
      it attends only to padding, never to a document, and its outputs carry weight 0 in the loss.
    * ``decode=True``: KV-cache decoding in the 'cache' collection (``cached_key``,
      ``cached_value``, ``cache_index``): ``init`` with a full-length input sizes the cache;
      each ``apply(..., mutable=['cache'])`` appends the new tokens at the cache index and
      attends causally over the cache, which holds keys as the kernel sees them.
    * With ``implementation='dense'`` and ``mutable=['intermediates']``, the layer sows its
      attention probabilities ``attention_probs`` [B, N, T, S] float32 (after masking), the
      content keys ``attention_keys`` (before any position encoding) and the values
      ``attention_values``; while decoding, the probabilities of the chunk over the cache only.
    * ``kernel_init_std``: None draws the q/k/v/out projection kernels Xavier-uniform (the
      official module's own init); a float draws them ``N(0, kernel_init_std)``
      (:func:`goat_jax.layers.core.projection_init`). Biases start at zero either way.
    * ``logn_scaling``: None, or log-n scaling of the logits (1D positions): each query row is
      multiplied by ``max(1, ln n / ln training_seq_len)`` (:func:`goat_jax.layers.call.logn_factors`)
      before the kernel, so every kernel runs it; 'content' scales the content logits ``q . k``
      only, 'all' the whole logit including a packed or materialized prior
      (:func:`goat_jax.layers.call.apply_logn`).
    * ``max_documents_per_row``: the most documents (runs of equal ``segment_ids``, padding
      counting as one) a row may hold, the static size of cuDNN's packed layout (segment ids on
      Hopper GPUs, goat_jax/kernels/cudnn_packed.py); None: the plan's. Other kernels ignore it.
    * ``plan``: how attention runs (:class:`goat_jax.kernels.plan.AttentionPlan`: the kernel, the context
      strategy and balancing, the documents bound, a window), as a model hands it to every layer;
      None: a plan of ``implementation`` and ``max_documents_per_row``. Given with either field,
      the two must agree (:meth:`goat_jax.kernels.plan.AttentionPlan.merged`).
    * ``encoding``: the position encoding (:class:`goat_jax.layers.encoding.Encoding`), for a
      layer built on one directly (``Attention(num_heads=4, encoding=MyEncoding())``).
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
    encoding: Optional[Encoding] = None

    def __post_init__(self):
        layer_spec(self).check()  # at construction, as the NNX layer does
        if self.encoding is not None and type(self).encoding_of.__func__ is not Attention.encoding_of.__func__:
            raise ValueError(f"{type(self).__name__} builds its encoding from its own fields; encoding= is for "
                             "goat_jax.layers.linen.Attention (a layer on any encoding).")
        super().__post_init__()

    @classmethod
    def encoding_of(cls, fields: Mapping[str, Any]) -> Encoding:
        """The encoding a layer of this class with ``fields`` holds (the NNX twin builds it from
        the same fields): here the ``encoding`` field; subclasses build it from theirs."""
        if not isinstance(fields.get("encoding"), Encoding):
            raise ValueError(f"{cls.__name__} needs encoding=, a goat_jax.layers.encoding.Encoding; got "
                             f"{type(fields.get('encoding')).__name__}.")
        return fields["encoding"]

    @nn.compact
    def __call__(self, query: Array, key: Optional[Array] = None, value: Optional[Array] = None,
                 **options: Any) -> Array:
        """The call (the class docstring); ``options``: the keywords of
        :class:`goat_jax.layers.call.CallOptions`, declared there once."""
        cache_shape = None
        if self.decode and self.has_variable("cache", "cached_key"):
            cache_shape = self.get_variable("cache", "cached_key").shape
        plan = attention_core.prepare(layer_spec(self), self.encoding_of(vars(self)), query, key, value,
                                      cache_shape=cache_shape, **options)
        params = make_params(self, plan.params)
        slots, cache = {}, None
        if self.decode:
            slots = {d.name: self.variable("cache", d.name, d.init, *d.args) for d in plan.cache}
            if cache_shape is not None:  # else init: an ordinary forward that sizes the cache
                cache = {name: slot.value for name, slot in slots.items()}
        result = attention_core.run(plan, params, cache, want_maps=self.is_mutable_collection("intermediates"))
        for name, value_ in (result.cache or {}).items():
            slots[name].value = value_
        for name, value_ in result.maps.items():
            self.sow("intermediates", name, value_)
        return result.out
