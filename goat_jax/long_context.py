"""The engine's side of context parallelism (docs/training.md, Long context), where the trainer
imports it from: the checks of a run's ``mesh.context``, ``context_strategy`` and
``context_load_balance`` before any work (:func:`goat_jax.kernels.strategies.check_config`, with
each strategy's own checks on its row), and the load-balanced step wrapper
(:func:`goat_jax.kernels.balance.context_step`).
"""

from goat_jax.kernels.balance import context_step
from goat_jax.kernels.strategies import check_config

__all__ = ["check_config", "context_step"]
