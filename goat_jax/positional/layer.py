"""The registry of position encodings and :class:`PositionalAttention`, the layer that runs them
with GoatAttention's call signature, projections and KV cache
(:class:`goat_jax.layers.AttentionBase`).

Shape legend: B batch, T queries, S keys, E model dim, N query heads, K kv heads, H head dim.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp

from goat_jax import kernels
from goat_jax import layers
from goat_jax.attention import default_sink_channels
from goat_jax.positional import alibi, fire, fox, kerple, naive_prior, nope, rope, rope_mixed, rope_scaling
from goat_jax.positional.base import EncodingContext, PositionEncoding

Array = jax.Array

# Every encoding PositionalAttention runs, in documentation order. A new encoding is one module
# and one entry here.
ENCODINGS = (nope.NOPE, rope.ROPE, rope.ROPE_PI, alibi.ALIBI, alibi.ALIBI_PACKED, naive_prior.NAIVE_PRIOR,
             rope_scaling.NTK, rope_scaling.YARN, rope.ROPE2D, rope_mixed.ROPE_MIXED, fire.FIRE, kerple.KERPLE_LOG,
             fox.FOX)
POSITION_ENCODINGS = tuple(e.name for e in ENCODINGS)
_BY_NAME = {e.name: e for e in ENCODINGS}


def get_encoding(name: str) -> PositionEncoding:
    """The registered encoding called ``name``; ValueError listing the choices otherwise."""
    if name not in _BY_NAME:
        raise ValueError(
            f"Unknown position_encoding={name!r}; choose one of {POSITION_ENCODINGS} (absolute "
            "'sinusoidal'/'learned' encodings go on the embeddings, with 'nope' here).")
    return _BY_NAME[name]


class _Plan(NamedTuple):
    """What PositionalAttention decides before any work (see :class:`goat_jax.layers.AttentionBase`)."""

    qk_dim: int  # H plus the channels the encoding packs into q/k
    implementation: str
    encoding: PositionEncoding
    channels: int


class PositionalAttention(layers.AttentionBase):
    """Multi-head attention with a baseline positional encoding, GoatAttention's interface.

    Call signature, projections, KV cache, sowing and ``kernel_init_std``: as every layer
    (:class:`goat_jax.layers.AttentionBase`), so models swap this layer and
    :class:`goat_jax.attention.GoatAttention` freely. ``query`` [B, T, E], ``key``/``value``
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

    Variant-specific fields: ``rope_base`` ('rope', 'rope_pi', 'ntk', 'yarn', 'rope2d'; for
    'rope_mixed' the base of its initial frequency ladder, Heo et al.: 10);
    ``training_seq_len`` ('rope_pi', 'yarn', and 'ntk' unless ``rope_scaling_factor`` is set:
    required); ``rope_scaling_factor`` ('ntk', 'yarn': None = dynamic, ``max(1, key length /
    training_seq_len)``, or a fixed factor >= 1); ``yarn_beta_fast`` / ``yarn_beta_slow``
    ('yarn': the rotation counts bounding its interpolation ramp, 32 and 1 as the paper);
    ``max_len`` ('naive_prior', required: the table is [N, max_len, max_len]).
    ``fire_threshold_init`` ('fire': the threshold L at init, 512 as the reference listing).
    ``fox_gate_bias_init`` ('fox': the forget gates' initial bias). 'fox' also keeps
    ``fox_log_forget_sum`` [B, N] in the cache collection while decoding.
    """

    position_encoding: str = "rope"
    rope_base: float = 10_000.0
    training_seq_len: Optional[int] = None
    max_len: Optional[int] = None
    attention_scale: Optional[float] = None
    rope_scaling_factor: Optional[float] = None
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    fox_gate_bias_init: float = 0.0
    fire_threshold_init: float = 512.0

    def _training_len(self) -> Optional[int]:
        return self.training_seq_len

    def _plan(self, call: layers.AttentionCall, shape: layers.LayerShape) -> _Plan:
        if self.attention_scale is not None and not self.attention_scale > 0:
            raise ValueError(f"attention_scale must be > 0 (or None for 1 / sqrt(head_dim)), got "
                             f"{self.attention_scale}.")
        enc = get_encoding(self.position_encoding)
        enc.check_layer(self)
        self._check_call(enc, call)
        channels = default_sink_channels(shape.dtype)
        qk_dim = shape.head_dim + enc.extra_qk_dims(shape, channels)
        return _Plan(qk_dim, self._implementation(enc, shape.dtype, qk_dim, shape.logits_shape), enc, channels)

    def _check_call(self, enc: PositionEncoding, call: layers.AttentionCall) -> None:
        """What the encoding's attributes rule out for this call, as one clear error."""
        name = enc.name
        if call.spatial_shape is not None and enc.positions == "1d":
            grids = ", ".join(repr(e.name) for e in ENCODINGS if e.positions == "2d")
            raise ValueError(
                f"position_encoding={name!r} is 1D; for 2D inputs use {grids}, GoatAttention, or "
                "'nope' with absolute position embeddings on the patches.")
        if enc.positions == "2d":
            if call.spatial_shape is None:
                raise ValueError(f"position_encoding={name!r} needs spatial_shape=(rows, cols) of the patch grid.")
            if self.decode or call.key is not call.query:
                raise ValueError(f"position_encoding={name!r} supports self-attention over one patch "
                                 "grid only (no cross-attention, no decoding).")
            if any(a is not None for a in (call.position_offset_q, call.position_offset_k, call.q_positions,
                                           call.k_positions)):
                raise ValueError(f"position_encoding={name!r} takes positions from spatial_shape; "
                                 "position offsets and explicit positions are not supported.")
        if enc.causal_only and not call.is_causal:
            raise ValueError(f"position_encoding={name!r} needs is_causal=True: {enc.causal_only}")

    def _implementation(self, enc: PositionEncoding, dtype: Any, qk_dim: int, logits_shape) -> str:
        """Kernel choice; bias-based encodings need a kernel that takes an additive bias."""
        impl = self.implementation
        if not enc.materialized_bias:
            return kernels.resolve_implementation(impl, dtype, qk_dim, logits_shape)
        if impl is None or impl == "auto":
            kernels.log_once(f"goat_jax: position_encoding={enc.name!r} uses "
                             "implementation 'xla' (it needs an additive bias).")
            return "xla"
        if impl in kernels.IMPLEMENTATIONS and impl not in ("xla", "dense"):
            raise ValueError(
                f"position_encoding={enc.name!r} adds a materialized [N, T, S] bias, "
                f"which implementation={impl!r} (a flash kernel) does not take; use 'xla' or "
                "'dense'" + (f", or position_encoding={enc.flash_alternative}." if enc.flash_alternative else "."))
        return kernels.resolve_implementation(impl, dtype, qk_dim)

    def _encode(self, call: layers.AttentionCall, shape: layers.LayerShape, plan: _Plan, q: Array, k: Array,
                q_pos, k_pos, cache: Optional[layers.DecodeCache]) -> layers.Encoded:
        key_len = k.shape[1] if cache is None else cache.length
        attended = k_pos.index if cache is None else jnp.arange(key_len, dtype=jnp.float32)  # whole cache
        ctx = EncodingContext(
            call=call, shape=shape, q_pos=q_pos.index, k_pos=k_pos.index, attended_k_pos=attended,
            key_len=key_len, decoding=cache is not None, channels=plan.channels,
            scale=1.0 / math.sqrt(shape.head_dim) if self.attention_scale is None else self.attention_scale)
        q_enc, k_enc, scale = plan.encoding.encode(self, ctx, q, k)
        # k before the encoding: what a key-norm "sink" statistic reads.
        return layers.Encoded(q_enc, k_enc, scale, k, 0, plan.encoding.bias(self, ctx))
