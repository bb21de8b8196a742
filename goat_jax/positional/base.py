"""The protocol every position encoding of :class:`goat_jax.positional.PositionalAttention`
follows (how to add one: the :mod:`goat_jax.positional` package docstring).

An encoding is a :class:`PositionEncoding` instance: a few class attributes that say where it
runs, and up to three hooks that the layer calls once per call. The layer owns everything else
(call signature, projections, positions, KV cache, kernel call, sowing:
:class:`goat_jax.layers.AttentionBase`), so an encoding is only its own math.

Shape legend: B batch, T queries, S keys (the cache while decoding), N query heads, K kv heads,
G = N // K, H head dim, c split channels (``goat_jax.attention.default_sink_channels``).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from goat_jax import layers

Array = jax.Array


class EncodingContext(NamedTuple):
    """What an encoding's hooks may read about the current call.

    Attributes:
      call: the call's arguments (``query`` [B, T, E] is the layer input, e.g. for a
        data-dependent encoding); offsets are the cache index while decoding.
      shape: head counts, head dim and compute dtype (:class:`goat_jax.layers.LayerShape`).
      q_pos: [T] or [B, T] float positions of the queries (1D).
      k_pos: [S] or [B, S] float positions of this call's keys (what :meth:`PositionEncoding.encode`
        encodes, and what the KV cache then stores).
      attended_k_pos: positions of the keys the kernel attends over, for a bias: ``k_pos``, or
        the whole cache from position 0 while decoding.
      key_len: S attended (the cache length while decoding).
      decoding: True when this call appends to a KV cache.
      channels: c, the parts an unbounded packed term is split into (1 in float32, 3 in bf16).
      scale: the layer's factor on ``q . k`` (``attention_scale`` or ``1 / sqrt(H)``).
    """

    call: layers.AttentionCall
    shape: layers.LayerShape
    q_pos: Array
    k_pos: Array
    attended_k_pos: Array
    key_len: int
    decoding: bool
    channels: int
    scale: float


class PositionEncoding:
    """One position encoding inside attention. Subclasses set the class attributes and override
    the hooks they need; an instance is registered in ``goat_jax.positional.layer.ENCODINGS``.

    Attributes:
      name: the ``position_encoding`` value.
      positions: '1d' (sequence positions), '2d' (needs ``spatial_shape``; self-attention over
        one patch grid, no offsets, no decoding) or 'any' (accepts a ``spatial_shape`` and
        ignores it).
      causal_only: '' or the reason the encoding needs ``is_causal=True`` (the error says it).
      materialized_bias: True when :meth:`bias` returns a [.., N, T, S] array, which only the
        'xla' and 'dense' kernels take ('xla' is the automatic choice then); False means the
        encoding runs on every kernel (flash, cuDNN, splash).
      flash_alternative: for a bias encoding, the encoding to name in the error a flash kernel
        raises (e.g. "'alibi_packed' (causal)"), or None.
    """

    name: str = ""
    positions: str = "1d"
    causal_only: str = ""
    materialized_bias: bool = False
    flash_alternative: Optional[str] = None

    def check_layer(self, layer: nn.Module) -> None:
        """Raises ValueError naming the layer field (and the fix) the encoding needs but lacks."""

    def extra_qk_dims(self, shape: layers.LayerShape, channels: int) -> int:
        """Channels the encoding appends to each q/k head (0 unless it packs a term into q/k)."""
        return 0

    def encode(self, layer: nn.Module, ctx: EncodingContext, q: Array, k: Array) -> Tuple[Array, Array, float]:
        """``(q, k, scale)`` for the kernel from the raw projections q [B, T, N, H], k [B, S, K, H]
        (k as the cache will store it). Parameters, if any, are made with ``layer.param``."""
        return q, k, ctx.scale

    def bias(self, layer: nn.Module, ctx: EncodingContext) -> Optional[Array]:
        """None, or the additive [B or 1, N, T, S attended] float32 bias (``materialized_bias``);
        added to the scaled logits, unscaled."""
        return None

    def __repr__(self) -> str:
        return f"<position encoding {self.name!r}>"


def as_batched(positions: Any) -> Array:
    """[L] -> [1, L]; [B, L] unchanged; float32 (integer positions are exact up to 2**24)."""
    p = jnp.asarray(positions, jnp.float32)
    return p[None] if p.ndim == 1 else p


def check_max_len(max_len: int, span: Optional[Tuple[int, int]], what: str) -> None:
    """Raises ValueError naming ``max_len`` unless ``0 <= positions < max_len`` (when known)."""
    if span is not None and (span[0] < 0 or span[1] >= max_len):
        raise ValueError(
            f"{what}: positions span [{span[0]}, {span[1]}], beyond [0, max_len={max_len}). "
            "Increase max_len or use a relative encoding that extrapolates.")
