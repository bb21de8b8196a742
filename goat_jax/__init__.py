"""goat-jax: GOAT attention (learned optimal-transport attention priors) in JAX/Flax.

Modules: :mod:`goat_jax.prior` (the math as pure functions), :mod:`goat_jax.prior.packing` (packing
the prior into extra q/k channels), :mod:`goat_jax.kernels` (the ``implementation=`` switch),
:mod:`goat_jax.layers` (the attention layer: :mod:`goat_jax.layers.goat` holds ``GoatAttention``),
:mod:`goat_jax.positional` (baselines), :mod:`goat_jax.nnx` (the layers as native Flax NNX modules),
:mod:`goat_jax.interop` (official PyTorch package).
"""

import importlib.abc
import sys

from goat_jax.kernels.plan import AttentionPlan
from goat_jax.layers.goat import GoatAttention, GoatPrior
from goat_jax.prior import PriorSettings, PriorSpec

__version__ = "0.1.0"
__all__ = ["AttentionPlan", "GoatAttention", "GoatPrior", "PriorSettings", "PriorSpec", "__version__"]

# Modules that moved to the room that holds them (docs/architecture.md): importing the old name
# fails in one line naming the new one, instead of a bare "No module named ...".
MOVED_MODULES = {
    "goat_jax.plan": "goat_jax.kernels.plan",
    "goat_jax.config_files": "goat_jax.config.files",
    "goat_jax.config_args": "goat_jax.config.args",
    "goat_jax.segments": "goat_jax.prior.segments",
    "goat_jax.kernels.context": "goat_jax.kernels.all_gather",
    "goat_jax.long_context": "goat_jax.kernels.strategies (check_config) and goat_jax.kernels.balance (context_step)",
}


class _MovedModules(importlib.abc.MetaPathFinder):
    """Consulted after every other finder, so only for a name that no longer exists."""

    def find_spec(self, name, path=None, target=None):  # pylint: disable=unused-argument
        if name in MOVED_MODULES:
            raise ModuleNotFoundError(f"{name} moved to {MOVED_MODULES[name]}: import it from there "
                                      "(docs/architecture.md lists where each module lives).")
        return None


if not any(isinstance(finder, _MovedModules) for finder in sys.meta_path):
    sys.meta_path.append(_MovedModules())
