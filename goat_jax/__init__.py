"""goat-jax: GOAT attention (learned optimal-transport attention priors) in JAX/Flax.

Modules: :mod:`goat_jax.prior` (the math as pure functions), :mod:`goat_jax.prior.packing` (packing
the prior into extra q/k channels), :mod:`goat_jax.kernels` (the ``implementation=`` switch),
:mod:`goat_jax.layers` (the attention layer: :mod:`goat_jax.layers.goat` holds ``GoatAttention``),
:mod:`goat_jax.positional` (baselines), :mod:`goat_jax.nnx` (the layers as native Flax NNX modules),
:mod:`goat_jax.interop` (official PyTorch package).
"""

from goat_jax.layers.goat import GoatAttention, GoatPrior
from goat_jax.prior import PriorSettings, PriorSpec

__version__ = "0.1.0"
__all__ = ["GoatAttention", "GoatPrior", "PriorSettings", "PriorSpec", "__version__"]
