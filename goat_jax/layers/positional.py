"""The baselines in the attention layer: :class:`BaselineEncoding`, any registered position encoding
(:mod:`goat_jax.positional.registry`) as the value the layer holds (:mod:`goat_jax.layers.encoding`),
and :class:`PositionalAttention`, the Linen layer (:class:`goat_jax.layers.linen.Attention`)
holding one, with GoatAttention's call signature, projections and KV cache.

Shape legend: B batch, T queries, S keys, E model dim, N query heads, K kv heads, H head dim.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Optional, Tuple

import jax
import jax.numpy as jnp

from goat_jax import kernels
from goat_jax.layers import call as attention_call
from goat_jax.layers import linen
from goat_jax.layers.encoding import CacheDecl, Encoding, ParamDecl, Prepared, Sizes
from goat_jax.prior.packing import default_sink_channels
from goat_jax.config.fields import check_section
from goat_jax.positional import registry
from goat_jax.positional.registry import ATTENTION_SCALE, get_encoding, settings_fields
from goat_jax.positional.base import EncodingContext, EncodingSettings, PositionEncoding

Array = jax.Array

# The layer's own fields that are also an encoding's setting (log-n scaling reads it too).
_LAYER_SETTINGS = ("training_seq_len",)
# Keywords of PositionalAttention built by hand (docs/layer.md): every registered setting's name
# and older alias, None = not given (the setting's declared default).
KEYWORDS = tuple(n for n in dict.fromkeys(
    [*settings_fields(registry.ENCODINGS), *(a for e in registry.ENCODINGS for a in e.settings_class.ALIASES)])
    if n not in _LAYER_SETTINGS)

# The keywords as module fields, made from the registry (never listed by hand).
_SettingKeywords = type("_SettingKeywords", (linen.Attention,), {
    "__module__": __name__, "__annotations__": {n: "Optional[Any]" for n in KEYWORDS}, **dict.fromkeys(KEYWORDS),
    "__doc__": "The encodings' settings as keywords of PositionalAttention (None: not given)."})


def encoding_settings(position_encoding: str, settings: Optional[EncodingSettings],
                      keywords: Mapping[str, Any]) -> EncodingSettings:
    """The checked settings of the encoding ``position_encoding``: ``settings``, or the ones of
    the layer's ``keywords`` (``{name: value}``, None = not given; when both are given they must
    agree)."""
    enc = get_encoding(position_encoding)
    cls = enc.settings_class
    given = cls.keyword_values({n: keywords.get(n) for n in KEYWORDS + _LAYER_SETTINGS})
    if settings is None:
        return cls(**given)
    if not isinstance(settings, cls):
        raise TypeError(f"position_encoding={enc.name!r} takes settings={cls.__name__}(...), got "
                        f"{type(settings).__name__}.")
    clash = {n: v for n, v in given.items() if getattr(settings, n) != v}
    if clash:
        raise ValueError(f"PositionalAttention: the keyword(s) {clash} disagree with settings="
                         f"{settings!r}; pass each setting once.")
    return settings


@dataclasses.dataclass(frozen=True)
class BaselineEncoding(Encoding):
    """A registered position encoding (:mod:`goat_jax.positional`) as the value the attention
    layer holds (:mod:`goat_jax.layers.encoding`): its settings and checks, the kernel choice
    (a bias needs a kernel that takes one), its parameters as declarations, and its hooks.

    Attributes: ``position_encoding`` (its registered name), ``settings`` (the checked
    :class:`goat_jax.positional.EncodingSettings`; :func:`encoding_settings`),
    ``attention_scale`` (None: ``1 / sqrt(head_dim)``) and ``training_seq_len`` (log-n
    scaling's length when the settings have none).
    """

    position_encoding: str = "rope"
    settings: Optional[EncodingSettings] = None
    attention_scale: Optional[float] = None
    training_seq_len: Optional[int] = None

    @property
    def training_len(self) -> Optional[int]:  # type: ignore[override]
        if self.training_seq_len is not None:
            return self.training_seq_len
        return getattr(self.settings, "training_seq_len", None)

    def _resolved(self) -> Tuple[PositionEncoding, EncodingSettings]:
        enc = get_encoding(self.position_encoding)
        return enc, encoding_settings(self.position_encoding, self.settings, {})

    def declarations(self, sizes: Sizes) -> Tuple[ParamDecl, ...]:
        return _declarations(*self._resolved(), sizes)

    def prepare(self, call: attention_call.AttentionCall, shape: attention_call.LayerShape,
                request: attention_call.KernelRequest, sizes: Sizes) -> Prepared:
        check_section({"attention_scale": self.attention_scale}, {"attention_scale": ATTENTION_SCALE}, None,
                      owner="PositionalAttention")
        enc, settings = self._resolved()
        enc.check_layer(sizes)
        _check_call(enc, call, sizes.decode)
        enc.check_head_dim(shape.head_dim)
        channels = default_sink_channels(shape.dtype)
        qk_dim = shape.head_dim + enc.extra_qk_dims(shape, channels)
        choice = _choose(enc, qk_dim, request)
        cache = tuple(CacheDecl(name, init, tuple(args))
                      for name, init, args in enc.cache_slots(sizes, call.query.shape[0])) if sizes.decode else ()
        return Prepared(qk_dim, choice, _declarations(enc, settings, sizes), cache, (enc, channels, settings))

    def encode(self, call: attention_call.AttentionCall, shape: attention_call.LayerShape, prepared: Prepared,
               params: Mapping[str, Any], q: Array, k: Array, q_pos, k_pos, cache: Optional[Mapping[str, Any]]):
        enc, channels, settings = prepared.detail
        key_len = k.shape[1] if cache is None else cache["cached_key"].shape[1]
        attended = k_pos.index if cache is None else jnp.arange(key_len, dtype=jnp.float32)  # whole cache
        ctx = EncodingContext(
            call=call, shape=shape, q_pos=q_pos.index, k_pos=k_pos.index, attended_k_pos=attended,
            key_len=key_len, decoding=cache is not None, channels=channels,
            scale=1.0 / math.sqrt(shape.head_dim) if self.attention_scale is None else self.attention_scale,
            settings=settings, attention_scale=self.attention_scale, cache=cache)
        q_enc, k_enc, scale = enc.encode(params, ctx, q, k)
        updates = enc.cache_update(params, ctx) if cache is not None else {}
        # k before the encoding: what a key-norm "sink" statistic reads.
        return attention_call.Encoded(q_enc, k_enc, scale, k, 0, enc.bias(params, ctx)), updates


def _declarations(enc: PositionEncoding, settings: EncodingSettings, sizes: Sizes) -> Tuple[ParamDecl, ...]:
    """The encoding's own parameters (:meth:`PositionEncoding.parameters`) as layer declarations."""
    return tuple(ParamDecl((name,), init, tuple(args)) for name, init, args in enc.parameters(sizes, settings))


def _check_call(enc: PositionEncoding, call: attention_call.AttentionCall, decode: bool) -> None:
    """What the encoding's attributes rule out for this call, as one clear error."""
    name = enc.name
    if call.spatial_shape is not None and enc.positions == "1d":
        grids = ", ".join(repr(e.name) for e in registry.ENCODINGS if e.positions == "2d")
        raise ValueError(
            f"position_encoding={name!r} is 1D; for 2D inputs use {grids}, GoatAttention, or "
            "'nope' with absolute position embeddings on the patches.")
    if enc.positions == "2d":
        if call.spatial_shape is None:
            raise ValueError(f"position_encoding={name!r} needs spatial_shape=(rows, cols) of the patch grid.")
        if decode or call.key is not call.query:
            raise ValueError(f"position_encoding={name!r} supports self-attention over one patch "
                             "grid only (no cross-attention, no decoding).")
        if any(a is not None for a in (call.position_offset_q, call.position_offset_k, call.q_positions,
                                       call.k_positions)):
            raise ValueError(f"position_encoding={name!r} takes positions from spatial_shape; "
                             "position offsets and explicit positions are not supported.")
    if enc.causal_only and not call.is_causal:
        raise ValueError(f"position_encoding={name!r} needs is_causal=True: {enc.causal_only}")


def _choose(enc: PositionEncoding, qk_dim: int, request: attention_call.KernelRequest) -> kernels.Choice:
    """The call's kernel (:meth:`goat_jax.layers.call.KernelRequest.choose`): bias-based
    encodings need a kernel that takes an additive bias, which the capability table says
    ('xla', 'dense'); naming another is refused with the encoding's alternative, whatever else
    it lacks."""
    bias = bool(enc.materialized_bias)
    implementation = request.plan.implementation
    row = kernels.CAPABILITIES.get(implementation)
    if bias and row is not None and not row.takes("bias"):
        alternative = f", or position_encoding={enc.flash_alternative}" if enc.flash_alternative else ""
        raise ValueError(
            f"position_encoding={enc.name!r} adds a materialized [N, T, S] bias, which "
            f"implementation={implementation!r} does not take ({row.why_not['bias']}); use 'xla' or "
            f"'dense'{alternative}.")
    return request.choose(qk_dim, bias)


class PositionalAttention(_SettingKeywords):
    """Multi-head attention with a baseline positional encoding, GoatAttention's interface.

    Call signature, projections, KV cache, sowing and ``kernel_init_std``: as every layer
    (:class:`goat_jax.layers.linen.Attention`), so models swap this layer and
    :class:`goat_jax.layers.goat.GoatAttention` freely. ``query`` [B, T, E], ``key``/``value``
    [B, S, E'] (default ``query``); returns [B, T, out_features or E]. Positions
    (``arange + position_offset_*`` or explicit ``q_positions``/``k_positions``, [T] / [B, T])
    move the encoding only; causal masking is by sequence index. Positions are 1D except for
    the 2D encodings ('rope2d', 'rope_mixed'), which need ``spatial_shape`` (rows, cols) and
    ``has_cls_token`` as GoatAttention's 2D mode; 'nope' accepts (and ignores) them, the choice
    for ViTs with absolute embeddings.

    ``position_encoding``: one of ``POSITION_ENCODINGS`` (the :mod:`goat_jax.positional` table).
    While decoding the cache holds keys as the kernel sees them (rotated for RoPE, packed for
    'alibi_packed'); 'rope_pi' scales by the cache length, i.e. by the length of the full
    forward it reproduces. While sowing (``implementation='dense'``), the sown keys are the
    pre-encoding projections.

    ``attention_scale``: the factor on ``q . k`` before the softmax; None is ``1 / sqrt(head_dim)``,
    1.0 is the official synthetic script's baselines (queries multiplied by ``sqrt(head_dim)``
    before a default-scaled kernel; docs/protocols.md, Passkey). Biases ('alibi', 'naive_prior',
    'fire', 'kerple_log', and 'fox''s packed channels) are added unscaled either way.

    The encoding's settings: ``settings``, one instance of its ``settings_class`` (what the
    models pass: ``rope.RopeSettings(rope_base=...)``, ``rope_scaling.YarnSettings(...)``, ...),
    or, for a layer built by hand, keywords named like the settings, each declared once by its
    encoding (:data:`KEYWORDS`, read from the registry): ``rope_base`` ('rope', 'rope_pi',
    'ntk', 'yarn', 'rope2d'; for 'rope_mixed', its older keyword for ``rope_mixed_base``);
    ``training_seq_len`` ('rope_pi', 'yarn', and 'ntk' unless ``rope_scaling_factor`` is set:
    required; also log-n scaling's); ``rope_scaling_factor``, ``yarn_beta_fast``,
    ``yarn_beta_slow`` ('ntk', 'yarn'); ``max_len`` ('naive_prior', required);
    ``fire_threshold_init`` ('fire'); ``fox_gate_bias_init`` ('fox'). A keyword left None takes
    the setting's declared default; a keyword the encoding has no setting of is ignored; a
    keyword given with ``settings`` must agree with it. The settings' own rules (what is
    required) are checked once, by the settings class, when the layer is called. 'fox' also
    keeps ``fox_log_forget_sum`` [B, N] in the cache collection while decoding.
    """

    position_encoding: str = "rope"
    settings: Optional[EncodingSettings] = None
    training_seq_len: Optional[int] = None
    attention_scale: Optional[float] = None

    def encoding_settings(self) -> EncodingSettings:
        """The checked settings of this layer's encoding (:func:`encoding_settings`)."""
        return encoding_settings(self.position_encoding, self.settings, vars(self))

    @classmethod
    def encoding_of(cls, fields: Mapping[str, Any]) -> BaselineEncoding:
        """The :class:`BaselineEncoding` of these fields (the keywords resolved into settings)."""
        settings = encoding_settings(fields["position_encoding"], fields["settings"], fields)
        return BaselineEncoding(fields["position_encoding"], settings, fields["attention_scale"],
                                fields["training_seq_len"])
