"""RoPE-Mixed (Heo et al. 2024, "Rotary Position Embedding for Vision Transformer"): 2D RoPE
whose frequencies are learned per head and per layer, and mix the two axes.

Pair ``m`` of head ``h`` is rotated by the angle ``row * F[h, m, 0] + col * F[h, m, 1]``; the
learned ``F`` [K, H/2, 2] is one parameter per layer (``'rope_mixed_freqs'``, logical axes
``('kv_heads', None, None)``). Since the angle is linear in the coordinates, ``q . k`` still
depends on the positions only through the row and column differences. The pairs are laid out as
'rope2d' lays them (:func:`goat_jax.positional.apply_rope_2d`: each half of the head in the
rotate-half layout), so with ``F[h, m] = (f_m, 0)`` for the first H/4 pairs and
``(0, f_m)`` for the rest RoPE-Mixed is exactly axial 2D RoPE.

Initialization (the paper's code, ``init_random_2d_freqs``): magnitudes from the axial ladder
``f_i = base ** (-4 i / H)``, i < H/4, with ``base = 10`` (the paper uses 10 for RoPE-Mixed and
100 for RoPE-Axial); per head a random angle ``a ~ U[0, 2 pi)`` turns the first H/4 pairs to the
direction ``(cos a, sin a)`` in (row, col) and the other H/4 to the orthogonal one
``(-sin a, cos a)``. Heads are per KV head (shared by each group of query heads), because a
query head and the key head it reads must rotate alike for the relative property to hold.

Shape legend: B batch, L tokens, N query heads, K kv heads, H head dim.
"""

from __future__ import annotations

from typing import Any, Mapping

import dataclasses
import math

import jax
import jax.numpy as jnp

from goat_jax import partitioning
from goat_jax import prior as prior_lib
from goat_jax.config.fields import Float, declare
from goat_jax.positional.base import EncodingContext, EncodingSettings, PositionEncoding
from goat_jax.positional.rope import rope_frequencies
from goat_jax.prior import angles

Array = jax.Array

PARAM_NAME = "rope_mixed_freqs"


def _check_head_dim(head_dim: int) -> None:
    if head_dim < 4 or head_dim % 4:
        raise ValueError(f"position_encoding='rope_mixed' needs a head dim divisible by 4 (two "
                         f"halves of rotated pairs), got {head_dim}.")


