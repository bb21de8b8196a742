"""NoPE (Kazemnejad et al. 2023): no positional information in attention.

Causal masking alone orders the tokens; with bidirectional attention it is the choice for a
model whose positions are absolute embeddings added to the inputs
(:mod:`goat_jax.positional.absolute`), e.g. a ViT with a learned table, so it accepts a
``spatial_shape`` and ignores it. The hooks of the base class already do nothing.
"""

from __future__ import annotations

from goat_jax.positional.base import PositionEncoding


class NoPE(PositionEncoding):
    """'nope': plain scaled dot-product attention."""

    name = "nope"
    positions = "any"


NOPE = NoPE()
