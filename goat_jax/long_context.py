"""The engine's side of context parallelism (docs/training.md, Long context), where the trainer
imports it from: the checks of a run's ``mesh.context``, ``context_strategy`` and
``context_load_balance`` before any work (:func:`goat_jax.kernels.strategies.check_config`, with
each strategy's own checks on its row), and the load-balanced step wrapper
(:func:`goat_jax.kernels.balance.context_step`).
"""

from typing import Any, Optional

from goat_jax.kernels import strategies
from goat_jax.kernels.balance import context_step
from goat_jax.plan import DEFAULT, AttentionPlan
from goat_jax.positional import ENCODINGS

__all__ = ["check_config", "context_step"]


def check_config(config: Any, num_shards: int, task_name: str, platform: Optional[str] = None,
                 plan: AttentionPlan = DEFAULT) -> None:
    """:func:`goat_jax.kernels.strategies.check_config` with the registered encodings that add a
    materialized bias (the kernels floor imports no position encoding: docs/architecture.md)."""
    bias = frozenset(e.name for e in ENCODINGS if e.materialized_bias)
    strategies.check_config(config, num_shards, task_name, platform, plan, bias_encodings=bias)
