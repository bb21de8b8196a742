"""FIRE (Li et al., ICLR 2024, "Functional Interpolation for Relative Positions Improves Long
Context Transformers"): the logit bias

    b_h(i, j) = f_theta( psi(p_i - p_j) / psi(max(L, p_i)) )_h,    psi(x) = log(|c x| + 1),

with ``f_theta`` a small MLP (1 -> 32, ReLU, -> N: one output per head, shared by the layer's
heads), a learned ``c`` and a learned threshold ``L`` ("progressive interpolation": the distance
is normalized by the query position, floored at ``L`` so short contexts are not over-stretched).
A materialized [N, T, S] bias, so XLA / dense kernels only; its [T, S, 32] hidden layer is the
cost the comparison should show.

Parameters (logical axes in brackets): ``fire_c`` [] ((),), ``fire_L_multiplier`` [] (()),
with ``L = |multiplier| * 512``, ``fire_fc1_kernel``/``fire_fc1_bias`` [32] ((None,)),
``fire_fc2_kernel`` [32, N] ((None, 'heads')), ``fire_fc2_bias`` [N] (('heads',)). Initialized
as the paper's reference listing: ``c = 0.1``, ``L = 512`` (multiplier 1; the layer's
``fire_threshold_init`` (:class:`FireSettings`) sets another initial ``L``, e.g. the training length), the MLP as PyTorch's
default Linear (``U(-1/sqrt(fan_in), 1/sqrt(fan_in))`` for weights and biases), and a 1e-6 added
to the normalizer. Under a causal mask the distance is the paper's ``p_i - p_j >= 0``; the
``|c x|`` makes the bias symmetric for bidirectional attention.

Shape legend: B batch, T queries, S keys, N query heads, W MLP width.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp

from goat_jax import partitioning
from goat_jax.config.fields import Float, declare
from goat_jax.positional.base import EncodingContext, EncodingSettings, PositionEncoding, as_batched

Array = jax.Array

C_INIT, L_INIT, WIDTH, EPS = 0.1, 512.0, 32, 1e-6  # the paper's listing


def _torch_linear_init(fan_in: int):
    """PyTorch's default ``nn.Linear`` init, ``U(-1/sqrt(fan_in), 1/sqrt(fan_in))``."""
    bound = 1.0 / math.sqrt(fan_in)
    return lambda rng, shape, dtype=jnp.float32: jax.random.uniform(rng, shape, dtype, -bound, bound)


def fire_bias(params: Mapping[str, Array], q_positions: Array, k_positions: Array) -> Array:
    """FIRE's bias from its parameters (the ``fire_*`` names without the prefix: ``c``,
    ``L_multiplier``, ``fc1_kernel`` [W], ``fc1_bias`` [W], ``fc2_kernel`` [W, N], ``fc2_bias``
    [N]).

    Args:
      q_positions: [T] or [B, T]; k_positions: [S] or [B, S].
    Returns:
      [1 or B, N, T, S] float32.
    """
    p = {name: jnp.asarray(v, jnp.float32) for name, v in params.items()}
    c, threshold = p["c"], jnp.abs(p["L_multiplier"]) * L_INIT
    qp, kp = as_batched(q_positions), as_batched(k_positions)  # [B|1, T], [B|1, S]
    psi = lambda x: jnp.log1p(jnp.abs(c * x))
    z = psi(qp[:, :, None] - kp[:, None, :]) / (psi(jnp.maximum(qp, threshold))[:, :, None] + EPS)  # [B|1, T, S]
    hidden = jax.nn.relu(z[..., None] * p["fc1_kernel"] + p["fc1_bias"])  # [B|1, T, S, W]
    out = hidden @ p["fc2_kernel"] + p["fc2_bias"]  # [B|1, T, S, N]
    return jnp.moveaxis(out, -1, 1)


@dataclasses.dataclass(frozen=True)
class FireSettings(EncodingSettings):
    """'fire': the threshold ``L`` at init."""

    fire_threshold_init: float = declare(L_INIT, Float(min=0.0, min_inclusive=False,
                                                       doc="'fire': the threshold L at init (512 as the reference listing)"))


class Fire(PositionEncoding):
    """'fire': the materialized bias of a learned MLP of the interpolated log distance."""

    name = "fire"
    materialized_bias = True
    settings_class = FireSettings

    def parameters(self, sizes: Any, settings: FireSettings):
        n = sizes.num_heads
        specs = {  # name: (initializer, shape, logical axes)
            "c": (nn.initializers.constant(C_INIT), (), ()),
            "L_multiplier": (nn.initializers.constant(settings.fire_threshold_init / L_INIT), (), ()),
            "fc1_kernel": (_torch_linear_init(1), (WIDTH,), (None,)),
            "fc1_bias": (_torch_linear_init(1), (WIDTH,), (None,)),
            "fc2_kernel": (_torch_linear_init(WIDTH), (WIDTH, n), (None, "heads")),
            "fc2_bias": (_torch_linear_init(WIDTH), (n,), ("heads",)),
        }
        return tuple((f"fire_{name}", partitioning.with_logical_partitioning(init, axes), (shape, sizes.param_dtype))
                     for name, (init, shape, axes) in specs.items())

    def bias(self, params: Mapping[str, Any], ctx: EncodingContext) -> Array:
        own = {name[len("fire_"):]: value for name, value in params.items()}
        return fire_bias(own, ctx.q_pos, ctx.attended_k_pos)  # [B|1, N, T, S] float32


FIRE = Fire()
