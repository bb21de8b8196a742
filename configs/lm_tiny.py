"""Tiny byte-level GOAT language model on the Jargon File: trains on a 2-core CPU in minutes.

      python -m experiments.train --config configs/lm_tiny.py --workdir runs/tiny
      python -m experiments.train --config configs/lm_tiny.py:rope --workdir runs/tiny_rope

The argument names the position encoding (default 'goat'; any of
goat_jax.models.lm.POSITION_ENCODINGS), optionally followed by ',smoke': a seconds-long variant
(1 layer, 64 wide, 64 bytes, batch 8) for tests, e.g. ``configs/lm_tiny.py:rope,smoke``, and
for GOAT by ',linear_sink': the sink continued linearly past the training length
(``model.sink_extrapolation='linear'``, docs/extrapolation.md), e.g.
``configs/lm_tiny.py:goat,linear_sink``. Everything else is identical across encodings.
"""

import ml_collections
from ml_collections import config_dict

from goat_jax.config.args import parse_config_arg
from goat_jax.data import text
from goat_jax.models import lm


def get_config(arg: str = "goat") -> ml_collections.ConfigDict:
    """The tiny config; ``arg`` = ``'<position_encoding>[,smoke][,linear_sink]'``."""
    args = parse_config_arg(arg, "configs/lm_tiny.py", encoding=(lm.POSITION_ENCODINGS, "goat"),
                            size=(("smoke",), None), sink=(("linear_sink",), None))
    if args["sink"] and args["encoding"] != "goat":
        raise ValueError(f"configs/lm_tiny.py: 'linear_sink' is an option of GOAT's sink; drop it "
                         f"or use the encoding 'goat' (got {args['encoding']!r}).")
    smoke, encoding = args["size"] == "smoke", args["encoding"]
    c = ml_collections.ConfigDict()
    c.task = "lm"  # next-token prediction (goat_jax.train.tasks)
    c.seq_len = 128  # training context (bytes)

    c.num_train_steps = 600  # ~3 min on 2 CPU cores
    c.global_batch_size = 16  # sequences per step (2k tokens)
    c.log_every_steps = 10  # metrics.jsonl / TensorBoard cadence
    c.eval_every_steps = 200  # held-out loss cadence (0: never)
    c.checkpoint_every_steps = 200  # checkpoint cadence (also at the end and on SIGTERM)
    c.keep_checkpoints = 2  # keep the newest N checkpoints

    c.optimizer = ml_collections.ConfigDict()
    c.optimizer.learning_rate = 3e-3  # peak; small models take large steps
    c.optimizer.warmup_steps = 50  # linear warmup
    c.optimizer.min_lr_ratio = 0.1  # cosine floor as a fraction of the peak

    c.model = ml_collections.ConfigDict()
    c.model.vocab_size = 259  # byte tokenizer: 256 bytes + pad/BOS/EOS
    c.model.num_layers = 2  # decoder blocks
    c.model.embed_dim = 128  # residual width
    c.model.num_heads = 4  # query heads (head_dim 32)
    c.model.kv_num_heads = 2  # GQA: two query heads per KV head
    c.model.head_dim = config_dict.placeholder(int)  # None: embed_dim // num_heads
    c.model.mlp_dim = 384  # SwiGLU hidden
    c.model.position_encoding = encoding  # 'goat' | 'rope' | 'nope' | ... (the config argument)
    c.model.tie_embeddings = True  # output projection = input embedding
    c.model.max_len = 1024  # table size for 'learned' / 'naive_prior'
    c.model.training_seq_len = c.get_oneway_ref("seq_len")  # GOAT sink normalization / PI scale (seq_len unless set)
    c.model.rope_base = 10_000.0  # RoPE frequency base
    c.model.pos_rank = 4  # GOAT relative Fourier rank R (2R of the 32 head dims)
    c.model.abs_rank = 4  # GOAT absolute rank M of the sink MLP
    c.model.prior_init = "seeded"  # ALiBi-like start
    c.model.prior_gate = "none"  # no query-norm gate
    c.model.enable_key_bias = True  # learned sink u(j)
    c.model.sink_extrapolation = "linear" if args["sink"] else "official"  # sink MLP past seq_len
    c.model.learn_frequencies = False  # GOAT's Fourier frequencies fixed (True: learned, docs/layer.md)
    c.model.logn_scaling = config_dict.placeholder(str)  # None; 'content' | 'all': log-n past seq_len
    c.model.norm_eps = 1e-6  # RMSNorm epsilon
    c.model.dtype = "float32"  # compute dtype (CPU: float32)
    c.model.param_dtype = "float32"  # parameter dtype
    c.model.remat = False  # no rematerialization needed at this size
    c.model.scan_layers = False  # two layers: unrolled
    c.model.implementation = config_dict.placeholder(str)  # attention kernel; None: auto (XLA on CPU)

    c.data = text.default_data_config()  # Jargon File, byte tokenizer
    c.data.num_eval_batches = 8  # 8 x 16 x 128 = 16k held-out bytes
    c.data.read_threads = 1  # 2-core machine

    if smoke:  # seconds per run: engine tests (resume, sharding, config errors)
        c.seq_len = 64
        c.num_train_steps = 20
        c.global_batch_size = 8
        c.log_every_steps = 1
        c.eval_every_steps = 0
        c.checkpoint_every_steps = 5
        c.optimizer.warmup_steps = 5
        c.model.num_layers = 1
        c.model.embed_dim = 64
        c.model.mlp_dim = 128
        c.model.pos_rank = 2
        c.model.abs_rank = 2
        c.data.num_eval_batches = 2
    return c
