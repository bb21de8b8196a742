"""Kerple, log variant (Chi et al., NeurIPS 2022, "KERPLE: Kernelized Relative Positional
Embedding for Length Extrapolation"): the logit bias ``-r1_h log(1 + r2_h |p_i - p_j|)`` per
head with learned ``r1, r2 > 0``, as a materialized [N, T, S] bias (XLA / dense kernels only).

Parameters ``kerple_r1_raw`` and ``kerple_r2_raw`` [N] (logical axes ('heads',)), with
``r = softplus(raw)`` for positivity (the paper's code clamps the raw values at 1e-2 after each
step instead, which has no pure-functional equivalent). Initialized as the paper's code:
``r1 ~ U(0, 2)``, ``r2 ~ U(0, 1)``, floored at its clamp 1e-2, then inverted through softplus.
Under a causal mask ``|p_i - p_j| = p_i - p_j``, the paper's form; the absolute value is the
bidirectional extension (as for 'alibi').

Shape legend: B batch, T queries, S keys, N query heads.
"""

from __future__ import annotations

from typing import Any, Mapping

import jax
import jax.numpy as jnp

from goat_jax import partitioning
from goat_jax.positional.base import EncodingContext, PositionEncoding, as_batched

Array = jax.Array

# The paper's code: r1 = U(0, 2), r2 = U(0, 1), each clamped to >= 1e-2.
R1_INIT_MAX, R2_INIT_MAX, R_FLOOR = 2.0, 1.0, 1e-2


def _raw_uniform_init(high: float):
    """softplus^-1 of ``max(U(0, high), R_FLOOR)``: the paper's initial values through softplus."""
    def init(rng, shape, dtype=jnp.float32):
        r = jnp.maximum(jax.random.uniform(rng, shape, jnp.float32, 0.0, high), R_FLOOR)
        return (r + jnp.log(-jnp.expm1(-r))).astype(dtype)  # log(expm1(r)), stable for small r
    return init


def kerple_log_bias(r1: Array, r2: Array, q_positions: Array, k_positions: Array) -> Array:
    """``-r1_h log(1 + r2_h |p_i - p_j|)``.

    Args:
      r1, r2: [N] positive; q_positions: [T] or [B, T]; k_positions: [S] or [B, S].
    Returns:
      [1 or B, N, T, S] float32.
    """
    dist = jnp.abs(as_batched(q_positions)[:, :, None] - as_batched(k_positions)[:, None, :])  # [B|1, T, S]
    r1, r2 = (jnp.asarray(r, jnp.float32)[:, None, None] for r in (r1, r2))
    return -r1 * jnp.log1p(r2 * dist[:, None])


class KerpleLog(PositionEncoding):
    """'kerple_log': the materialized bias with learned per-head ``r1, r2``."""

    name = "kerple_log"
    materialized_bias = True

    def parameters(self, sizes: Any, settings: Any):
        return tuple((name, partitioning.with_logical_partitioning(_raw_uniform_init(high), ("heads",)),
                      ((sizes.num_heads,), sizes.param_dtype))
                     for name, high in (("kerple_r1_raw", R1_INIT_MAX), ("kerple_r2_raw", R2_INIT_MAX)))

    def bias(self, params: Mapping[str, Any], ctx: EncodingContext) -> Array:
        raw = (params["kerple_r1_raw"], params["kerple_r2_raw"])
        r1, r2 = (jax.nn.softplus(jnp.asarray(r, jnp.float32)) for r in raw)
        return kerple_log_bias(r1, r2, ctx.q_pos, ctx.attended_k_pos)  # [B|1, N, T, S] float32


KERPLE_LOG = KerpleLog()
