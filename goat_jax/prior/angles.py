"""Rotation angles ``w * p`` whose error does not grow with the position: every Fourier feature of
the GOAT prior (``kappa``'s ``cos/sin(w p)``, the sink MLP's ``cos/sin(w_abs t)``) and every
rotary encoding (RoPE, PI, NTK, YaRN, 2D RoPE, RoPE-Mixed, the sinusoidal embedding) takes its
angles from here.

The problem. In float32, ``w * p`` is rounded to 24 bits, so at position ``p`` the angle is off
by up to ``w p 2**-24``, and the frequency itself, rounded to float32, by ``p ulp(w) / 2``: the
phase error grows linearly with the position (0.4 rad at 16M for RoPE's top frequency, where
cosines mean nothing). Measured: benchmarks/positions.md.

The method: an exact integer phase per frequency (not tables and angle addition). The angle
is only needed modulo 2 pi, i.e. the number of turns ``p * f`` (``f = w / (2 pi)``) modulo 1.
``f`` is held as a 60-bit binary fraction in five 12-bit limbs ``L_1 .. L_5`` (int32), the
integer position as two 12-bit limbs ``p = P_0 + 2**12 P_1`` (``|p| < 2**24``). Every product
``L_i P_j`` is below 2**28, exact in int32, and the product whose weight is a whole turn
(``L_1 P_1``, weight ``2**-12 2**12``) drops out. The rest is summed as a 32-bit fixed-point fraction of a
turn, with wrap-around int32 addition doing the "modulo 1" for free::

    turns * 2**32 = (L_1 P_0 + L_2 P_1) << 20 + (L_2 P_0 + L_3 P_1) << 8
                    + (L_3 P_0 + L_4 P_1) >> 4 + (L_4 P_0 + L_5 P_1) >> 16       (mod 2**32)

The signed result is turned into an angle in [-pi, pi) by one float32 product. The error is
float32 round-off of an angle below pi (at most ~3e-7 rad, measured 2.9e-7) plus 2**-31 turns
from the dropped bits, whatever the position: the same at 16M as at 1,000.

Why this and not float64 tables combined by angle addition (``p = hi 2**k + lo``): tables need
one row per value of ``hi`` and ``lo`` and frequency (megabytes of constants in the program for
RoPE's 64 frequencies at 2**24), a gather per token, and do not exist for learned (traced)
frequencies; the integer phase needs no table, costs eight int32 multiply-adds per angle next to
cos and sin, runs on every backend with x64 off, and is exact for static and learned frequencies
alike. What differs is only how ``f``'s limbs are made:

* static frequencies (NumPy float64: the GOAT and sink ladders, RoPE, NTK, YaRN, PI's
  ``w / scale``): exactly, in Python integers at trace time, from the float64 value and a 256-bit
  ``1 / (2 pi)``. So float64 frequencies are honoured to float64 precision; a frequency given as
  a JAX array is taken as the float32 value it is.
* traced frequencies (GOAT's ``learn_frequencies``, RoPE-Mixed's learned thetas; float32): ``w``
  is cut into two 12-bit halves (bit masks, no rounding) and ``1 / (2 pi)`` into six 12-bit
  float32 pieces, so each of the twelve products is exact in float32; each product's fraction of a
  turn is peeled into 12-bit limbs by exact float32 steps (multiply by 4096, floor, subtract).
  The limbs are those of ``w32 / (2 pi)`` to 2**-60: exact for the float32 parameter. Gradients
  with respect to ``w`` (and ``p``) are ``p dw + w dp`` by a custom JVP, since the integer path
  has none.

Positions. Integer positions (the layers' positions are integers, held in float32, exact below
2**24) are exact. A non-integer position (RoPE-PI with a per-token factor, ``p / s``) is split
into ``floor(p) + r``; ``floor(p)`` goes through the integer phase and ``r w`` (|r| < 1) is added
in float32, so the angle is exact for the float32 position as given; that position carries its
own rounding ``|p| 2**-24`` (for packed documents with 'rope_pi', ``p / s < training_seq_len``:
bounded by the training length, not the position). Static PI factors are folded into the
frequency instead (``w / s`` in float64), which keeps PI exact at any position. NaN positions
(out-of-range traced positions, ``goat_jax.prior.positions``) give NaN angles through ``r w``.

With JAX's x64 enabled (float64 gradient checks) the angle is ``p * w`` in float64 directly.

Shape: ``angles(positions [...], freqs [...F])`` is ``positions.shape + freqs.shape``.
"""

from __future__ import annotations

from typing import Any, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

Array = jax.Array

LIMB_BITS, LIMBS = 12, 5  # f to 60 bits: at |p| < 2**24 the truncation is < 2**-36 turns
MAX_ABS_POSITION = 2 ** 24  # two 12-bit limbs; goat_jax.prior.positions.MAX_POSITION is <= this
_MASK = (1 << LIMB_BITS) - 1
_RADIANS_PER_UNIT = 2.0 * np.pi / 2.0 ** 32  # one unit = 2**-32 turns


