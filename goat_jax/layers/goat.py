"""GOAT attention: the prior's parameter declarations, the :class:`GoatPrior` module, GOAT as a
position encoding (:class:`GoatEncoding`, a value) and the Linen layer that holds it
(:class:`GoatAttention`).

The prior's math is :mod:`goat_jax.prior` (pure functions) and its packing into q/k channels
(with the bf16-exact sink channels) :mod:`goat_jax.prior.packing`; this module holds the Flax side.

Shape legend: B batch, T queries, S keys, E model dim, N query heads, K kv heads, H head dim.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, NamedTuple, Optional, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from goat_jax.layers import call as attention_call
from goat_jax.layers import encoding as encoding_lib
from goat_jax import kernels
from goat_jax.kernels import widths as kernel_widths
from goat_jax import partitioning
from goat_jax.layers import linen
from goat_jax import prior as prior_lib
from goat_jax.prior.packing import pack_key, pack_query, packed_sink_channels

Array = jax.Array
Dtype = Any


# ----------------------------------------------------------------------------------------------
# The prior module: owns the parameters, calls goat_jax.prior
# ----------------------------------------------------------------------------------------------


def _alibi_raw_init(kv_heads: int, prior_init: str):
    def init(_rng, shape, dtype=jnp.float32):
        if prior_init == "uniform":
            return jnp.full(shape, -30.0, dtype)  # softplus(-30) ~ 1e-13: no recency at start
        return jnp.asarray(prior_lib.inverse_softplus(prior_lib.alibi_slopes(kv_heads)), dtype)
    return init


def prior_declarations(spec: prior_lib.PriorSpec) -> list:
    """``[(name, init, args)]`` of the prior's parameters, in creation order (the RNG draws
    follow it): what :class:`GoatPrior` makes with ``self.param(name, init, *args)``, and the NNX
    shell under ``prior/`` (one declaration of names, shapes, initializers and logical axes)."""
    k, r, m = spec.kv_num_heads, spec.pos_rank, spec.abs_rank
    f32 = jnp.float32
    seeded = spec.prior_init == "seeded"
    sym_init = nn.initializers.normal(1e-2) if seeded else nn.initializers.zeros
    decls = [("lambda_sym", sym_init, ((k, r), f32)),
             ("lambda_asym", nn.initializers.zeros, ((k, r), f32)),
             ("prior_gate_scale_raw", nn.initializers.constant(-10.0), ((spec.num_heads,), f32)),
             ("prior_gate_bias", nn.initializers.constant(10.0), ((spec.num_heads,), f32))]
    if spec.enable_key_bias:
        in_dim = 2 * m + 2
        hidden = min(2 * in_dim, 4)  # official: min(in * 2, max(out * 2, 4)) with out = 1
        scale = spec.init_scale_prior

        def mlp_init(rng):
            r1, r2 = jax.random.split(rng)
            fc2 = scale * jax.random.normal(r2, (hidden, 1), f32) if seeded else jnp.zeros((hidden, 1), f32)
            return {"fc1": {"kernel": scale * jax.random.normal(r1, (in_dim, hidden), f32),
                            "bias": jnp.zeros((hidden,), f32)},
                    "fc2": {"kernel": fc2, "bias": jnp.zeros((1,), f32)}}

        decls += [("key_bias", mlp_init, ()),
                  ("sink_gain", nn.initializers.ones, ((k,), f32)),
                  ("sink_bump", nn.initializers.zeros, ((k,), f32)),
                  ("recency_slope_raw", _alibi_raw_init(k, spec.prior_init), ((k,), f32))]
    if spec.learn_frequencies and r:
        # Made last, so the other parameters draw the same random numbers as with the fixed
        # ladder; starts at the ladder, i.e. as the fixed prior. float32 like the rest, since
        # w * p needs the mantissa.
        ladder = lambda _rng, shape, dtype=f32: jnp.broadcast_to(
            prior_lib.frequencies(r, spec.pos_base), shape).astype(dtype)
        decls.append(("pos_freqs", partitioning.with_logical_partitioning(ladder, ("kv_heads", None)), ((k, r), f32)))
    return decls


def prior_query(spec: prior_lib.PriorSpec, params: dict, q_pos: prior_lib.Positions,
                q_content: Optional[Array] = None, origin: Optional[Array] = None):
    """``(q_rel [.., T, N, 2R], q_sink [.., T, N], gate or None)``, float32, from the prior's
    ``params`` (:func:`prior_declarations`' names); ``origin``: :func:`goat_jax.prior.features.relative_to`."""
    gate = prior_lib.query_gate(spec, params, q_content)
    q_rel, q_sink = prior_lib.query_features(spec, params, q_pos, gate, origin=origin)
    return q_rel, q_sink, gate


def prior_log_prior(spec: prior_lib.PriorSpec, params: dict, q_pos: prior_lib.Positions,
                    k_pos: prior_lib.Positions, is_causal: bool, q_content: Optional[Array] = None) -> Array:
    """Dense ``[B or 1, N, T, S]`` log-prior (plots and the 'dense' implementation)."""
    gate = prior_lib.query_gate(spec, params, q_content)
    return prior_lib.log_prior(spec, params, q_pos, k_pos, is_causal=is_causal, gate=gate)


class GoatPrior(nn.Module):
    """Parameters of the GOAT log-prior (official names and shapes; float32 always, since they
    are tiny and their products with positions need the precision), for one
    :class:`goat_jax.prior.PriorSpec` (its only field); declared by :func:`prior_declarations`.

    Methods return the q/k channels (``query``, ``key``) or the dense ``log_prior``; the math
    lives in :mod:`goat_jax.prior`.
    """

    spec: prior_lib.PriorSpec

    def setup(self):
        for name, init, args in prior_declarations(self.spec):
            setattr(self, name, self.param(name, init, *args))

    def _params(self) -> dict:
        return {name: getattr(self, name) for name, _, _ in prior_declarations(self.spec)}

    def params(self) -> dict:
        """``{name: value}`` of the prior's parameters (what the pure functions take)."""
        return self._params()

    def query(self, q_pos: prior_lib.Positions, q_content: Optional[Array] = None):
        """Returns ``(q_rel [.., T, N, 2R], q_sink [.., T, N], gate or None)``, float32."""
        return prior_query(self.spec, self._params(), q_pos, q_content)

    def key(self, k_pos: prior_lib.Positions, is_causal: bool):
        """Returns ``(k_rel [.., S, 2R] or [.., S, K, 2R] if learned per head, u [.., S, K])``, float32."""
        return prior_lib.key_features(self.spec, self._params(), k_pos, is_causal)

    def log_prior(self, q_pos: prior_lib.Positions, k_pos: prior_lib.Positions, is_causal: bool,
                  q_content: Optional[Array] = None) -> Array:
        """Dense ``[B or 1, N, T, S]`` log-prior (for plots and the 'dense' implementation)."""
        return prior_log_prior(self.spec, self._params(), q_pos, k_pos, is_causal, q_content)

    def __call__(self, q_pos, k_pos, is_causal: bool = False):
        """Same as :meth:`log_prior` without a gate (lets ``init`` create the parameters)."""
        return self.log_prior(q_pos, k_pos, is_causal)


# ----------------------------------------------------------------------------------------------
# GoatAttention
# ----------------------------------------------------------------------------------------------


def _infer_square_grid(s: int, t: int, has_cls: bool) -> Optional[Tuple[int, int]]:
    """Official ``pos_encoding='auto'`` rule: a square grid from the key length, if the query
    length fits the same grid; else None (1D)."""
    n = s - int(has_cls)
    side = int(round(math.sqrt(max(n, 0))))
    if n > 0 and side * side == n and t == s:
        return (side, side)
    return None


class _GoatDetail(NamedTuple):
    """What GOAT decides about one call before any work (:attr:`Prepared.detail`)."""

    spec: prior_lib.PriorSpec
    d_c: int  # content dims
    sink_channels: int
    use_2d: bool
    has_cls: bool
    spatial_shape: Optional[Tuple[int, int]]


def _check_settings(settings: Any) -> prior_lib.PriorSettings:
    if not isinstance(settings, prior_lib.PriorSettings):
        raise ValueError(
            f"GoatAttention.prior must be a goat_jax.prior.PriorSettings, got "
            f"{type(settings).__name__}; e.g. prior=PriorSettings(pos_rank=8, abs_rank=8).")
    return settings


def _declarations(spec: prior_lib.PriorSpec) -> Tuple[encoding_lib.ParamDecl, ...]:
    """The prior's parameters (:func:`prior_declarations`) as the layer's, under ``prior/``."""
    return tuple(encoding_lib.ParamDecl(("prior", name), init, tuple(args))
                 for name, init, args in prior_declarations(spec))


@dataclasses.dataclass(frozen=True)
class GoatEncoding(encoding_lib.Encoding):
    """GOAT's learned prior as a position encoding (:mod:`goat_jax.layers.encoding`): the prior's
    parameters under ``prior/`` (:func:`prior_declarations`), its 1D or 2D positions, and q/k
    packed so that ``q~ . k~`` is the content logit plus the log-prior
    (:mod:`goat_jax.prior.packing`); with the 'dense' kernel, the content logits plus the
    materialized log-prior as a bias (the reference).

    Attributes: ``prior`` (:class:`goat_jax.prior.PriorSettings`), ``pos_encoding`` ('1d', '2d'
    or 'auto'), ``has_cls_token_default``, ``sink_channels`` (None: the layout's own count,
    :func:`goat_jax.prior.packing.packed_sink_channels`). Their meaning: :class:`GoatAttention`.
    """

    prior: Any = prior_lib.PriorSettings()
    pos_encoding: str = "1d"
    has_cls_token_default: bool = False
    sink_channels: Optional[int] = None

    @property
    def training_len(self) -> Optional[int]:  # type: ignore[override]
        return self.prior.training_seq_len if isinstance(self.prior, prior_lib.PriorSettings) else None

    def declarations(self, sizes: encoding_lib.Sizes) -> Tuple[encoding_lib.ParamDecl, ...]:
        return _declarations(_check_settings(self.prior).for_heads(sizes.num_heads, sizes.kv_heads))

    def prepare(self, call: attention_call.AttentionCall, shape: attention_call.LayerShape,
                request: attention_call.KernelRequest, sizes: encoding_lib.Sizes) -> encoding_lib.Prepared:
        settings = _check_settings(self.prior)
        spec = settings.for_heads(shape.num_heads, shape.kv_heads)
        sink_channels = packed_sink_channels(settings.qk_layout, settings.enable_key_bias, self.sink_channels,
                                             shape.dtype)
        d_c = spec.content_dim(shape.head_dim, sink_channels)  # qk_layout decides
        qk_dim = d_c + 2 * settings.pos_rank + sink_channels
        choice = request.choose(qk_dim)
        kernel_widths.check_layout(choice.implementation, shape.dtype, shape.head_dim, qk_dim)  # once, if off the fast path

        t, s = call.query.shape[1], call.key.shape[1]
        spatial_shape = call.spatial_shape
        has_cls = self.has_cls_token_default if call.has_cls_token is None else bool(call.has_cls_token)
        if self.pos_encoding not in ("1d", "2d", "auto"):
            raise ValueError(f"pos_encoding must be '1d', '2d' or 'auto', got {self.pos_encoding!r}.")
        if self.pos_encoding == "auto" and spatial_shape is None:
            spatial_shape = _infer_square_grid(s, t, has_cls)  # official 'auto' rule
        use_2d = self.pos_encoding == "2d" or (self.pos_encoding == "auto" and spatial_shape is not None)
        if use_2d and spatial_shape is None:
            raise ValueError("pos_encoding='2d' needs spatial_shape=(rows, cols) of the patch grid.")
        if not use_2d and spatial_shape is not None:
            raise ValueError(
                "spatial_shape was given but pos_encoding='1d'; use pos_encoding='2d' (or 'auto') "
                "for (row, col) positions.")
        if use_2d and call.q_segment_ids is not None:
            raise ValueError("segment_ids are for 1D sequences (packed documents); pos_encoding="
                             f"{self.pos_encoding!r} chose 2D (row, col) positions here. Drop "
                             "segment_ids, or use pos_encoding='1d'.")
        if use_2d and (call.q_positions is not None or call.k_positions is not None):
            # 1D positions have no place on a grid, and (row, col) ones would need a CLS rule
            # of their own; the official package has neither. Offsets move the grid instead.
            raise ValueError(
                f"pos_encoding={self.pos_encoding!r} chose 2D (row, col) positions here, which come from "
                "spatial_shape; q_positions/k_positions are 1D and are not supported. Drop them and move "
                "the grid with position_offset_q/position_offset_k=(row, col), or use pos_encoding='1d'.")
        if (call.q_segment_ids is not None and settings.enable_key_bias
                and settings.training_seq_len is None):
            raise ValueError(
                "segment_ids with the sink (enable_key_bias) need training_seq_len: without it the "
                "sink normalizes positions by the window's key length, not each document's, so a "
                "packed document would not see the prior it sees alone. Set training_seq_len to "
                "the training context length.")
        if use_2d and sizes.decode:
            raise ValueError("KV-cache decoding supports 1D positions only.")
        if sizes.decode and settings.enable_key_bias and settings.training_seq_len is None:
            raise ValueError(
                "KV-cache decoding needs training_seq_len (the sink normalizes positions by "
                "it; without it the normalization follows the key length, which grows while "
                "decoding). Set training_seq_len to the training context length.")
        detail = _GoatDetail(spec, d_c, sink_channels, use_2d, has_cls, spatial_shape)
        return encoding_lib.Prepared(qk_dim, choice, _declarations(spec), (), detail)

    def positions(self, call: attention_call.AttentionCall, prepared: encoding_lib.Prepared, t: int, s: int,
                  decoding: bool):
        detail: _GoatDetail = prepared.detail
        if not detail.use_2d:
            return encoding_lib.positions_1d(call, t, s, decoding)
        out = []
        for name, length, offset in (("position_offset_q", t, call.position_offset_q),
                                     ("position_offset_k", s, call.position_offset_k)):
            prior_lib.check_grid(length, detail.spatial_shape, detail.has_cls)
            if offset is None:
                offset = (0, 0)
            if isinstance(offset, (int, np.integer)):
                if offset != 0:
                    raise ValueError(f"{name} must be a (row, col) pair in 2D mode, got {offset}.")
                offset = (0, 0)
            shape = tuple(offset.shape) if hasattr(offset, "shape") else (
                (len(offset),) if isinstance(offset, (tuple, list)) else None)
            if shape != (2,):  # a traced scalar, say, has no (row, col) to take
                raise ValueError(f"{name} must be a (row, col) pair of integers in 2D mode, got "
                                 f"{'an array of shape ' + str(shape) if hasattr(offset, 'shape') else repr(offset)}.")
            out.append(prior_lib.positions_2d(detail.spatial_shape, detail.has_cls, tuple(offset), name=name))
        return tuple(out)

    def encode(self, call: attention_call.AttentionCall, shape: attention_call.LayerShape,
               prepared: encoding_lib.Prepared, params: Mapping[str, Any], q: Array, k: Array,
               q_pos: prior_lib.Positions, k_pos: prior_lib.Positions, cache: Optional[Mapping[str, Any]]):
        detail: _GoatDetail = prepared.detail
        # Causal masking is by sequence index, shifted by the 1D offsets (official semantics).
        causal_offset = 0
        if not detail.use_2d:
            causal_offset = (0 if call.position_offset_q is None else call.position_offset_q) - (
                0 if call.position_offset_k is None else call.position_offset_k)
        d_c, spec, params = detail.d_c, detail.spec, dict(params)
        q_content, k_content = q[..., :d_c], k[..., :d_c]
        if kernels.returns_probs(prepared.implementation) and cache is None:
            # The materialized reference: content logits plus the dense log-prior as a bias.
            bias = prior_log_prior(spec, params, q_pos, k_pos, call.is_causal, q_content)  # [B|1, N, T, S]
            return attention_call.Encoded(q_content, k_content, 1.0 / math.sqrt(d_c), k_content, causal_offset,
                                          bias), {}
        # The relative features of a window from its first key's position (shift-invariant: the
        # learned frequencies' gradient keeps float32 precision far out). Not while decoding: the
        # cache holds keys of earlier calls, encoded from position 0.
        origin = k_pos.coords[..., :1] if cache is None and not detail.use_2d else None
        q_rel, q_sink, _ = prior_query(spec, params, q_pos, q_content, origin)
        k_rel, u = prior_lib.key_features(spec, params, k_pos, call.is_causal, origin)
        q_packed = pack_query(q_content, q_rel, q_sink, detail.sink_channels, shape.dtype)  # [B, T, N, qk_dim]
        # Learned frequencies give the key features a head axis ([.., S, K, 2R]).
        k_packed = pack_key(k_content, k_rel, u, detail.sink_channels, shape.dtype,
                            rel_per_head=k_rel.ndim > u.ndim)  # [B, S, K, qk_dim]
        return attention_call.Encoded(q_packed, k_packed, 1.0, k_content, causal_offset), {}


class GoatAttention(linen.Attention):
    """Multi-head attention with the GOAT learned prior, run on unmodified kernels: the Linen
    attention layer (:class:`goat_jax.layers.linen.Attention`) holding a :class:`GoatEncoding`
    of the fields below.

    Call signature, projections, KV cache, sowing and ``kernel_init_std``: as every layer
    (:class:`goat_jax.layers.linen.Attention`). ``query`` [B, T, E], ``key``/``value`` [B, S, E']
    (default ``query``); returns [B, T, out_features or E].

    * 1D positions: ``arange + position_offset_*`` (default 0, and the cache index while
      decoding) or explicit integer ``q_positions`` / ``k_positions`` ([T] / [B, T]; they move
      the prior only; causal masking is by sequence index, shifted by the 1D offsets as in the
      official package).
    * 2D: ``pos_encoding='2d'`` (or 'auto' with a ``spatial_shape``) uses (row, col) positions
      of a row-major ``spatial_shape`` grid, CLS first if ``has_cls_token``; offsets are
      (row, col) pairs.
    * ``segment_ids`` (packed documents, 1D only): positions restart per document, so the
      relative prior, the sink (its first-token bump included) and the recency slope see
      document positions; with the sink this needs ``training_seq_len``, for the same reason
      as decoding.
    * ``decode=True`` needs ``training_seq_len`` when the sink is enabled, because otherwise the
      sink normalizes positions by the key length, which changes while decoding. The cache holds
      the packed keys.
    * ``prior``: the prior's hyper-parameters, one :class:`goat_jax.prior.PriorSettings`
      (``pos_rank``, ``abs_rank``, bases, key bias, ``training_seq_len``, gate, init).
    * ``kernel_init_std``: as the official GPT-2-style C4 script re-initializes every Linear
      (0.02; docs/protocols.md, C4 125M); the prior's own parameters follow ``prior``.
    * ``implementation='dense'`` attends over the content dims with the materialized log-prior
      as a bias (the reference); every other kernel gets the packed q/k.

    Attention dropout is not offered: flash kernels have none.
    """

    prior: prior_lib.PriorSettings = prior_lib.PriorSettings()
    pos_encoding: str = "1d"
    has_cls_token_default: bool = False
    sink_channels: Optional[int] = None

    @classmethod
    def encoding_of(cls, fields: Mapping[str, Any]) -> GoatEncoding:
        """The :class:`GoatEncoding` of these fields."""
        return GoatEncoding(fields["prior"], fields["pos_encoding"], fields["has_cls_token_default"],
                            fields["sink_channels"])
