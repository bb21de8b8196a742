"""Experiment families, one module each, loaded by name from ``config.task``.

* :mod:`goat_jax.tasks.lm` -- language modelling on text or the synthetic retrieval tasks.
* :mod:`goat_jax.tasks.dna` -- next-base prediction on genomes (the LM over "ACGNT").
* :mod:`goat_jax.tasks.vit` -- image classification with the ViT.

Each module defines ``TASK``, a :class:`goat_jax.train.tasks.Task` (the contract is in that
module's docstring), and builds its own model: ``config.task`` is the one name that chooses
both. ``config.task = 'lm'`` loads ``goat_jax.tasks.lm:TASK``; a task defined elsewhere is named
``'package.module:ATTR'``. Nothing here is imported by the engine except through
:func:`goat_jax.train.tasks.get_task`.

This file holds what the built-in tasks share: the parameter names their optimizers never
weight-decay (each task's ``no_decay_names``) and the reading of a ``model`` section, which
accepts the deprecated ``model.name`` of configs and checkpoints written before the task
alone chose the model.
"""

from __future__ import annotations

import warnings
from typing import Any, Dict

from goat_jax.kernels.plan import MODEL_SECTION_FIELDS

# Parameter / module names never weight-decayed (a task's ``no_decay_names``; arrays with fewer
# than two dims are never decayed anyway, goat_jax.train.optim.decay_mask). Biases and norm
# scales are the usual AdamW exclusions (decay would pull norm gains to 0, and biases carry no
# capacity to regularize). The GOAT prior parameters are a handful of numbers per head whose
# scale *is* the prior (Fourier coefficients, sink gain and bump, ALiBi-like recency slope):
# decaying them biases the learned prior towards uniform attention rather than regularizing the
# model. 'prior' is the GoatPrior module name, so its sink-MLP kernels are excluded too.
NO_DECAY_NAMES = frozenset({
    "bias", "scale", "prior", "lambda_sym", "lambda_asym", "key_bias", "sink_gain", "sink_bump",
    "recency_slope_raw", "prior_gate_scale_raw", "prior_gate_bias", "pos_freqs",
    # Frequencies (GOAT's learned ones, RoPE-Mixed's): decay would pull them to 0, i.e. to no
    # position information; Heo et al.'s code excludes RoPE-Mixed's 'freqs' from decay too.
    "rope_mixed_freqs",
})


def model_fields(config: Any, task: str, model: str) -> Dict[str, Any]:
    """The fields of ``config.model`` for the model class: without the attention plan's
    (``implementation``, ``max_documents_per_row``: the entry point builds the plan from them,
    :meth:`goat_jax.kernels.plan.AttentionPlan.from_config`, and hands it to the task's ``build_model``)
    and without the deprecated ``name``.

    ``model.name`` used to pick the model from a registry, a second name next to ``config.task``.
    The task now builds its model; an old config or checkpoint that still says
    ``model.name=<model>`` works (with a FutureWarning to remove it), another value is refused.
    """
    values = config.model.to_dict() if hasattr(config.model, "to_dict") else dict(config.model)
    for name in MODEL_SECTION_FIELDS:
        values.pop(name, None)
    if "name" in values:
        name = values.pop("name")
        if name != model:
            raise ValueError(f"model.name={name!r}: task {task!r} builds the model {model!r}; "
                             "config.task chooses the model, so remove model.name.")
        warnings.warn(f"model.name={name!r} is deprecated and ignored: config.task={task!r} chooses "
                      "the model. Remove model.name from the config.", FutureWarning, stacklevel=2)
    return values
