"""Synthetic retrieval (passkey, needle in a haystack): small byte-level LMs trained from scratch.

    python -m experiments.train --config configs/retrieval_tiny.py:passkey --workdir runs/passkey
    python -m experiments.train --config configs/retrieval_tiny.py:niah,rope --workdir runs/niah_rope
    python -m experiments.evaluate --workdir runs/passkey --evals passkey --multipliers 1,2,4,8,16

The official GOAT retrieval experiments (docs/protocols.md, Passkey and NIAH): character models trained on
the synthetic passkey (random a-z filler, "passkey: <8 digits>", teacher-forced exact match of
the key span) at a short length and tested longer; NIAH likewise ("key=value" needle at a
depth, value span token accuracy). Here both train at 64 bytes, so 16x is 1024 and the whole
suite fits a CPU.

Argument: ``'<task>[,<position_encoding>][,smoke|paper][,official]'``; task 'passkey' or
'niah', encoding default 'goat'. 'smoke': a seconds-long run for tests. 'paper': paper-scale
character models for an accelerator (NIAH trained at 256 as the official run; the passkey length
1024 and the 8 layers x d 512 are ours: docs/protocols.md does not state them).
'official': the official synthetic script's settings (docs/protocols.md, Passkey) at any size:
GOAT R = M = 8, ``init_scale_prior`` 3e-3, training loss (global + 10 * span) / 11, and the
baselines' attention at scale 1 (logits ``q . k``, no 1 / sqrt(head_dim)); without it the loss
is the span's alone and every encoding uses 1 / sqrt(head_dim).
Everything except the position encoding (and, with 'official', the baselines' logit scale) is
identical across encodings.
"""

import ml_collections
from ml_collections import config_dict

from goat_jax.config.args import REQUIRED, parse_config_arg
from goat_jax.data import synthetic
from goat_jax.models import lm

TASKS = ("passkey", "niah")
SIZES = ("smoke", "paper")
OFFICIAL_RANK = 8  # official synthetic GOAT: R = M = 8
OFFICIAL_INIT_SCALE_PRIOR = 3e-3  # official synthetic: sink MLP init std
OFFICIAL_SPAN_LOSS_WEIGHT = 10.0  # official synthetic: loss (global + 10 * span) / 11
OFFICIAL_BASELINE_ATTENTION_SCALE = 1.0  # official synthetic baselines: softmax(q . k)


