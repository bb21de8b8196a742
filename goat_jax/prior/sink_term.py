"""The key-only sink term ``u_h(j)`` of the GOAT prior: the sink MLP on absolute position
features, its optional linear extrapolation past the training window
(``sink_extrapolation='linear'``; why: docs/extrapolation.md), the first-token bump and the
causal recency slope, whose ALiBi initialization lives here too.

Shape legend: S keys, K key/value heads, M absolute rank.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from goat_jax.prior.fourier import fourier_features, frequencies
from goat_jax.prior.positions import Positions, real_dtype
from goat_jax.prior.settings import PriorSpec

Array = jax.Array
Params = Mapping[str, Any]

# ALiBi (Press et al. 2022) slopes: the official package seeds the causal recency slopes with them.


def alibi_slopes(num_heads: int) -> np.ndarray:
    """ALiBi slopes ``m_i`` for ``num_heads`` heads, shape [num_heads], float64.

    Power of two ``n``: ``m_i = 2 ** (-8 i / n)``, i = 1..n. Otherwise the slopes of the largest
    power of two ``c < n`` followed by every other slope of ``2c`` (the ALiBi paper's recipe).
    """
    if num_heads < 1:
        raise ValueError(f"alibi_slopes: num_heads must be >= 1, got {num_heads}.")

    def power_of_two(n: int) -> list:
        return [2.0 ** (-8.0 * i / n) for i in range(1, n + 1)]

    if num_heads & (num_heads - 1) == 0:
        return np.asarray(power_of_two(num_heads))
    c = 2 ** int(math.floor(math.log2(num_heads)))
    return np.asarray(power_of_two(c) + power_of_two(2 * c)[0::2][: num_heads - c])


def inverse_softplus(y: np.ndarray) -> np.ndarray:
    """``x`` with ``softplus(x) = y`` for ``y > 0`` (used to seed raw slope parameters)."""
    y = np.asarray(y, np.float64)
    if np.any(y <= 0):
        raise ValueError("inverse_softplus: all values must be > 0.")
    return np.log(np.expm1(y))


def sink_mlp_inputs(spec: PriorSpec, k_pos: Positions) -> Array:
    """Inputs of the sink MLP: ``[cos(w_abs p), sin(w_abs p), t / L_n, log1p(t) / log1p(L_n)]``.

    ``t`` is the key's sequence index and ``L_n = training_seq_len`` (or key length - 1).
    Returns [..., S, 2M + 2] float32.
    """
    s = k_pos.index.shape[-1]
    denom = float(spec.training_seq_len if spec.training_seq_len is not None else max(s - 1, 1))
    t = k_pos.index.astype(real_dtype())[..., None]
    extra = jnp.concatenate([t / denom, jnp.log1p(t) / math.log1p(denom)], axis=-1)
    abs_feats = fourier_features(k_pos, frequencies(spec.abs_rank, spec.abs_base))
    abs_feats = jnp.broadcast_to(abs_feats, extra.shape[:-1] + abs_feats.shape[-1:])
    return jnp.concatenate([abs_feats, extra], axis=-1)


def sink_mlp(mlp_params: Params, x: Array) -> Array:
    """The sink MLP ``fc2(silu(fc1(x)))`` in float32; [..., in] -> [...]."""
    def dense(layer, h):
        return h @ mlp_params[layer]["kernel"].astype(real_dtype()) + mlp_params[layer]["bias"].astype(real_dtype())
    return dense("fc2", jax.nn.silu(dense("fc1", x)))[..., 0]


def sink_mlp_values(spec: PriorSpec, mlp_params: Params, k_pos: Positions) -> Array:
    """The sink MLP's output ``m(t)`` at each key, [..., S] float32.

    'official': ``m(t) = mlp(phi(t))`` at every key.

    'linear' (1D positions): with ``e = L_n - 1`` (the last key index of a training window,
    ``L_n = training_seq_len``) and ``h = L_n // 2``::

        m(t) = mlp(phi(t))                                          t <= e
        m(t) = mlp(phi(e)) + (t - e) * (mlp(phi(e)) - mlp(phi(e - h))) / h   t > e

    Why: trained at one length, the MLP learns a ramp in ``t`` that acts as extra recency (the
    causal softmax only sees differences of ``u`` between keys), from inputs (``t / L_n``,
    ``log1p(t)``, slow Fourier features) whose values beyond ``L_n`` it never saw, so past the
    window the ramp stalls or turns over and the heads lose their locality. The secant carries the
    learned ramp on as the ALiBi-like linear term it acts as; a linear ``u`` is exactly
    translation invariant. The second half of the window sets the slope so that a sink shaped
    at the first tokens does not tilt it. Measurements: docs/extrapolation.md.
    """
    if spec.sink_extrapolation == "official":
        return sink_mlp(mlp_params, sink_mlp_inputs(spec, k_pos))
    if k_pos.is_2d:
        raise ValueError("sink_extrapolation='linear' is defined for 1D positions (a sequence "
                         "longer than training_seq_len); use 'official' for 2D grids.")
    end, half = float(spec.training_seq_len - 1), float(spec.training_seq_len // 2)
    t = k_pos.index.astype(real_dtype())
    inside = jnp.minimum(t, end)  # NaN (invalid traced positions) stays NaN
    m_inside = sink_mlp(mlp_params, sink_mlp_inputs(spec, Positions(index=inside, coords=inside)))
    anchors = jnp.asarray([end, end - half], real_dtype())
    m_end, m_mid = sink_mlp(mlp_params, sink_mlp_inputs(spec, Positions(index=anchors, coords=anchors)))
    extended = m_end + (t - end) * ((m_end - m_mid) / half)
    return jnp.where(t > end, extended, m_inside)  # exactly the official m(t) inside the window


def sink(spec: PriorSpec, params: Params, k_pos: Positions, is_causal: bool) -> Array:
    """The key-only log-prior ``u_h(j)``, [..., S, K] float32 (zeros [..., S, 0] if disabled).

    ``u = gain_h * m(t_j) + bump_h * [t_j == 0] + [causal] softplus(slope_h) * t_j`` with
    ``m`` the sink MLP's output (:func:`sink_mlp_values`). The recency slope is only added
    under causal masking, where ``slope * t_j`` equals the ALiBi penalty ``-slope * (t_i - t_j)``
    up to a per-row constant that softmax ignores.
    """
    if not spec.enable_key_bias:
        return jnp.zeros(k_pos.index.shape + (0,), real_dtype())
    m = sink_mlp_values(spec, params["key_bias"], k_pos)[..., None]  # [..., S, 1]
    t = k_pos.index.astype(real_dtype())[..., None]  # [..., S, 1]
    u = params["sink_gain"].astype(real_dtype()) * m + params["sink_bump"].astype(real_dtype()) * (
        t == 0
    ).astype(real_dtype())
    if is_causal:
        u = u + jax.nn.softplus(params["recency_slope_raw"].astype(real_dtype())) * t
    return u
