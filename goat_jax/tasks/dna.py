"""The genome task (``config.task = 'dna'``): next-base prediction on FASTA or parquet genomes.

The model is the language model (:class:`goat_jax.models.TransformerLM`, usually with the GPT-2
block of the official recipe, :func:`official_model_config`) over the 5 tokens "ACGNT"; the data
is :mod:`goat_jax.data.dna` (crops of ``seq_len + 1`` bases, splits by chromosome). Training and
the loss are those of the LM task; evaluation adds what genome papers report per base:

    eval_loss            NLL in nats per base (N targets carry weight 0: goat_jax/data/dna.py)
    eval_bits_per_base   eval_loss / ln 2
    eval_ppl             exp(eval_loss)
    eval_accuracy        next-base accuracy (argmax == target)
    eval_tokens          the scored bases these are over

Config sections: ``seq_len`` (top level), ``model.*`` (the fields of :class:`goat_jax.models.lm.LMConfig`)
and ``data.*`` (``goat_jax.data.dna.default_dna_data_config()``). Longer contexts,
other FASTA files and GC agreement: ``python -m experiments.evaluate --evals dna``.
"""

from __future__ import annotations

import math
from typing import Dict

import jax.numpy as jnp

from goat_jax import _extras
with _extras.imports(__name__):  # optional packages: one-line error naming the extra
    import ml_collections
    from ml_collections import config_dict

from goat_jax.data import dna, fasta
from goat_jax.models import lm
from goat_jax.tasks import NO_DECAY_NAMES
from goat_jax.tasks import lm as lm_task
from goat_jax.train import optim
from goat_jax.kernels.plan import AttentionPlan
from goat_jax.train import tasks


def official_model_config(encoding: str = "goat") -> ml_collections.ConfigDict:
    """``config.model`` of the official genome GPT (docs/protocols.md, DNA): pre-LN LayerNorm
    (eps 1e-5), GELU(tanh) MLP 4x, biases in every Linear, tied embeddings, d 512, 8 layers,
    8 heads, vocab 5 (~25.2M parameters); GOAT R = 2, M = 8, seeded; RoPE base 1e4. ``encoding``
    is any of ``goat_jax.models.lm.POSITION_ENCODINGS``; everything else is identical."""
    m = ml_collections.ConfigDict()
    m.block = "gpt2"  # pre-LN LayerNorm + GELU(tanh) MLP
    m.vocab_size = fasta.VOCAB_SIZE  # "ACGNT"
    m.num_layers = 8  # official
    m.embed_dim = 512  # official d
    m.num_heads = 8  # official (head dim 64)
    m.kv_num_heads = config_dict.placeholder(int)  # None: no GQA
    m.head_dim = config_dict.placeholder(int)  # None: embed_dim // num_heads
    m.mlp_dim = 2048  # MLP 4x
    m.position_encoding = encoding  # 'goat' | 'rope' | 'alibi' | 'nope' | ...
    m.tie_embeddings = True  # official: tied
    m.max_len = 16384  # table size for 'learned' / 'naive_prior' (16x the official L)
    m.training_seq_len = 1024  # GOAT sink normalization / RoPE-PI scale: the training L
    m.rope_base = 10_000.0  # official RoPE base, over the full head
    m.pos_rank = 2  # official GOAT R
    m.abs_rank = 8  # official GOAT M
    m.prior_init = "seeded"  # official
    m.prior_gate = "none"  # official: no gate
    m.enable_key_bias = True  # learned sink u(j)
    m.use_bias = True  # biases in every Linear (GPT-2)
    m.norm_eps = 1e-5  # GPT-2 LayerNorm epsilon
    m.init_std = 0.02  # N(0, 0.02) embeddings and MLP kernels
    m.dtype = "float32"  # compute dtype (the hg38 config uses bfloat16)
    m.param_dtype = "float32"  # parameter dtype
    m.remat = False  # no rematerialization
    m.scan_layers = False  # unrolled blocks
    m.implementation = config_dict.placeholder(str)  # attention kernel; None: auto
    return m


