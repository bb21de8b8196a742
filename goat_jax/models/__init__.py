"""Models: the Llama-style / GPT-2 language model and the ViT, each with its config dataclass.

A task builds its model from its config and the run's attention plan
(``goat_jax.tasks.lm.build_model(config, plan)``: a :class:`TransformerLM` of
``goat_jax.tasks.lm.model_config(config)``, ``config.model`` without the plan's fields);
``config.task`` is the one name that chooses it (an old config's ``model.name`` is accepted with a warning, see
:func:`goat_jax.tasks.model_fields`). Weight decay is grouped by the optimizer's rules
(:mod:`goat_jax.train.optim`) and the tasks' declarations (:data:`goat_jax.tasks.NO_DECAY_NAMES`).
"""

from __future__ import annotations

from typing import Any, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from goat_jax.models.lm import LMConfig, TransformerLM, lm_flops_per_token
from goat_jax.models.vit import ViT, ViTConfig


def count_params(model: nn.Module, input_shape: Sequence[int], dtype: Any = jnp.int32) -> int:
    """Number of parameters of ``model`` for an input of ``input_shape`` (via ``jax.eval_shape``:
    nothing is allocated, so it works for models that do not fit in memory)."""
    shapes = jax.eval_shape(model.init, jax.random.PRNGKey(0), jax.ShapeDtypeStruct(tuple(input_shape), dtype))
    # Leaves of partitioned (boxed) params are ShapeDtypeStructs too: the boxes are pytree nodes.
    return int(sum(np.prod(leaf.shape, dtype=np.int64) for leaf in jax.tree_util.tree_leaves(shapes["params"])))


__all__ = ["LMConfig", "TransformerLM", "ViT", "ViTConfig", "count_params", "lm_flops_per_token"]
