"""A learned dense per-head log-prior ``table[h, p_i, p_j]`` of shape [N, max_len, max_len]: the
L x L prior that GOAT's packing avoids (its memory is the point of the comparison).

The table (parameter ``naive_prior``, logical axes ('heads', None, None), zeros at init) is
added to the logits as a materialized bias, so it runs on the XLA / dense kernels only.
"""

from __future__ import annotations

from typing import Any, Mapping

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from goat_jax import partitioning
from goat_jax import prior as prior_lib
from goat_jax.config.fields import Int, declare
from goat_jax.positional.base import EncodingContext, EncodingSettings, PositionEncoding, as_batched, check_max_len

Array = jax.Array


def naive_prior_bias(table: Array, q_positions: Array, k_positions: Array) -> Array:
    """Gathers the learned dense log-prior ``table[h, p_i, p_j]``.

    Args:
      table: [N, max_len, max_len]; q_positions: [T] or [B, T]; k_positions: [S] or [B, S]
        (integer-valued).
    Returns:
      [1 or B, N, T, S] float32. Out-of-range positions give NaN (reachable only with traced
      positions, whose range cannot be checked at trace time): loud, never a silent clamp.
    """
    qi = as_batched(q_positions).astype(jnp.int32)[:, :, None]  # [B|1, T, 1]
    ki = as_batched(k_positions).astype(jnp.int32)[:, None, :]  # [B|1, 1, S]
    bias = table.astype(jnp.float32).at[:, qi, ki].get(
        mode="fill", fill_value=jnp.nan, wrap_negative_indices=False)  # [N, B|1, T, S]
    return jnp.moveaxis(bias, 0, 1)


@dataclasses.dataclass(frozen=True)
class NaivePriorSettings(EncodingSettings):
    """'naive_prior': the table size ``max_len``, required (no default: the table is
    [N, max_len, max_len], so its size is a choice; the LM's default is 2048, and its 'learned'
    embedding table takes the same field)."""

    max_len: int = declare(None, Int(min=1, doc="position-table size ('naive_prior': [heads, max_len, "
                                                "max_len]; the LM's 'learned' table too)"))


class NaivePrior(PositionEncoding):
    """'naive_prior': needs ``max_len``; positions outside [0, max_len) raise when known at trace
    time and give NaN when traced."""

    name = "naive_prior"
    materialized_bias = True
    settings_class = NaivePriorSettings

    def parameters(self, sizes: Any, settings: NaivePriorSettings):
        return (("naive_prior", partitioning.with_logical_partitioning(nn.initializers.zeros, ("heads", None, None)),
                 ((sizes.num_heads, settings.max_len, settings.max_len), sizes.param_dtype)),)

    def bias(self, params: Mapping[str, Any], ctx: EncodingContext) -> Array:
        call, max_len = ctx.call, ctx.settings.max_len
        if not ctx.decoding:  # while decoding, the cache length was checked at init
            for what, p, explicit, offset, length in (
                    ("queries", ctx.q_pos, call.q_positions, call.position_offset_q, ctx.q_pos.shape[-1]),
                    ("keys", ctx.k_pos, call.k_positions, call.position_offset_k, ctx.k_pos.shape[-1])):
                if explicit is None and isinstance(offset, (type(None), int, np.integer)):
                    span = (int(offset or 0), int(offset or 0) + length - 1)  # static, even under jit
                else:
                    span = prior_lib.concrete_range(p)
                check_max_len(max_len, span, f"naive_prior {what}")
        return naive_prior_bias(jnp.asarray(params["naive_prior"]), ctx.q_pos, ctx.attended_k_pos)  # [B|1, N, T, S] float32


NAIVE_PRIOR = NaivePrior()
