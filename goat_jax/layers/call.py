"""The arguments and results of one attention call, shared by every layer of this package
(:class:`goat_jax.layers.linen.Attention` and its subclasses) and the position encodings:
:class:`AttentionCall` (the call's arguments), :func:`resolve_call_segments` (packed-document
ids and the positions they imply), :class:`LayerShape` (head bookkeeping), :class:`Encoded`
(what position handling hands to the kernel) and log-n scaling of the logits
(:func:`logn_factors`, :func:`apply_logn`).

Shape legend: B batch, T new tokens, S keys, N query heads, K kv heads, H head dim.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple, Optional, Tuple, Union

import jax
import jax.numpy as jnp

from goat_jax import kernels
from goat_jax.prior import segments as segments_lib

Array = jax.Array


# Log-n scaling (docs/protocols.md, Comparators): which part of the logits it multiplies.
LOGN_MODES = ("content", "all")


def check_logn(logn_scaling: Optional[str], training_seq_len: Optional[int], field: str = "training_seq_len") -> None:
    """The one rule of log-n scaling's settings, for the layer and the model configs alike:
    ``logn_scaling`` None or one of :data:`LOGN_MODES`, and then a ``training_seq_len`` >= 2 to
    scale from. ``field`` names the length in the error (``'model.training_seq_len'`` in a config)."""
    if logn_scaling is None:
        return
    if logn_scaling not in LOGN_MODES:
        raise ValueError(f"logn_scaling must be None or one of {LOGN_MODES}, got {logn_scaling!r}.")
    if training_seq_len is None or training_seq_len < 2:
        raise ValueError(f"logn_scaling={logn_scaling!r} needs {field} >= 2 (the training context length it "
                         f"scales from: logits times ln n / ln training_seq_len), got {training_seq_len}.")


def logn_factors(q_index: Array, is_causal: bool, key_len: int, training_len: int) -> Array:
    """Per-query log-n factors ``max(1, ln n / ln training_len)``, [T] or [B, T] float32.

    n is the number of keys the query may attend: ``position + 1`` for a causal query (so a
    decoded token gets the factor of its row in the full forward; Qwen's logn attention, SSMax),
    the key length S for non-causal attention (padding included; with segment ids, ``key_len``
    is [B, T]: the keys of each query's own document).
    """
    n = q_index + 1.0 if is_causal else jnp.asarray(key_len, jnp.float32) * jnp.ones_like(q_index)
    return jnp.maximum(1.0, jnp.log(jnp.maximum(n, 1.0)) / math.log(training_len))


def apply_logn(enc: "Encoded", factors: Array, mode: str) -> "Encoded":
    """Multiplies the queries of ``enc`` row by row by ``factors`` ([T] / [B, T]): the content
    channels only (``mode='content'``: the first ``content_keys.shape[-1]`` channels of q, i.e.
    ``q . k`` of the content), or every packed channel and the bias too (``mode='all'``: the
    whole logit, prior included). In float32, then back to the kernel's dtype. ValueError for
    ``'all'`` on packed position channels in a dtype other than float32 (the packed split would
    be rounded; ``'content'`` leaves those channels alone)."""
    s = factors if factors.ndim == 2 else factors[None]  # [B|1, T]
    d = enc.content_keys.shape[-1]
    if mode == "all" and enc.q.shape[-1] > d and enc.q.dtype != jnp.float32:
        raise ValueError(
            f"logn_scaling='all' with {jnp.dtype(enc.q.dtype).name} queries would round each packed "
            "position channel times the factor to one value of that dtype, breaking the exact split "
            "that carries large position terms (GOAT's sink u(j), packed ALiBi, FoX) far from the "
            "start. Use logn_scaling='content', or dtype float32.")
    qf = enc.q.astype(jnp.float32)
    if mode == "content":
        q = jnp.concatenate([qf[..., :d] * s[:, :, None, None], qf[..., d:]], axis=-1)
        return enc._replace(q=q.astype(enc.q.dtype))
    bias = None if enc.bias is None else enc.bias * s[:, None, :, None]
    return enc._replace(q=(qf * s[:, :, None, None]).astype(enc.q.dtype), bias=bias)


# A position offset: None, an int or traced int scalar (1D), or a (row, col) pair (GOAT's 2D mode).
Offset = Union[None, int, Array, Tuple[int, int]]


class CallOptions(NamedTuple):
    """The keywords of every attention layer's call, declared once: both shells' ``__call__``
    (Linen, :class:`goat_jax.layers.linen.Attention`; NNX, :mod:`goat_jax.layers.nnx`) take
    ``layer(query, key=None, value=None, **options)`` and :func:`goat_jax.layers.core.run` reads
    the options here (:meth:`of`). Their meaning: :class:`goat_jax.layers.linen.Attention`."""

    is_causal: bool = False
    key_padding_mask: Optional[Array] = None  # [B, S] bool, True = padding
    spatial_shape: Optional[Tuple[int, ...]] = None
    has_cls_token: Optional[bool] = None
    position_offset_q: Offset = None
    position_offset_k: Offset = None
    q_positions: Optional[Array] = None
    k_positions: Optional[Array] = None
    segment_ids: Optional[Array] = None
    kv_segment_ids: Optional[Array] = None

    @classmethod
    def of(cls, owner: str, options: dict) -> "CallOptions":
        """The options of a call of ``owner`` (a layer's class name, for the error): TypeError
        naming any keyword the call does not take, and the ones it does."""
        unknown = sorted(set(options) - set(cls._fields))
        if unknown:
            raise TypeError(f"{owner}() got unexpected keyword argument(s) {unknown}; its call takes "
                            f"(query, key=None, value=None, *, {', '.join(cls._fields)}).")
        return cls(**options)


class AttentionCall(NamedTuple):
    """The arguments of one attention call (see :class:`goat_jax.layers.linen.Attention`), with ``key`` and
    ``value`` already defaulted; while decoding, both offsets are the cache index."""

    query: Array
    key: Array
    value: Array
    is_causal: bool
    key_padding_mask: Optional[Array]
    spatial_shape: Optional[Tuple[int, ...]]
    has_cls_token: Optional[bool]
    position_offset_q: Offset
    position_offset_k: Offset
    q_positions: Optional[Array]
    k_positions: Optional[Array]
    # [B, T] / [B, S] int32 document ids (None without segments); with them, q_positions /
    # k_positions are the per-document positions unless the caller gave explicit ones.
    q_segment_ids: Optional[Array] = None
    kv_segment_ids: Optional[Array] = None


def resolve_call_segments(call: AttentionCall, segment_ids: Optional[Array],
                          kv_segment_ids: Optional[Array], decode: bool) -> AttentionCall:
    """Validates a call's segment ids and returns the call with ``q_segment_ids`` /
    ``kv_segment_ids`` set and, where no explicit positions were given, ``q_positions`` /
    ``k_positions`` restarting at 0 at each segment (:func:`goat_jax.prior.segments.segment_positions`).

    Every check runs before any parameter or cache is made. Raises ValueError naming the
    argument for: ``kv_segment_ids`` without ``segment_ids``; cross-attention (key is not query)
    without ``kv_segment_ids``; wrong shape or dtype; ids that re-appear after another id in a
    row, or explicit positions that do not restart at 0 where the ids change (both only when
    concrete: under ``jit`` traced ids and positions are used as given); position offsets
    (documents start at 0); ``decode=True``. Decoding is refused rather than supported within
    one segment because the cache holds one sequence per row: a packed prompt's documents would
    share it, and a decoded document is simply a row of its own.
    """
    if segment_ids is None:
        if kv_segment_ids is not None:
            raise ValueError("kv_segment_ids needs segment_ids (the queries' ids) as well.")
        return call
    if decode:
        raise ValueError(
            "segment_ids are not supported with decode=True: the KV cache holds one sequence per "
            "row, so decode each document in a row of its own (without segment_ids).")
    self_attention = call.key is call.query
    if kv_segment_ids is None:
        if not self_attention:
            raise ValueError("Cross-attention with segment_ids needs kv_segment_ids [B, S], the "
                             "keys' document ids.")
        kv_segment_ids = segment_ids
    if call.spatial_shape is not None:
        raise ValueError("segment_ids are for 1D sequences (packed documents); a patch grid "
                         "(spatial_shape) has no documents. Drop segment_ids or spatial_shape.")
    b, t, s = call.query.shape[0], call.query.shape[1], call.key.shape[1]
    q_ids, kv_ids = kernels.check_segment_ids(b, t, s, q_segment_ids=segment_ids,
                                              kv_segment_ids=kv_segment_ids)
    names = ("segment_ids", "segment_ids" if self_attention and kv_segment_ids is segment_ids else "kv_segment_ids")
    for ids, name in zip((q_ids, kv_ids), names):
        segments_lib.check_contiguous(ids, name)
    for which, offset in (("q", call.position_offset_q), ("k", call.position_offset_k)):
        if offset is not None:
            raise ValueError(f"position_offset_{which} cannot be combined with segment_ids: positions "
                             "restart at 0 in every segment. Pass explicit positions instead.")
    positions = []
    for name, explicit, ids, ids_name in (("q_positions", call.q_positions, q_ids, names[0]),
                                          ("k_positions", call.k_positions, kv_ids, names[1])):
        if explicit is None:
            positions.append(segments_lib.segment_positions(ids))
        else:
            segments_lib.check_positions_agree(explicit, ids, name, ids_name)
            positions.append(explicit)
    return call._replace(q_segment_ids=q_ids, kv_segment_ids=kv_ids, q_positions=positions[0],
                         k_positions=positions[1])


class LayerShape(NamedTuple):
    """Head bookkeeping of one call: N query heads, K kv heads, H head dim, the compute dtype,
    E the model dim and the (B, N, T, S attended) logits shape the automatic kernel choice reads."""

    num_heads: int
    kv_heads: int
    head_dim: int
    dtype: Any
    embed_dim: int
    logits_shape: Tuple[int, int, int, int]

    @property
    def group(self) -> int:
        """G = N // K, the query heads sharing one kv head."""
        return self.num_heads // self.kv_heads


class Encoded(NamedTuple):
    """What a layer's position handling hands to the kernel.

    Attributes:
      q: [B, T, N, Hqk] queries as the kernel sees them (rotated, packed, ...).
      k: [B, S, K, Hqk] keys as the kernel sees them: what the KV cache stores.
      scale: the factor on ``q . k`` (1.0 when a scale is folded into packed queries).
      content_keys: [B, S, K, Hk] keys before any position encoding (sown for evaluations).
      causal_offset: shift of the causal mask (GOAT's 1D offsets; replaced by the cache index
        while decoding).
      bias: None, or an additive [B or 1, N, T, S attended] float32 bias (xla/dense kernels).
    """

    q: Array
    k: Array
    scale: float
    content_keys: Array
    causal_offset: Any = 0
    bias: Optional[Array] = None


class KernelRequest(NamedTuple):
    """What a layer's variant needs to choose the call's kernel once (:meth:`choose`): the call's
    :class:`goat_jax.kernels.plan.AttentionPlan`, its mask before encoding (segment ids, key padding, the
    plan's window: the mask's own rules say which features the call needs), whether it decodes
    (a traced cache index), the compute dtype and the logits shape."""

    plan: Any
    mask: Any  # goat_jax.kernels.AttentionMask
    decoding: bool
    dtype: Any
    logits_shape: Tuple[int, int, int, int]

    def choose(self, qk_dim: int, bias: bool = False) -> "kernels.Choice":
        """The call's kernel for a ``qk_dim``-wide q/k (with an additive bias when ``bias``),
        chosen (or the plan's checked) once: :func:`goat_jax.kernels.choose`."""
        uses = self.mask.features()
        uses["traced_offset"] = uses["traced_offset"] or self.decoding
        return kernels.choose(self.plan.implementation, self.dtype, qk_dim, self.logits_shape, plan=self.plan,
                              bias=bias, **uses)
