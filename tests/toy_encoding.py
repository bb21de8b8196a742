"""A toy position encoding, written only against the position-encoding protocol
(:class:`goat_jax.positional.PositionEncoding`): it registers itself when imported and touches no
other file. tests/test_toy_encoding.py imports it in a fresh process (before goat_jax.models, which
read the registry) and runs it in the Linen LM (``model.position_encoding='toy_recency'``, KV-cache
decoding included) and in the NNX layer, each against a float64 reference.

The encoding: a learned per-head recency slope ``m_h = softplus(r_h)`` added to the causal
logits as ``-m_h (i - j)``, packed into q/k channels (as 'alibi_packed' packs fixed slopes), so it
runs on every kernel and the KV cache stores the packed keys:
``[q * scale, 1] . [k, m_h * p_j] = scale * q . k + m_h p_j``, which equals the logit up to the
row constant ``-m_h p_i`` that the softmax ignores under a causal mask.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp

from goat_jax.positional import PositionEncoding, register
from goat_jax.positional.alibi import pack_alibi_query
from goat_jax.positional.base import as_batched
from goat_jax.prior.packing import split_exact

NAME = "toy_recency"


class LearnedRecency(PositionEncoding):
    """'toy_recency': ``-softplus(r_h) (i - j)`` packed into q/k; parameter ``toy_slope_raw`` [N]."""

    name = NAME
    causal_only = "the packed slope drops the row constant -m_h p_i, exact only under a causal mask."

    def parameters(self, sizes, settings):
        return (("toy_slope_raw", nn.initializers.normal(1.0), ((sizes.num_heads,), jnp.float32)),)

    def extra_qk_dims(self, shape, channels):
        return shape.group * channels

    def encode(self, params, ctx, q, k):
        b, s, kh, _ = k.shape
        g, dtype = ctx.shape.group, ctx.shape.dtype
        slopes = jax.nn.softplus(jnp.asarray(params["toy_slope_raw"], jnp.float32)).reshape(kh, g)  # [K, G]
        u = as_batched(ctx.k_pos)[:, :, None, None] * slopes  # [B|1, S, K, G]
        parts = split_exact(u, ctx.channels, dtype).reshape(u.shape[:3] + (g * ctx.channels,))
        k = jnp.concatenate([k.astype(dtype), jnp.broadcast_to(parts, (b, s, kh, g * ctx.channels))], axis=-1)
        q = pack_alibi_query(q, g, ctx.channels, dtype, ctx.attention_scale)  # [B, T, N, H + G c]
        return q, k, 1.0


register(LearnedRecency())