def make_datasets(config, global_batch_size: int, process_index: int, process_count: int, *,
                  plan: AttentionPlan) -> tasks.Datasets:
    """This host's crops of the genome in the LM batch format (``inputs``/``targets``/``weights``).
    ``plan`` is unused (crops are not packed documents)."""
    del plan
    if config.model.vocab_size < fasta.VOCAB_SIZE:
        raise ValueError(f"model.vocab_size={config.model.vocab_size} must be >= {fasta.VOCAB_SIZE} "
                         "(the DNA tokens ACGNT).")
    train, make_eval, tokenizer = dna.make_dna_datasets(
        config.data, seq_len=config.seq_len, global_batch_size=global_batch_size, seed=config.seed,
        process_index=process_index, process_count=process_count,
        require_eval=bool(config.eval_every_steps))  # an empty held-out split: before training
    return tasks.Datasets(train=train, make_eval=make_eval, info={"tokenizer": tokenizer})


def loss(apply_fn, params, batch, rng):
    """Summed per-base cross-entropy over ``weights``, with the number of correct argmax
    predictions as an auxiliary sum (no dropout: ``rng`` unused)."""
    del rng
    # Explicit positions only in the engine's load-balanced order (goat_jax/kernels/balance.py).
    logits = apply_fn({"params": params}, batch["inputs"], **lm_task.document_inputs(batch))  # [B, T, 5] float32
    loss_sum, weight_sum = tasks.weighted_cross_entropy(logits, batch["targets"], batch["weights"])
    correct = (jnp.argmax(logits, -1) == batch["targets"]).astype(jnp.float32)
    return loss_sum, (weight_sum, {"correct": jnp.sum(correct * batch["weights"].astype(jnp.float32))})


# The DNA task's config fields: the LM's model dataclass, the genome pipeline's data, seq_len.
FIELDS = tasks.TaskFields(model=lm.LMConfig, data={"dna": dna.FIELD_SPECS},
                          top_level={"seq_len": lm_task.seq_len_spec("training context (bases)")}, model_name="lm")


def validate(config) -> None:
    """The LM's rules (config builds, ``seq_len`` fits a position table), for task 'dna'."""
    lm_task.validate_model(config, "dna")
    if config.model.get("loss_chunk_size") is not None:
        raise ValueError(f"model.loss_chunk_size={config.model.loss_chunk_size}: the DNA task's loss reads the full "
                         "logits (5 letters; its accuracy needs them), so it would be ignored; remove it.")


def eval_metrics(totals: Dict[str, float]) -> Dict[str, float]:
    """Bits per base, perplexity (capped at e^50 to keep the JSON finite), accuracy and the
    scored bases they are over (``tokens``)."""
    mean = totals["loss"] / totals["weight"]
    return {"bits_per_base": mean / math.log(2), "ppl": float(math.exp(min(mean, 50.0))),
            "accuracy": totals["correct"] / totals["weight"], "tokens": float(totals["weight"])}


TASK = tasks.Task(
    name="dna",
    batch_keys=("inputs", "targets", "weights"),
    build_model=lambda config, plan: lm.TransformerLM(lm_task.model_config(config, "dna"), plan=plan),
    make_datasets=make_datasets,
    loss=loss,
    dummy_batch=lm_task.dummy_batch,
    model_inputs=lambda batch: (batch["inputs"],),
    tokens_per_example=lambda config: int(config.seq_len),
    flops_per_token=lambda config: lm.lm_flops_per_token(lm_task.model_config(config, "dna"), config.seq_len),
    fields=FIELDS,
    validate=validate,
    eval_metrics=eval_metrics,
    # Reader threads and eval size change nothing the checkpoint depends on; remat and the
    # kernel change memory and speed, not the function computed.
    resume_safe_fields=("data.read_threads", "data.num_eval_batches", "model.remat",
                        "model.implementation"),
    no_decay_names=NO_DECAY_NAMES,
    # optimizer.decay_grouping='official_genome' (configs/dna_hg38.py): the official genome run
    # applies AdamW's decay to every parameter (biases, norms, GOAT prior parameters included).
    decay_groupings={"official_genome": optim.decay_everything},
)
