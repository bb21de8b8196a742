"""The language-model task (``config.task = 'lm'``): next-token prediction with the
Llama-style :class:`goat_jax.models.TransformerLM` on text (``goat_jax.data.text``) or on the
paper's synthetic tasks (``data.source = 'synthetic'``: copy mixture, passkey, NIAH).

Config sections: ``seq_len`` (top level), ``model.*`` (the fields of
:class:`goat_jax.models.lm.LMConfig`; this task builds the model) and ``data.*`` (``goat_jax.data.text.default_data_config()`` or
``goat_jax.data.synthetic.default_synthetic_config(kind)`` plus ``source``). Eval metrics:
``eval_loss`` (nats/token), ``eval_ppl`` and ``eval_tokens`` (the scored targets). The contract this module fills is in
:mod:`goat_jax.train.tasks`.
"""

from __future__ import annotations

import math
from typing import Any, Dict, Optional

import jax
import jax.numpy as jnp
import numpy as np

from goat_jax import prior as prior_lib
from goat_jax.config.fields import Field, Int
from goat_jax.data import synthetic, text
from goat_jax.data.synthetic import is_synthetic
from goat_jax.kernels import strategies
from goat_jax.models import lm
from goat_jax.tasks import NO_DECAY_NAMES, model_fields
from goat_jax.train import optim
from goat_jax.kernels.plan import AttentionPlan
from goat_jax.train import tasks
from goat_jax.train import validation

Batch = tasks.Batch

# The official C4 recipe's grouping (docs/protocols.md, C4 125M; optimizer.decay_grouping=
# 'official_c4'): weight decay on every parameter whose dotted path contains none of these
# substrings, 1-D or not, so the sink gain, bump and recency slope and the gate parameters *are*
# decayed. Applied to our dotted parameter paths, the names correspond: PyTorch ``*.bias`` = our
# Dense/LayerNorm ``*.bias``; ``ln_*`` = our ``*_norm`` modules; ``lambda_sym/asym`` and the
# sink MLP ``key_bias.*`` keep their names under ``prior``. ``pos_freqs`` (learned frequencies,
# PriorSettings.learn_frequencies) is not in the official model, so it matches no official
# parameter: it is excluded, like the coefficients it multiplies, rather than pulled to 0.
OFFICIAL_C4_NO_DECAY_SUBSTRINGS = (".bias", "ln", "norm", "lambda_", "key_bias", "pos_freqs")
official_c4_decay_mask = optim.substring_decay_mask(OFFICIAL_C4_NO_DECAY_SUBSTRINGS)


def model_config(config, task: str = "lm") -> lm.LMConfig:
    """The :class:`LMConfig` of ``config.model`` (``task`` names the task in errors)."""
    return lm.LMConfig.from_config(model_fields(config, task, "lm"))


def build_model(config, plan: AttentionPlan):
    """The ``config.model`` LM (``decode=False``) whose attention runs under ``plan`` (the run's,
    built once by the entry point)."""
    return lm.TransformerLM(model_config(config), plan=plan)


# cuDNN takes half-precision inputs only: a float32 model runs 'flash' even on a GPU.
_CUDNN_DTYPES = ("bfloat16", "float16")


def document_bound(config, plan: AttentionPlan, platform: str, context: int) -> Optional[int]:
    """The run's ``plan.max_documents_per_row`` where cuDNN's packed layout may attend its packed
    documents, else None: the most documents (the padding counting as one) a packed row may
    hold there, which the packers honour by starting a new row (goat_jax/data/packing.py).

    The layout may run only for ``data.packing='documents'`` rows of a text run, with
    ``model.implementation`` None or 'cudnn', on a GPU (``platform``), in bfloat16 / float16,
    and with each device's kernel seeing whole rows: ``context`` 1, or a ``context_strategy``
    whose kernel attends whole sequences (Ulysses:
    :attr:`goat_jax.kernels.strategies.Strategy.whole_sequences`). Under all-gather and ring each
    device's queries may start inside a document, which cuDNN's layout cannot express, so flash
    runs. Errs towards "may run" (the GPU generation is not checked): a bound applied where
    flash runs costs only fuller rows. Whether the plan's kernel may be cuDNN and its bound
    are ``plan``'s (:meth:`goat_jax.kernels.plan.AttentionPlan.document_bound`); training and
    evaluation both ask here."""
    if is_synthetic(config) or text.DATA.value(config.data, "packing") != "documents":
        return None
    bound = plan.document_bound()
    if bound is None or platform != "gpu":
        return None
    if context > 1 and not strategies.get(plan.context_strategy).whole_sequences:
        return None
    if np.dtype(jnp.dtype(model_config(config).dtype)).name not in _CUDNN_DTYPES:
        return None
    return int(bound)


def make_datasets(config, global_batch_size: int, process_index: int, process_count: int, *,
                  plan: AttentionPlan) -> tasks.Datasets:
    """This host's train iterator and eval factory, text or synthetic, in one batch format:
    ``inputs``, ``targets`` ``[B, seq_len]`` int32 and ``weights`` ``[B, seq_len]`` float32.
    Packed documents honour ``plan``'s document bound (:func:`document_bound`)."""
    # data.source == 'synthetic': the paper's toy / retrieval tasks (copy mixture, passkey, NIAH)
    # in the text pipeline's batch format, so the same task, model and loss train on them.
    extra = {}
    context = int(validation.ENGINE["mesh"].value(config.get("mesh"), "context"))
    bound = document_bound(config, plan, jax.devices()[0].platform, context)
    if bound is not None:  # the packer starts a new row rather than exceed it
        extra["max_documents"] = bound
    make = synthetic.make_synthetic_datasets if is_synthetic(config) else text.make_lm_datasets
    train, make_eval, tokenizer = make(
        config.data, seq_len=config.seq_len, global_batch_size=global_batch_size, seed=config.seed,
        process_index=process_index, process_count=process_count, **extra)
    if tokenizer.vocab_size > config.model.vocab_size:
        raise ValueError(
            f"model.vocab_size={config.model.vocab_size} is smaller than the tokenizer's vocabulary "
            f"({tokenizer.vocab_size}); set model.vocab_size >= {tokenizer.vocab_size}.")
    return tasks.Datasets(train=train, make_eval=make_eval, info={"tokenizer": tokenizer})


