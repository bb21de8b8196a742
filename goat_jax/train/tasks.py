"""What the engine trains, chosen by ``config.task``: a small registry of :class:`Task`.

A task bundles everything that is specific to one kind of experiment -- the model builder, the
data builder, the loss, the batch keys, the FLOP count and the config schema of its ``model``
and ``data`` sections -- so the trainer itself never imports a model or a dataset. The language
task ('lm') is defined here; DNA and ViT tasks register themselves the same way
(:func:`register_task`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Dict, Iterator, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

Batch = Dict[str, Any]


@dataclasses.dataclass(frozen=True)
class Datasets:
    """What a task's data builder returns.

    ``train``: infinite iterator of this host's numpy batches with ``get_state()`` (JSON) and
    ``set_state(state)``; ``make_eval``: returns a fresh finite iterator of eval batches, or is
    None; ``info``: task-specific extras (e.g. the tokenizer).
    """

    train: Iterator[Batch]
    make_eval: Optional[Callable[[], Iterator[Batch]]]
    info: Dict[str, Any]


@dataclasses.dataclass(frozen=True)
class Task:
    """The task-specific half of a training run.

    Attributes:
      name: the value of ``config.task``.
      batch_keys: keys every batch holds (checked on the first batch).
      build_model: ``config -> nn.Module``.
      make_datasets: ``(config, global_batch_size, process_index, process_count) -> Datasets``.
      loss: ``(apply_fn, params, batch) -> (loss_sum, (weight_sum, aux))``: an unnormalized sum
        (e.g. over tokens) and its weight; the engine divides, which keeps gradient accumulation
        exact.
      dummy_batch: ``(config, batch_size) -> numpy batch`` of the training shapes (for init and
        benchmarks; only ``batch_keys`` matter).
      model_inputs: ``batch -> positional args of model.apply`` (used for ``init``).
      tokens_per_example: ``config -> int``, for tokens/s.
      flops_per_token: ``config -> float`` training FLOPs per token (forward + backward) for MFU.
      schema: ``() -> {section: set of field names}`` for the task's own config sections.
      validate: ``config -> None``; raises ValueError naming the field (e.g. length limits).
      eval_summary: ``mean eval loss -> extra eval metrics`` (e.g. perplexity).
      top_level_fields: task-specific top-level config fields (e.g. ``seq_len``).
      field_specs: ``config -> {section: {field: validation.Field}}``, the type and range of
        the task's fields ('' for its top-level ones), checked before any work
        (:mod:`goat_jax.train.validation`).
    """

    name: str
    batch_keys: Tuple[str, ...]
    build_model: Callable[[Any], Any]
    make_datasets: Callable[..., Datasets]
    loss: Callable[..., Tuple[jax.Array, Tuple[jax.Array, Any]]]
    dummy_batch: Callable[[Any, int], Batch]
    model_inputs: Callable[[Batch], Sequence[Any]]
    tokens_per_example: Callable[[Any], int]
    flops_per_token: Callable[[Any], float]
    schema: Callable[[], Dict[str, set]]
    validate: Callable[[Any], None] = lambda config: None
    eval_summary: Callable[[float], Dict[str, float]] = lambda loss: {}
    top_level_fields: Tuple[str, ...] = ()
    field_specs: Callable[[Any], Dict[str, Dict[str, Any]]] = lambda config: {}


_TASKS: Dict[str, Task] = {}


def register_task(task: Task) -> Task:
    """Adds ``task`` to the registry under ``task.name`` (re-registering replaces, so test
    modules and notebooks can be re-imported)."""
    _TASKS[task.name] = task
    return task


def get_task(name: str) -> Task:
    """The registered task ``name``; ValueError naming ``config.task`` otherwise."""
    if name not in _TASKS:
        raise ValueError(f"config.task={name!r} is not a registered task; choose one of {sorted(_TASKS)}.")
    return _TASKS[name]


# ----------------------------------------------------------------------------------------------
# Shared losses
# ----------------------------------------------------------------------------------------------


def weighted_cross_entropy(logits: jax.Array, targets: jax.Array, weights: jax.Array) -> Tuple[jax.Array, jax.Array]:
    """``(sum_i w_i * CE(logits_i, targets_i), sum_i w_i)`` in float32 (the log-softmax over a
    large vocabulary loses digits in bfloat16)."""
    ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)
    weights = weights.astype(jnp.float32)
    return jnp.sum(ce * weights), jnp.sum(weights)


# ----------------------------------------------------------------------------------------------
# The language-model task
# ----------------------------------------------------------------------------------------------


def _lm_build_model(config):
    from goat_jax import models  # pylint: disable=g-import-not-at-top
    return models.build_model(config.model)


def _lm_make_datasets(config, global_batch_size: int, process_index: int, process_count: int) -> Datasets:
    from goat_jax.data import synthetic, text  # pylint: disable=g-import-not-at-top
    # data.source == 'synthetic': the paper's toy / retrieval tasks (copy mixture, passkey, NIAH)
    # in the text pipeline's batch format, so the same task, model and loss train on them.
    make = synthetic.make_synthetic_datasets if _is_synthetic(config) else text.make_lm_datasets
    train, make_eval, tokenizer = make(
        config.data, seq_len=config.seq_len, global_batch_size=global_batch_size, seed=config.seed,
        process_index=process_index, process_count=process_count)
    if tokenizer.vocab_size > config.model.vocab_size:
        raise ValueError(
            f"model.vocab_size={config.model.vocab_size} is smaller than the tokenizer's vocabulary "
            f"({tokenizer.vocab_size}); set model.vocab_size >= {tokenizer.vocab_size}.")
    return Datasets(train=train, make_eval=make_eval, info={"tokenizer": tokenizer})


def _lm_loss(apply_fn, params, batch):
    logits = apply_fn({"params": params}, batch["inputs"])  # [B, T, V] float32
    loss_sum, weight_sum = weighted_cross_entropy(logits, batch["targets"], batch["weights"])
    return loss_sum, (weight_sum, None)


def _lm_dummy_batch(config, batch_size: int) -> Batch:
    shape = (batch_size, config.seq_len)
    return {"inputs": np.zeros(shape, np.int32), "targets": np.zeros(shape, np.int32),
            "weights": np.ones(shape, np.float32)}


def _lm_flops(config) -> float:
    from goat_jax.models import lm  # pylint: disable=g-import-not-at-top
    fields = config.model.to_dict()
    fields.pop("name", None)
    return lm.lm_flops_per_token(lm.LMConfig.from_config(fields), config.seq_len)


def _lm_schema() -> Dict[str, set]:
    from goat_jax.data import text  # pylint: disable=g-import-not-at-top
    from goat_jax.models import lm  # pylint: disable=g-import-not-at-top
    # The union of both sources' fields; _lm_validate then checks them against data.source.
    return {"model": {"name"} | {f.name for f in dataclasses.fields(lm.LMConfig)},
            "data": set(text.default_data_config().keys()) | _synthetic_data_fields()}


# Synthetic data (``data.source == 'synthetic'``): the data section is
# ``synthetic.default_synthetic_config(kind)`` plus ``source``; everything else is the LM task.
def _is_synthetic(config) -> bool:
    return config.data.get("source") == "synthetic"


def _synthetic_data_fields() -> set:
    from goat_jax.data import synthetic  # pylint: disable=g-import-not-at-top
    return set(synthetic.default_synthetic_config().keys()) | {"source"}


def _lm_field_specs(config) -> Dict[str, Dict[str, Any]]:
    from goat_jax.data import synthetic, text  # pylint: disable=g-import-not-at-top
    from goat_jax.models import lm  # pylint: disable=g-import-not-at-top
    from goat_jax.train.validation import Int  # pylint: disable=g-import-not-at-top
    data = synthetic.FIELD_SPECS if _is_synthetic(config) else text.FIELD_SPECS
    return {"": {"seq_len": Int(min=1, doc="training context")}, "model": lm.FIELD_SPECS, "data": data}


def _lm_validate(config) -> None:
    from goat_jax.models import lm  # pylint: disable=g-import-not-at-top
    seq_len = config.seq_len
    if not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"seq_len={seq_len!r} must be a positive integer.")
    if config.model.get("name") != "lm":
        raise ValueError(f"model.name={config.model.get('name')!r}: task 'lm' trains model 'lm'.")
    enc = config.model.get("position_encoding", "goat")
    max_len = config.model.get("max_len", 2048)
    # The schema admits both sources' data fields; here they must match the chosen source.
    from goat_jax.data import text  # pylint: disable=g-import-not-at-top
    allowed = (_synthetic_data_fields() if _is_synthetic(config)
               else set(text.default_data_config().keys()))
    stray = sorted(set(config.data.keys()) - allowed)
    if stray:
        raise ValueError(f"data.source={config.data.get('source')!r} does not use data field(s) "
                         f"{['data.' + f for f in stray]}; remove them or change data.source.")
    if enc in lm._TABLE_ENCODINGS and seq_len > max_len:  # pylint: disable=protected-access
        raise ValueError(
            f"seq_len={seq_len} exceeds model.max_len={max_len}, the size of the "
            f"{enc!r} position table; raise model.max_len to >= {seq_len} or shorten seq_len.")


register_task(Task(
    name="lm",
    batch_keys=("inputs", "targets", "weights"),
    build_model=_lm_build_model,
    make_datasets=_lm_make_datasets,
    loss=_lm_loss,
    dummy_batch=_lm_dummy_batch,
    model_inputs=lambda batch: (batch["inputs"],),
    tokens_per_example=lambda config: int(config.seq_len),
    flops_per_token=_lm_flops,
    schema=_lm_schema,
    validate=_lm_validate,
    # Perplexity of the mean per-token NLL (nats); capped to keep JSON finite early in training.
    eval_summary=lambda loss: {"eval_ppl": float(math.exp(min(loss, 50.0)))},
    top_level_fields=("seq_len",),
    field_specs=_lm_field_specs,
))