def axial_frequencies(kv_heads: int, head_dim: int, base: float) -> Array:
    """The [K, H/2, 2] (row, col) frequencies at which RoPE-Mixed equals 'rope2d' with ``base``:
    the first H/4 pairs follow the row, the rest the column."""
    _check_head_dim(head_dim)
    mag = rope_frequencies(head_dim // 2, base)  # [H/4]: base ** (-4 i / H)
    zero = jnp.zeros_like(mag)
    f = jnp.concatenate([jnp.stack([mag, zero], -1), jnp.stack([zero, mag], -1)], axis=0)  # [H/2, 2]
    return jnp.broadcast_to(f, (kv_heads,) + f.shape)


def init_mixed_frequencies(base: float):
    """Initializer of the [K, H/2, 2] frequencies (Heo et al.'s ``init_random_2d_freqs``, see the
    module docstring), as a Flax initializer ``(rng, shape, dtype) -> array``."""

    def init(rng, shape, dtype=jnp.float32):
        kv_heads, half, _ = shape
        _check_head_dim(2 * half)
        mag = rope_frequencies(half, base)[None, :, None]  # [1, H/4, 1]
        a = jax.random.uniform(rng, (kv_heads, 1), jnp.float32, 0.0, 2.0 * math.pi)  # [K, 1]
        first = mag * jnp.stack([jnp.cos(a), jnp.sin(a)], -1)  # [K, H/4, 2]
        second = mag * jnp.stack([jnp.cos(a + math.pi / 2), jnp.sin(a + math.pi / 2)], -1)
        return jnp.concatenate([first, second], axis=1).astype(dtype)

    return init


def apply_rope_mixed(x: Array, coords: Array, freqs: Array) -> Array:
    """Rotates ``x`` by the mixed angles ``coords @ freqs`` (layout of :func:`apply_rope_2d`).

    Args:
      x: [B, L, N, H], N a multiple of K (each KV head's frequencies serve its group).
      coords: [L, 2] (row, col) positions; a CLS token at (0, 0) is not rotated.
      freqs: [K, H/2, 2] (row, col) frequencies per pair.
    Returns:
      [B, L, N, H] in ``x``'s dtype; angles and the rotation are computed in float32, the angle
      ``row F_row + col F_col`` as one exact integer phase (:func:`goat_jax.prior.angles.summed_angles`;
      differentiable in ``freqs``).
    """
    b, l, n, h = x.shape
    _check_head_dim(h)
    k = freqs.shape[0]
    if freqs.shape != (k, h // 2, 2) or n % k:
        raise ValueError(f"rope_mixed frequencies have shape {freqs.shape}; a [B, L, {n}, {h}] input "
                         f"needs [K, {h // 2}, 2] with K dividing {n}.")
    f = jnp.repeat(freqs.astype(jnp.float32), n // k, axis=0)  # [N, H/2, 2]
    coords = jnp.asarray(coords, jnp.float32)
    angle = angles.summed_angles([(coords[:, 0], f[..., 0]), (coords[:, 1], f[..., 1])])  # [L, N, H/2]
    angle = angle.reshape(l, n, 2, h // 4)  # (half, pair within the half)
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    xf = x.astype(jnp.float32).reshape(b, l, n, 2, 2, h // 4)  # (half, part, pair)
    x1, x2 = xf[..., 0, :], xf[..., 1, :]
    out = jnp.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-2)
    return out.reshape(b, l, n, h).astype(x.dtype)


@dataclasses.dataclass(frozen=True)
class RopeMixedSettings(EncodingSettings):
    """'rope_mixed': the base of the initial magnitude ladder. Heo et al. use 10 (the ViT's
    default, ``model.rope_mixed_base``); a layer built by hand defaults to RoPE's 10 000, as it
    always has, and takes it as ``rope_base=`` too (its older keyword)."""

    rope_mixed_base: float = declare(10_000.0, Float(min=1.0, min_inclusive=False,
                                                     doc="'rope_mixed' initial ladder base (Heo et al. 2024: 10)"))

    ALIASES = {"rope_base": "rope_mixed_base"}


class RopeMixed(PositionEncoding):
    """'rope_mixed': learned mixed 2D frequencies over the (row, col) grid of ``spatial_shape``
    (a CLS token, if ``has_cls_token``, sits at (0, 0) and is not rotated, as in 'rope2d');
    ``rope_mixed_base`` is the base of the initial magnitude ladder (Heo et al.: 10)."""

    name = "rope_mixed"
    positions = "2d"
    settings_class = RopeMixedSettings

    def check_head_dim(self, head_dim: int) -> None:
        _check_head_dim(head_dim)

    def parameters(self, sizes: Any, settings: RopeMixedSettings):
        init = init_mixed_frequencies(settings.rope_mixed_base)
        return ((PARAM_NAME, partitioning.with_logical_partitioning(init, ("kv_heads", None, None)),
                 ((sizes.kv_heads, sizes.head_dim // 2, 2), jnp.float32)),)  # float32: angles need it

    def encode(self, params: Mapping[str, Any], ctx: EncodingContext, q: Array, k: Array):
        has_cls = bool(ctx.call.has_cls_token)
        prior_lib.check_grid(q.shape[1], ctx.call.spatial_shape, has_cls)
        freqs = jnp.asarray(params[PARAM_NAME])
        coords = prior_lib.positions_2d(ctx.call.spatial_shape, has_cls).coords  # [L, 2]
        return apply_rope_mixed(q, coords, freqs), apply_rope_mixed(k, coords, freqs), ctx.scale


ROPE_MIXED = RopeMixed()
