"""The language-model task (``config.task = 'lm'``): next-token prediction with the
Llama-style :class:`goat_jax.models.TransformerLM` on text (``goat_jax.data.text``) or on the
paper's synthetic tasks (``data.source = 'synthetic'``: copy mixture, passkey, NIAH).

Config sections: ``seq_len`` (top level), ``model.*`` (:class:`goat_jax.models.lm.LMConfig` plus
``name='lm'``) and ``data.*`` (``goat_jax.data.text.default_data_config()`` or
``goat_jax.data.synthetic.default_synthetic_config(kind)`` plus ``source``). Eval metrics:
``eval_loss`` (nats/token) and ``eval_ppl``. The contract this module fills is in
:mod:`goat_jax.train.tasks`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Dict

import numpy as np

from goat_jax import models
from goat_jax.data import synthetic, text
from goat_jax.models import lm
from goat_jax.train import tasks
from goat_jax.train import validation

Batch = tasks.Batch


def build_model(config):
    """The ``config.model`` LM (``decode=False``)."""
    return models.build_model(config.model)


def is_synthetic(config) -> bool:
    """Whether ``config.data`` selects the synthetic generators rather than text."""
    return config.data.get("source") == "synthetic"


def make_datasets(config, global_batch_size: int, process_index: int, process_count: int) -> tasks.Datasets:
    """This host's train iterator and eval factory, text or synthetic, in one batch format:
    ``inputs``, ``targets`` ``[B, seq_len]`` int32 and ``weights`` ``[B, seq_len]`` float32."""
    # data.source == 'synthetic': the paper's toy / retrieval tasks (copy mixture, passkey, NIAH)
    # in the text pipeline's batch format, so the same task, model and loss train on them.
    make = synthetic.make_synthetic_datasets if is_synthetic(config) else text.make_lm_datasets
    train, make_eval, tokenizer = make(
        config.data, seq_len=config.seq_len, global_batch_size=global_batch_size, seed=config.seed,
        process_index=process_index, process_count=process_count)
    if tokenizer.vocab_size > config.model.vocab_size:
        raise ValueError(
            f"model.vocab_size={config.model.vocab_size} is smaller than the tokenizer's vocabulary "
            f"({tokenizer.vocab_size}); set model.vocab_size >= {tokenizer.vocab_size}.")
    return tasks.Datasets(train=train, make_eval=make_eval, info={"tokenizer": tokenizer})


def loss(apply_fn, params, batch, rng):
    """Summed token cross-entropy over ``weights`` (the LM has no dropout: ``rng`` unused)."""
    del rng
    logits = apply_fn({"params": params}, batch["inputs"])  # [B, T, V] float32
    loss_sum, weight_sum = tasks.weighted_cross_entropy(logits, batch["targets"], batch["weights"])
    return loss_sum, (weight_sum, {})


def dummy_batch(config, batch_size: int) -> Batch:
    """Zeros of the training shapes."""
    shape = (batch_size, config.seq_len)
    return {"inputs": np.zeros(shape, np.int32), "targets": np.zeros(shape, np.int32),
            "weights": np.ones(shape, np.float32)}


def flops_per_token(config) -> float:
    """Training FLOPs per token of the LM at ``seq_len``."""
    fields = config.model.to_dict()
    fields.pop("name", None)
    return lm.lm_flops_per_token(lm.LMConfig.from_config(fields), config.seq_len)


def _synthetic_data_fields() -> set:
    return set(synthetic.default_synthetic_config().keys()) | {"source"}


def schema() -> Dict[str, set]:
    """The model and data fields; data is the union of both sources' fields (``validate`` then
    checks them against ``data.source``)."""
    return {"model": {"name"} | {f.name for f in dataclasses.fields(lm.LMConfig)},
            "data": set(text.default_data_config().keys()) | _synthetic_data_fields()}


def field_specs(config) -> Dict[str, Dict[str, Any]]:
    """Type and range of the task's fields (checked by :mod:`goat_jax.train.validation`): the
    model's, the chosen data source's, and ``seq_len``."""
    data = synthetic.FIELD_SPECS if is_synthetic(config) else text.FIELD_SPECS
    return {"": {"seq_len": validation.Int(min=1, doc="training context")}, "model": lm.FIELD_SPECS,
            "data": data}


def validate(config) -> None:
    """``seq_len`` positive and within the position table; ``model.name == 'lm'``; data fields
    belong to ``data.source``."""
    seq_len = config.seq_len
    if not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"seq_len={seq_len!r} must be a positive integer.")
    if config.model.get("name") != "lm":
        raise ValueError(f"model.name={config.model.get('name')!r}: task 'lm' trains model 'lm'.")
    enc = config.model.get("position_encoding", "goat")
    max_len = config.model.get("max_len", 2048)
    allowed = _synthetic_data_fields() if is_synthetic(config) else set(text.default_data_config().keys())
    stray = sorted(set(config.data.keys()) - allowed)
    if stray:
        raise ValueError(f"data.source={config.data.get('source')!r} does not use data field(s) "
                         f"{['data.' + f for f in stray]}; remove them or change data.source.")
    if not is_synthetic(config) and config.data.get("packing", "concat") == "documents":
        # The batches carry segment_ids/positions, but the model does not read them yet: it would
        # attend across the packed documents and count positions from the window start.
        raise ValueError(
            "data.packing='documents' is not yet wired into the LM: the model does not consume "
            "the batch's segment_ids and positions yet, so it would silently attend across "
            "documents. Use data.packing='concat' until the layers take segment_ids.")
    if enc in lm._TABLE_ENCODINGS and seq_len > max_len:  # pylint: disable=protected-access
        raise ValueError(
            f"seq_len={seq_len} exceeds model.max_len={max_len}, the size of the "
            f"{enc!r} position table; raise model.max_len to >= {seq_len} or shorten seq_len.")


def eval_metrics(totals: Dict[str, float]) -> Dict[str, float]:
    """``ppl``: perplexity of the mean per-token NLL (nats), capped at e^50 so the JSON stays
    finite early in training."""
    mean = totals["loss"] / totals["weight"]
    return {"ppl": float(math.exp(min(mean, 50.0)))}


TASK = tasks.Task(
    name="lm",
    batch_keys=("inputs", "targets", "weights"),
    build_model=build_model,
    make_datasets=make_datasets,
    loss=loss,
    dummy_batch=dummy_batch,
    model_inputs=lambda batch: (batch["inputs"],),
    tokens_per_example=lambda config: int(config.seq_len),
    flops_per_token=flops_per_token,
    schema=schema,
    validate=validate,
    field_specs=field_specs,
    eval_metrics=eval_metrics,
    top_level_fields=("seq_len",),
    # Reading threads and eval size change nothing the checkpoint depends on; remat and the
    # attention kernel change memory and speed, not the function computed.
    resume_safe_fields=("data.read_threads", "data.num_eval_batches", "model.remat",
                        "model.implementation"),
    no_decay_names=models.NO_DECAY_NAMES,
    decay_groupings={"official_c4": models.official_c4_decay_mask},
    # Fields a config may leave out (runs from before they existed resume under their defaults).
    field_defaults=lambda: {**tasks.dataclass_defaults(lm.LMConfig, "model"), "data.span_loss_weight": None,
                            "data.packing": "concat"},
)
