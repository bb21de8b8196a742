"""Models, built from a config by name: the trainer calls :func:`build_model` and nothing else.

``build_model(config.model)`` looks up ``config.model.name`` (e.g. 'lm') in a small registry and
hands the remaining fields to that model's config class, which rejects unknown fields.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Mapping, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from goat_jax.models.lm import LMConfig, TransformerLM, lm_flops_per_token
from goat_jax.models.vit import ViT, ViTConfig

_REGISTRY: Dict[str, Callable[[Mapping[str, Any]], nn.Module]] = {}

# Parameter / module names never weight-decayed (a task's ``no_decay_names``; arrays with fewer
# than two dims are never decayed anyway). Biases and norm scales are the usual AdamW exclusions
# (decay would pull norm gains to 0, and biases carry no capacity to regularize). The GOAT prior
# parameters are a handful of numbers per head whose scale *is* the prior (Fourier coefficients,
# sink gain and bump, ALiBi-like recency slope): decaying them biases the learned prior towards
# uniform attention rather than regularizing the model. 'prior' is the GoatPrior module name, so
# its sink-MLP kernels are excluded too.
NO_DECAY_NAMES = frozenset({
    "bias", "scale", "prior", "lambda_sym", "lambda_asym", "key_bias", "sink_gain", "sink_bump",
    "recency_slope_raw", "prior_gate_scale_raw", "prior_gate_bias",
})

# The official C4 recipe's grouping (docs/protocols.md, C4 125M): weight decay on every parameter
# whose name contains none of these substrings, 1-D or not, so the sink gain, bump and recency
# slope and the gate parameters *are* decayed. Applied to our dotted parameter paths, the names
# correspond: PyTorch ``*.bias`` = our Dense/LayerNorm ``*.bias``; ``ln_*`` = our ``*_norm``
# modules; ``lambda_sym/asym`` and the sink MLP ``key_bias.*`` keep their names under ``prior``.
OFFICIAL_C4_NO_DECAY_SUBSTRINGS = (".bias", "ln", "norm", "lambda_", "key_bias")


def official_c4_decay_mask(params: Any) -> Any:
    """True for the parameters the official C4 script decays: those whose dotted path
    (``layer_0.attention.q_proj.kernel``) contains none of ``OFFICIAL_C4_NO_DECAY_SUBSTRINGS``.

    A task's ``decay_groupings`` entry (``optimizer.decay_grouping='official_c4'``); ``params``
    may be boxed (``nn.Partitioned``) or plain."""
    def one(path, _):
        names = (getattr(k, "key", getattr(k, "name", None)) for k in path)
        dotted = ".".join(str(n) for n in names if n not in (None, "value"))
        return not any(s in dotted for s in OFFICIAL_C4_NO_DECAY_SUBSTRINGS)
    return jax.tree_util.tree_map_with_path(one, params)


def register_model(name: str):
    """Decorator registering ``builder(fields) -> nn.Module`` under ``name``."""
    def wrap(builder):
        if name in _REGISTRY:
            raise ValueError(f"Model {name!r} is already registered.")
        _REGISTRY[name] = builder
        return builder
    return wrap


@register_model("lm")
def _build_lm(fields: Mapping[str, Any]) -> nn.Module:
    return TransformerLM(LMConfig.from_config(fields))


@register_model("vit")
def _build_vit(fields: Mapping[str, Any]) -> nn.Module:
    return ViT(ViTConfig.from_config(fields))


def build_model(model_config: Mapping[str, Any]) -> nn.Module:
    """Builds the model named by ``model_config.name`` from the other fields.

    Args:
      model_config: an ``ml_collections.ConfigDict`` (or mapping) with ``name`` plus the fields
        of that model's config (for 'lm': :class:`LMConfig`; for 'vit': :class:`ViTConfig`).
    Raises:
      ValueError: missing or unknown ``name``, or unknown fields for that model.
    """
    values = model_config.to_dict() if hasattr(model_config, "to_dict") else dict(model_config)
    name = values.pop("name", None)
    if name not in _REGISTRY:
        raise ValueError(f"model name {name!r} is not registered; choose one of {sorted(_REGISTRY)}.")
    return _REGISTRY[name](values)


def count_params(model: nn.Module, input_shape: Sequence[int], dtype: Any = jnp.int32) -> int:
    """Number of parameters of ``model`` for an input of ``input_shape`` (via ``jax.eval_shape``:
    nothing is allocated, so it works for models that do not fit in memory)."""
    shapes = jax.eval_shape(model.init, jax.random.PRNGKey(0), jax.ShapeDtypeStruct(tuple(input_shape), dtype))
    # Leaves of partitioned (boxed) params are ShapeDtypeStructs too: the boxes are pytree nodes.
    return int(sum(np.prod(leaf.shape, dtype=np.int64) for leaf in jax.tree_util.tree_leaves(shapes["params"])))


__all__ = ["NO_DECAY_NAMES", "OFFICIAL_C4_NO_DECAY_SUBSTRINGS", "official_c4_decay_mask", "LMConfig",
           "TransformerLM", "ViT", "ViTConfig", "build_model",
           "count_params", "lm_flops_per_token", "register_model"]
