"""Rotary encodings: RoPE (Su et al. 2021, rotate-half layout as GPT-NeoX / Llama), RoPE with
position interpolation (Chen et al. 2023) and axial 2D RoPE for patch grids (Heo et al. 2024).

Each rotates q and k by their positions so that ``q . k`` depends on positions only through
their difference; no bias, so every kernel runs them, and the KV cache stores rotated keys.
The angles are exact integer phases (:mod:`goat_jax.prior.angles`): as accurate at position 16M
as at 1,000. Frequencies are float64 NumPy ladders, honoured in float64.

Shape legend: B batch, L/T/S tokens, N heads, H head dim.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional

import jax
import jax.numpy as jnp
import numpy as np

from goat_jax import prior as prior_lib
from goat_jax.prior import segments
from goat_jax.prior import angles
from goat_jax.config.fields import Float, borrow, declare
from goat_jax.positional.base import EncodingContext, EncodingSettings, PositionEncoding

Array = jax.Array


def rope_frequencies(dim: int, base: float = 10_000.0) -> np.ndarray:
    """RoPE inverse frequencies ``theta_i = base ** (-2 i / dim)``, i = 0..dim/2-1; [dim/2] float64
    NumPy (static, so the exact angles use them in float64, not rounded to float32)."""
    if dim < 2 or dim % 2:
        raise ValueError(f"RoPE needs an even head dim >= 2, got {dim}.")
    return base ** (-np.arange(0, dim, 2, dtype=np.float64) / dim)


def apply_rope(x: Array, positions: Array, base: float = 10_000.0, scale: float = 1.0,
               frequencies: Optional[Array] = None) -> Array:
    """Rotates ``x`` by its positions (rotate-half layout, as GPT-NeoX / Llama).

    Dim ``i < H/2`` is paired with dim ``i + H/2`` and the pair is rotated by the angle
    ``(p / scale) * theta_i`` (:func:`rope_frequencies`). Then ``apply_rope(q, p_i) .
    apply_rope(k, p_j)`` depends on the positions only through ``p_i - p_j``. ``scale > 1`` is
    position interpolation (positions divided by ``scale``).

    Angles come from :func:`goat_jax.prior.angles.angles` (exact for integer positions). A
    Python-number ``scale`` is folded into the frequencies, ``p * (theta_i / scale)`` with
    ``theta_i / scale`` in float64: the same angle, exact at any position (a non-integer
    ``p / scale`` would carry float32 rounding ``|p / scale| 2**-24``). An array ``scale`` (per
    token) divides the positions in float32 (``goat_jax/prior/angles.py`` bounds that case).

    Args:
      x: [B, T, N, H].
      positions: [T] or [B, T] (integer or float) positions.
      scale: a float, or an array broadcasting to ``positions`` (per-token factors, e.g. one per
        packed document).
      frequencies: None for :func:`rope_frequencies` of ``base``, or [H/2] inverse
        frequencies to use instead (the rescaled ladders of 'yarn' / 'ntk', ``rope_scaling.py``;
        NumPy float64 is used as is, a JAX array as its float32 value).
    Returns:
      [B, T, N, H] in ``x``'s dtype; the rotation is computed in float32 (angles reach
      ``p * theta_0 = p`` radians, too coarse in bfloat16).
    """
    h = x.shape[-1]
    freqs = rope_frequencies(h, base) if frequencies is None else frequencies
    if not isinstance(freqs, jax.Array):
        freqs = np.asarray(freqs, np.float64)
    if tuple(freqs.shape) != (h // 2,):
        raise ValueError(f"frequencies must be [head_dim / 2] = [{h // 2}], got {tuple(freqs.shape)}.")
    positions = jnp.asarray(positions)
    if isinstance(scale, (int, float, np.integer, np.floating)):
        freqs = freqs / scale  # exactly p / scale * theta in real numbers; float64 if static
    else:
        positions = positions.astype(jnp.float32) / scale
    angle = angles.angles(positions, freqs)  # [(B,) T, H/2]
    cos = jnp.cos(angle)[..., None, :]  # [(B,) T, 1, H/2]
    sin = jnp.sin(angle)[..., None, :]
    xf = x.astype(jnp.float32)
    x1, x2 = xf[..., : h // 2], xf[..., h // 2:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def apply_rope_2d(x: Array, coords: Array, base: float = 100.0) -> Array:
    """Axial 2D RoPE (Heo et al. 2024, "Rotary Position Embedding for Vision Transformer").

    The first half of each head is rotated by the row, the second half by the column, each half
    with :func:`apply_rope` (rotate-half layout, frequencies ``base ** (-4 i / H)``, i <
    H/4). Then ``q . k`` depends on the positions only through the row and column differences.
    A CLS token at coordinates (0, 0) is not rotated (the angle is 0), as in Heo et al.

    Args:
      x: [B, L, N, H] with H divisible by 4.
      coords: [L, 2] (row, col) positions (``prior.positions_2d(...).coords``).
      base: frequency base; Heo et al. use 100 for 14x14 grids.
    Returns:
      [B, L, N, H] in ``x``'s dtype (the rotation is computed in float32).
    """
    h = x.shape[-1]
    ROPE2D.check_head_dim(h)
    return jnp.concatenate([apply_rope(x[..., : h // 2], coords[..., 0], base),
                            apply_rope(x[..., h // 2:], coords[..., 1], base)], axis=-1)


@dataclasses.dataclass(frozen=True)
class RopeSettings(EncodingSettings):
    """'rope' and 'rope2d' (and, inherited, 'rope_pi', 'ntk', 'yarn'): the frequency base."""

    rope_base: float = declare(10_000.0, Float(min=1.0, min_inclusive=False,
                                               doc="RoPE base; <= 1 gives no rotation spectrum"))


@dataclasses.dataclass(frozen=True)
class RopePISettings(RopeSettings):
    """'rope_pi': the base and the training length positions are interpolated back to (required)."""

    training_seq_len: Optional[int] = borrow(prior_lib.PriorSettings, "training_seq_len")

    def __post_init__(self):
        super().__post_init__()
        if self.training_seq_len is None:
            raise ValueError("position_encoding='rope_pi' needs training_seq_len (the length the "
                             "positions are interpolated back to).")


class Rope(PositionEncoding):
    """'rope': q and k rotated by their 1D positions (``rope_base``)."""

    name = "rope"
    settings_class = RopeSettings

    def encode(self, params: Mapping[str, Any], ctx: EncodingContext, q: Array, k: Array):
        base = ctx.settings.rope_base
        return apply_rope(q, ctx.q_pos, base), apply_rope(k, ctx.k_pos, base), ctx.scale


class RopePI(PositionEncoding):
    """'rope_pi': RoPE with positions times ``training_seq_len / key_length`` once the keys outgrow
    the training length. While decoding the key length is the cache's, i.e. that of the full
    forward the decoding reproduces. With segment ids the key length is each token's own
    document's (``goat_jax.prior.segments.segment_lengths``), so a packed document is scaled as it is
    alone."""

    name = "rope_pi"
    settings_class = RopePISettings

    def encode(self, params: Mapping[str, Any], ctx: EncodingContext, q: Array, k: Array):
        call, base, length = ctx.call, ctx.settings.rope_base, ctx.settings.training_seq_len
        if call.q_segment_ids is not None:
            # Per token: the length of the document it belongs to, [B, T] / [B, S].
            pi_q, pi_k = (jnp.maximum(1.0, segments.segment_lengths(ids).astype(jnp.float32) / length)
                          for ids in (call.q_segment_ids, call.kv_segment_ids))
            return apply_rope(q, ctx.q_pos, base, pi_q), apply_rope(k, ctx.k_pos, base, pi_k), ctx.scale
        pi = max(1.0, ctx.key_len / length)
        return apply_rope(q, ctx.q_pos, base, pi), apply_rope(k, ctx.k_pos, base, pi), ctx.scale


class Rope2D(PositionEncoding):
    """'rope2d': axial 2D RoPE over the (row, col) grid of ``spatial_shape`` (a CLS token, if
    ``has_cls_token``, sits at (0, 0) and is not rotated)."""

    name = "rope2d"
    positions = "2d"
    settings_class = RopeSettings

    def check_head_dim(self, head_dim: int) -> None:
        if head_dim % 4:
            raise ValueError(f"position_encoding='rope2d' needs a head dim divisible by 4 (two axes of "
                             f"rotated pairs), got {head_dim}.")

    def encode(self, params: Mapping[str, Any], ctx: EncodingContext, q: Array, k: Array):
        has_cls = bool(ctx.call.has_cls_token)
        prior_lib.check_grid(q.shape[1], ctx.call.spatial_shape, has_cls)
        coords = prior_lib.positions_2d(ctx.call.spatial_shape, has_cls).coords  # [L, 2]
        base = ctx.settings.rope_base
        return apply_rope_2d(q, coords, base), apply_rope_2d(k, coords, base), ctx.scale


ROPE, ROPE_PI, ROPE2D = Rope(), RopePI(), Rope2D()
