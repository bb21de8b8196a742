"""The relative prior: geometric frequencies, Fourier features of positions and
``kappa_h(d) = sum_r A[h, r] cos(w_r d) + B[h, r] sin(w_r d)`` (paper section 3).

Every angle ``w * p`` comes from :mod:`goat_jax.prior.angles` (exact integer phases), so the
features are as accurate at position 16M as at 1,000; the fixed ladders stay float64 NumPy
arrays so that the phases honour them to float64 precision.

Shape legend: L tokens, F frequencies, R relative rank, H heads.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from goat_jax.prior import angles
from goat_jax.prior.positions import Positions, real_dtype

Array = jax.Array


def frequencies(rank: int, base: float) -> np.ndarray:
    """Geometric frequencies ``w_r = base ** (-r / max(rank - 1, 1))``, r = 0..rank-1; [rank]
    float64 NumPy (static: :func:`goat_jax.prior.angles.angles` uses them in float64).

    Note the ``rank - 1`` denominator (official convention): the lowest frequency is ``1/base``.
    """
    r = np.arange(rank, dtype=np.float64)
    return base ** (-r / max(rank - 1, 1))


def fourier_features(pos: Positions, freqs: Array) -> Array:
    """``[cos(w . p), sin(w . p)]`` of each token, [..., L, 2F] float32 for F frequencies.

    1D: ``p`` is the position. 2D: the first ``F - F // 2`` frequencies go to the row, the
    remaining ``F // 2`` to the column, laid out ``[cos_row, cos_col, sin_row, sin_col]``
    (official order), so the dot product of two tokens' features is a separable sum over axes.
    CLS tokens get zeros.

    ``freqs`` is [F] (the fixed ladder, shared by the heads; float64 NumPy) or [K, F] (learned per
    head, ``PriorSettings.learn_frequencies``; traced); the latter gives [..., L, K, 2F].
    """
    f = freqs.shape[-1]
    per_head = np.ndim(freqs) == 2
    if not pos.is_2d:
        phase = angles.angles(pos.coords, freqs)  # [..., L, (K,) F]
    else:
        f_row = f - f // 2
        phase = jnp.concatenate([angles.angles(pos.coords[..., 0], freqs[..., :f_row]),
                                 angles.angles(pos.coords[..., 1], freqs[..., f_row:])], axis=-1)
    feats = jnp.concatenate([jnp.cos(phase), jnp.sin(phase)], axis=-1)
    if pos.is_cls is not None:
        cls = pos.is_cls[..., None, None] if per_head else pos.is_cls[..., None]
        feats = jnp.where(cls, 0.0, feats)
    return feats


def kappa(delta: Array, lam_sym: Array, lam_asym: Array, freqs: Array) -> Array:
    """The relative prior ``kappa(d) = sum_r A_r cos(w_r d) + B_r sin(w_r d)``.

    Args:
      delta: [...] position differences ``p_i - p_j`` (1D).
      lam_sym, lam_asym: [H, R] coefficients A, B.
      freqs: [R] (the fixed ladder) or [H, R] (learned per head).
    Returns:
      [H, ...] float32.
    """
    delta = jnp.asarray(delta, real_dtype())
    if np.ndim(freqs) == 2:
        shape = (freqs.shape[0],) + (1,) * delta.ndim + (freqs.shape[1],)  # [H, 1.., R]
        phase = jnp.moveaxis(angles.angles(delta, freqs), -2, 0)  # [H, ..., R]
        return jnp.sum(jnp.cos(phase) * lam_sym.reshape(shape) + jnp.sin(phase) * lam_asym.reshape(shape), axis=-1)
    phase = angles.angles(delta, freqs)  # [..., R]
    out = jnp.einsum("...r,hr->h...", jnp.cos(phase), lam_sym) + jnp.einsum(
        "...r,hr->h...", jnp.sin(phase), lam_asym
    )
    return out
