"""The public NNX path: ``from goat_jax import nnx as gnnx``, then ``gnnx.GoatAttention(...,
rngs=nnx.Rngs(0))``. The layers are written in :mod:`goat_jax.layers.nnx` (the NNX shell of the
one attention call, beside the Linen shell); see that module for construction, the KV cache,
sowing and conversion to and from Linen.
"""

from goat_jax.layers.nnx import (
    AttentionShell, GoatAttention, PositionalAttention, from_linen, like_linen, load_linen_params, to_linen)

__all__ = ["AttentionShell", "GoatAttention", "PositionalAttention", "from_linen", "like_linen",
           "load_linen_params", "to_linen"]