def get_config(arg: str = "passkey") -> ml_collections.ConfigDict:
    """The retrieval config; ``arg`` = ``'<passkey|niah>[,<encoding>][,smoke|paper][,official]'``."""
    args = parse_config_arg(arg or "passkey", "configs/retrieval_tiny.py", task=(TASKS, REQUIRED),
                            encoding=(lm.POSITION_ENCODINGS, "goat"), size=(SIZES, "tiny"),
                            settings=(("official",), None))
    kind, encoding, size = args["task"], args["encoding"], args["size"]

    c = ml_collections.ConfigDict()
    c.task = "lm"  # next-token prediction; only the scored span carries weight
    c.seq_len = 64  # training length (bytes); evaluated up to 16x

    c.num_train_steps = 600  # the key-span loss is ~0 after ~400 steps (GOAT and RoPE)
    c.global_batch_size = 32  # windows per step
    c.log_every_steps = 25  # metrics cadence
    c.eval_every_steps = 500  # held-out loss of the scored span
    c.checkpoint_every_steps = 500  # checkpoint cadence (also at the end)
    c.keep_checkpoints = 1  # newest only

    c.optimizer = ml_collections.ConfigDict()
    c.optimizer.learning_rate = 3e-3  # small models take large steps (as lm_tiny)
    c.optimizer.warmup_steps = 100  # linear warmup

    c.model = ml_collections.ConfigDict()
    c.model.vocab_size = 259  # byte tokenizer
    c.model.num_layers = 2  # an induction circuit needs two layers (previous token, then match)
    c.model.embed_dim = 128  # residual width
    c.model.num_heads = 4  # query heads (head_dim 32)
    c.model.kv_num_heads = 4  # MHA: GOAT's prior is per KV head, so every head gets its own
    c.model.head_dim = config_dict.placeholder(int)  # None: embed_dim // num_heads
    c.model.mlp_dim = 384  # SwiGLU hidden
    c.model.position_encoding = encoding  # the config argument
    c.model.tie_embeddings = True  # output projection = input embedding
    c.model.max_len = 2048  # 'learned' / 'naive_prior' tables cover 32x the training length
    c.model.training_seq_len = c.get_oneway_ref("seq_len")  # sink normalization / RoPE-PI scale (seq_len unless set)
    c.model.rope_base = 10_000.0  # RoPE frequency base
    c.model.pos_rank = 4  # GOAT R (2R of the 32 head dims)
    c.model.abs_rank = 4  # GOAT M of the sink MLP
    c.model.prior_init = "seeded"  # ALiBi-like start
    c.model.prior_gate = "none"  # no query-norm gate
    c.model.enable_key_bias = True  # learned sink u(j)
    c.model.init_scale_prior = 1e-3  # sink MLP kernels drawn N(0, 1e-3)
    c.model.baseline_attention_scale = config_dict.placeholder(float)  # None: 1 / sqrt(head_dim)
    c.model.norm_eps = 1e-6  # RMSNorm epsilon
    c.model.dtype = "float32"  # CPU
    c.model.param_dtype = "float32"  # CPU
    c.model.remat = False  # small
    c.model.scan_layers = False  # two layers: unrolled
    c.model.implementation = config_dict.placeholder(str)  # None: XLA on CPU

    c.data = synthetic.default_synthetic_config(kind)  # passkey: 8-digit key; NIAH: 5-letter key, 6 digits
    c.data.source = "synthetic"  # goat_jax.train.tasks: synthetic generators instead of text
    c.data.num_eval_batches = 4  # 128 held-out windows
    c.data.span_loss_weight = config_dict.placeholder(float)  # None: the loss is the span's alone

    if size == "smoke":  # seconds: the reproduce smoke test
        c.num_train_steps = 6
        c.global_batch_size = 8
        c.log_every_steps = 2
        c.eval_every_steps = 0
        c.checkpoint_every_steps = 6
        c.optimizer.warmup_steps = 2
        c.model.num_layers = 1
        c.model.embed_dim = 32
        c.model.mlp_dim = 64
        c.model.num_heads = 2
        c.model.kv_num_heads = 2
        c.model.pos_rank = 2
        c.model.abs_rank = 2
        c.data.num_eval_batches = 1
    elif size == "paper":  # paper-scale char models on an accelerator (NIAH length official, rest ours)
        c.seq_len = 1024 if kind == "passkey" else 256
        c.num_train_steps = 20_000
        c.global_batch_size = 64
        c.eval_every_steps = 2000
        c.checkpoint_every_steps = 2000
        c.keep_checkpoints = 2
        c.optimizer.learning_rate = 1e-3
        c.optimizer.warmup_steps = 1000
        c.model.num_layers = 8
        c.model.embed_dim = 512
        c.model.num_heads = 8
        c.model.kv_num_heads = 8
        c.model.mlp_dim = 1536
        c.model.max_len = 32_768
        c.model.pos_rank = 8
        c.model.abs_rank = 8
        c.model.dtype = "bfloat16"
    if args["settings"] == "official":  # official synthetic.py settings (docs/protocols.md, Passkey)
        c.model.pos_rank = c.model.abs_rank = OFFICIAL_RANK
        c.model.init_scale_prior = OFFICIAL_INIT_SCALE_PRIOR
        c.data.span_loss_weight = OFFICIAL_SPAN_LOSS_WEIGHT  # eval still scores the span alone
        c.model.baseline_attention_scale = OFFICIAL_BASELINE_ATTENTION_SCALE  # GOAT unaffected
        if size == "smoke":  # R = 8 needs 2R + 1 = 17 prior dims: one head of 32
            c.model.num_heads = c.model.kv_num_heads = 1
    return c