def document_inputs(batch) -> Dict[str, Any]:
    """The model's keyword inputs of a batch: ``segment_ids`` and ``positions`` of a
    ``data.packing='documents'`` batch (attention stays inside each document, positions restart
    per document), none for ``'concat'``; ``positions`` also when a batch carries them alone
    (the engine's load-balanced order, goat_jax/kernels/balance.py)."""
    return {key: batch[key] for key in ("segment_ids", "positions") if key in batch}


def loss(apply_fn, params, batch, rng):
    """Summed token cross-entropy over ``weights`` (the LM has no dropout: ``rng`` unused).
    Padding of packed documents has weight 0, so it never enters the loss."""
    del rng
    # The model's own loss: from the full float32 logits, or with model.loss_chunk_size a chunk
    # of positions at a time, never holding the [B, T, V] logits (TransformerLM.token_loss).
    loss_sum, weight_sum = apply_fn({"params": params}, batch["inputs"], batch["targets"], batch["weights"],
                                    method="token_loss", **document_inputs(batch))
    return loss_sum, (weight_sum, {})


def dummy_batch(config, batch_size: int) -> Batch:
    """Zeros of the training shapes (with ``segment_ids``/``positions`` under
    ``data.packing='documents'``: one document per row)."""
    shape = (batch_size, config.seq_len)
    batch = {"inputs": np.zeros(shape, np.int32), "targets": np.zeros(shape, np.int32),
             "weights": np.ones(shape, np.float32)}
    if not is_synthetic(config) and text.DATA.value(config.data, "packing") == "documents":
        batch["segment_ids"] = np.ones(shape, np.int32)
        batch["positions"] = np.broadcast_to(np.arange(config.seq_len, dtype=np.int32), shape).copy()
    return batch


def flops_per_token(config) -> float:
    """Training FLOPs per token of the LM at ``seq_len``."""
    return lm.lm_flops_per_token(model_config(config), config.seq_len)


def _synthetic_data_fields() -> set:
    return set(synthetic.default_synthetic_config().keys()) | {"source"}


def seq_len_spec(doc: str = "training context") -> Field:
    """``seq_len``: at least 1, at most ``MAX_POSITION`` (2**24), the positions every attention
    layer accepts (beyond, float32 positions stop being integers; goat_jax/prior/positions.py),
    so that a longer one is refused naming the field instead of deep inside the model's init."""
    return Int(min=1, max=prior_lib.MAX_POSITION,
               doc=f"{doc}; positions must stay below MAX_POSITION={prior_lib.MAX_POSITION} (2**24), "
                   "goat_jax/prior/positions.py: use a shorter seq_len")


# The LM task's config fields: the model dataclass, the two data pipelines (text files / TFDS,
# and the synthetic tasks, chosen by data.source), seq_len.
FIELDS = tasks.TaskFields(
    model=lm.LMConfig,
    data={"text": text.FIELD_SPECS, "synthetic": synthetic.FIELD_SPECS},
    data_source=lambda config: "synthetic" if is_synthetic(config) else "text",
    top_level={"seq_len": seq_len_spec()},
    # model.name='lm' is what checkpoints written before the task alone chose the model hold;
    # runs from before data.span_loss_weight / data.packing existed resume under these.
    model_name="lm", data_defaults={"data.span_loss_weight": None, "data.packing": "concat"})


def validate_model(config, task: str) -> None:
    """The LM section's rules for a run of ``task``: the model config builds (its cross-field
    rules) and ``seq_len`` fits its position table. Shared by the tasks that train the LM."""
    model_config(config, task).check_length(config.seq_len, "seq_len")


def validate(config) -> None:
    """The model's rules (:func:`validate_model`); data fields belong to ``data.source``.
    (Types and ranges, ``seq_len >= 1`` included, are checked before, from :data:`FIELDS`.)"""
    allowed = _synthetic_data_fields() if is_synthetic(config) else set(text.default_data_config().keys())
    stray = sorted(set(config.data.keys()) - allowed)
    if stray:
        raise ValueError(f"data.source={config.data.get('source')!r} does not use data field(s) "
                         f"{['data.' + f for f in stray]}; remove them or change data.source.")
    validate_model(config, "lm")


def eval_metrics(totals: Dict[str, float]) -> Dict[str, float]:
    """``ppl``: perplexity of the mean per-token NLL (nats), capped at e^50 so the JSON stays
    finite early in training; ``tokens``: the scored targets it is over (a tiny held-out split
    shows here, not as an ordinary-looking perplexity)."""
    mean = totals["loss"] / totals["weight"]
    return {"ppl": float(math.exp(min(mean, 50.0))), "tokens": float(totals["weight"])}


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
    fields=FIELDS,
    validate=validate,
    eval_metrics=eval_metrics,
    # Reading threads and eval size change nothing the checkpoint depends on; remat and the
    # attention kernel change memory and speed, not the function computed.
    resume_safe_fields=("data.read_threads", "data.num_eval_batches", "model.remat", "model.remat_policy",
                        "model.implementation", "model.max_documents_per_row", "model.loss_chunk_size"),
    no_decay_names=NO_DECAY_NAMES,
    decay_groupings={"official_c4": official_c4_decay_mask},
)