def _pi_fixed(bits: int) -> int:
    """floor(pi * 2**bits) to within a few units, by Machin's formula in Python integers."""
    guard = bits + 16

    def arctan_inv(x: int) -> int:  # atan(1/x) * 2**guard
        total, term, n, sign = 0, (1 << guard) // x, 1, 1
        while term:
            total += sign * (term // n)
            term //= x * x
            n, sign = n + 2, -sign
        return total

    return (16 * arctan_inv(5) - 4 * arctan_inv(239)) >> 16


_FIX = 256
_INV_2PI_FIX = (1 << (2 * _FIX)) // (2 * _pi_fixed(_FIX))  # floor(2**256 / (2 pi)) (+- 1 unit)


def _inv_2pi_pieces(count: int) -> np.ndarray:
    """``1 / (2 pi)`` as ``count`` float32 values of 12 significant bits each (consecutive bit
    chunks of its binary expansion), so a 12-bit times a piece is exact in float32."""
    top = _INV_2PI_FIX.bit_length()  # 1/(2 pi) = _INV_2PI_FIX * 2**-256, top bit at 2**(top-257)
    pieces = []
    for k in range(count):
        hi = top - LIMB_BITS * k
        chunk = (_INV_2PI_FIX >> (hi - LIMB_BITS)) & _MASK
        pieces.append(float(chunk) * 2.0 ** (hi - LIMB_BITS - _FIX))
    return np.asarray(pieces, np.float32)


_INV_2PI_PIECES = _inv_2pi_pieces(LIMBS + 1)


def static_limbs(freqs: Any) -> np.ndarray:
    """[...F, LIMBS] int32: the 12-bit limbs of ``frac(w / (2 pi))`` for float64 ``freqs`` [...F],
    exactly (``w`` is a dyadic rational; ``1 / (2 pi)`` to 256 bits), rounded at 2**-60."""
    w = np.asarray(freqs, np.float64)
    if not np.all(np.isfinite(w)):
        raise ValueError(f"frequencies must be finite, got {w}.")
    out = np.zeros(w.shape + (LIMBS,), np.int32)
    frac_bits = LIMB_BITS * LIMBS
    for idx, value in np.ndenumerate(w):
        num, den = float(value).as_integer_ratio()  # den is a power of two
        shift = _FIX + den.bit_length() - 1 - frac_bits
        fixed = ((num * _INV_2PI_FIX >> (shift - 1)) + 1) >> 1  # round(f * 2**60)
        fixed %= 1 << frac_bits  # a whole turn is nothing; negative f wraps to 1 - |f|
        out[idx] = [(fixed >> (frac_bits - LIMB_BITS * (i + 1))) & _MASK for i in range(LIMBS)]
    return out


def traced_limbs(freqs: Array) -> Array:
    """[...F, LIMBS] int32 limbs of ``w / (2 pi)`` for float32 ``freqs`` (traced), exact for the
    float32 value to 2**-60 (module docstring). Limbs may exceed 12 bits (sums of twelve
    products' limbs, < 2**16) and are negative for a negative ``w``; the phase is linear in them."""
    w = jnp.asarray(freqs, jnp.float32)
    a = jnp.abs(w)
    hi = lax.bitcast_convert_type(lax.bitcast_convert_type(a, jnp.int32) & jnp.int32(~_MASK), jnp.float32)
    lo = a - hi  # exact: the 12 low mantissa bits
    limbs = [jnp.zeros(w.shape, jnp.int32) for _ in range(LIMBS)]
    for c in _INV_2PI_PIECES:
        for half in (hi, lo):
            t = half * c  # exact: 12 x 12 significant bits
            t = t - jnp.floor(t)  # whole turns are nothing
            for i in range(LIMBS):
                t = t * float(1 << LIMB_BITS)
                digit = jnp.floor(t)
                limbs[i] = limbs[i] + digit.astype(jnp.int32)
                t = t - digit
    out = jnp.stack(limbs, axis=-1)
    return jnp.where((w < 0)[..., None], -out, out)


def _units(n: Array, limbs: Array) -> Array:
    """uint32 fraction of a turn (units of 2**-32) of ``n * f``: integer positions ``n`` [...]
    (int32, |n| < 2**24) times the limbs [...F, LIMBS] of ``f``; shape ``n.shape + F-shape``."""
    fshape = limbs.shape[:-1]
    n = n.reshape(n.shape + (1,) * len(fshape))
    p0, p1 = n & _MASK, n >> LIMB_BITS  # arithmetic shift: p1 < 0 for negative n
    lim = [limbs[..., i] for i in range(LIMBS)]
    s = [lim[k] * p0 + lim[k + 1] * p1 for k in range(LIMBS - 1)]  # |s| < 2**30: no overflow
    u32 = lambda x: lax.bitcast_convert_type(x, jnp.uint32)
    # The << wrap modulo 2**32 (whole turns); >> is a floor (drops < 2 units in all).
    return ((u32(s[0]) << 20) + (u32(s[1]) << 8) + u32(s[2] >> 4) + u32(s[3] >> 16))


def _split_positions(positions: Any) -> Tuple[Array, Array]:
    """``(floor(p) int32, p - floor(p) float32)``; the remainder is 0 for integer positions and
    NaN for NaN ones."""
    p = jnp.asarray(positions)
    if jnp.issubdtype(p.dtype, jnp.integer):
        return p.astype(jnp.int32), jnp.zeros(p.shape, jnp.float32)
    p = p.astype(jnp.float32)
    whole = jnp.floor(p)
    return whole.astype(jnp.int32), p - whole


def _x64() -> bool:
    return jnp.result_type(float) == jnp.float64


def _is_static(freqs: Any) -> bool:
    return not isinstance(freqs, jax.Array)


def _exact_sum(terms: Sequence[Tuple[Any, Any]]) -> Array:
    """``sum_c positions_c (x) freqs_c`` as angles; every pair broadcasts to one shape."""
    units, rest = None, None
    for positions, freqs in terms:
        whole, frac = _split_positions(positions)
        if _is_static(freqs):
            limbs, w32 = jnp.asarray(static_limbs(freqs)), jnp.asarray(np.asarray(freqs, np.float64), jnp.float32)
        else:
            limbs, w32 = traced_limbs(freqs), jnp.asarray(freqs, jnp.float32)
        u = _units(whole, limbs)
        r = frac.reshape(frac.shape + (1,) * w32.ndim) * w32  # the sub-integer part; carries NaN
        units, rest = (u, r) if units is None else (units + u, rest + r)
    signed = lax.bitcast_convert_type(units, jnp.int32)  # [-2**31, 2**31): [-pi, pi)
    return signed.astype(jnp.float32) * jnp.float32(_RADIANS_PER_UNIT) + rest


@jax.custom_jvp
def _traced_angles(positions: Array, freqs: Array) -> Array:
    return _exact_sum([(positions, freqs)])


@_traced_angles.defjvp
def _traced_angles_jvp(primals, tangents):
    (p, w), (dp, dw) = primals, tangents
    p = jnp.asarray(p, jnp.float32)
    expand = lambda x, k: x.reshape(x.shape + (1,) * k)
    out = _traced_angles(p, w)
    tangent = expand(p, w.ndim) * dw + expand(jnp.asarray(dp, jnp.float32), w.ndim) * w
    return out, tangent


def angles(positions: Any, freqs: Any) -> Array:
    """Rotation angles ``p * w`` reduced to about [-pi, pi), exact to float32 round-off at any
    ``|p| < 2**24`` (module docstring), ``positions.shape + freqs.shape`` float32.

    Args:
      positions: [...] integer or float positions (float: exact for integer values; see the
        module docstring for non-integer ones).
      freqs: [...F] angular frequencies: NumPy / Python float64 (static, honoured in float64), or
        a JAX array (traced or learned; taken as its float32 value, differentiable).
    """
    if _x64():
        p = jnp.asarray(positions, jnp.float64)
        return p.reshape(p.shape + (1,) * np.ndim(freqs)) * jnp.asarray(freqs, jnp.float64)
    if _is_static(freqs):
        return _exact_sum([(positions, freqs)])
    return _traced_angles(jnp.asarray(positions).astype(jnp.float32), jnp.asarray(freqs, jnp.float32))


def summed_angles(terms: Sequence[Tuple[Any, Array]]) -> Array:
    """``sum_c positions_c * freqs_c`` for a few (positions, traced frequencies) pairs whose
    products broadcast to one shape (RoPE-Mixed: ``row * F_row + col * F_col``), reduced once,
    so the sum is as exact as one angle; differentiable in the frequencies."""
    if _x64():
        return sum(jnp.asarray(p, jnp.float64)[..., None] * jnp.asarray(w, jnp.float64) for p, w in terms)
    return _summed(tuple(jnp.asarray(p, jnp.float32) for p, _ in terms),
                   tuple(jnp.asarray(w, jnp.float32) for _, w in terms))


@jax.custom_jvp
def _summed(positions: Tuple[Array, ...], freqs: Tuple[Array, ...]) -> Array:
    return _exact_sum(list(zip(positions, freqs)))


@_summed.defjvp
def _summed_jvp(primals, tangents):
    (ps, ws), (dps, dws) = primals, tangents
    out = _summed(ps, ws)
    tangent = sum(p.reshape(p.shape + (1,) * (out.ndim - p.ndim)) * dw
                  + dp.reshape(dp.shape + (1,) * (out.ndim - dp.ndim)) * w
                  for p, w, dp, dw in zip(ps, ws, dps, dws))
    return out, tangent


def cos_sin(positions: Any, freqs: Any) -> Tuple[Array, Array]:
    """``(cos, sin)`` of :func:`angles`."""
    a = angles(positions, freqs)
    return jnp.cos(a), jnp.sin(a)


__all__ = ["MAX_ABS_POSITION", "angles", "cos_sin", "static_limbs", "summed_angles", "traced_limbs"]
