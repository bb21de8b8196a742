"""125M-parameter GOAT language model on C4 (paper: 125M on C4, trained at 2048 tokens).

    python -m experiments.train --config configs/lm_c4_125m.py[:rope] --workdir runs/c4_125m

C4 is read with TFDS (``c4/en``), which must already be prepared as array_record in
``data.tfds_data_dir`` (``tfds build c4/en --file_format=array_record``): the run never
downloads. The 32k SentencePiece model is trained on the first lines of the training split
the first time and saved at ``data.spm_model_path``. The argument names the position encoding.

Parameters (all counted, token embedding once since tied, GOAT prior included): 12 x (4 x 768^2
attention + 3 x 768 x 2560 SwiGLU) + 32000 x 768 embedding ~= 123.7M, the GPT-3 "125M"
class. mlp_dim 2560 (rather than Llama's 8/3 x 768 = 2048) brings the count to ~125M with a
32k vocabulary.
"""

import ml_collections
from ml_collections import config_dict

from goat_jax.config_args import parse_config_arg
from goat_jax.data import text
from goat_jax.models import lm
from goat_jax.train import sharding


def get_config(arg: str = "goat") -> ml_collections.ConfigDict:
    """The 125M C4 config; ``arg`` is the position encoding."""
    encoding = parse_config_arg(arg, "configs/lm_c4_125m.py",
                                encoding=(lm.POSITION_ENCODINGS, "goat"))["encoding"]
    c = ml_collections.ConfigDict()
    c.task = "lm"  # next-token prediction
    c.seed = 0  # init and data order
    c.seq_len = 2048  # training context (tokens)

    c.num_train_steps = 20_000  # 20k x 0.5M = 10.5B tokens (~80 tokens / parameter)
    c.global_batch_size = 256  # sequences per step: 256 x 2048 = 0.5M tokens (GPT-3 small)
    c.per_device_batch_size = config_dict.placeholder(int)  # alternative to global_batch_size
    c.grad_accum_steps = 1  # raise if a microbatch does not fit
    c.log_every_steps = 50  # metrics cadence
    c.eval_every_steps = 1000  # held-out loss cadence
    c.checkpoint_every_steps = 1000  # checkpoint cadence (also at the end and on SIGTERM)
    c.keep_checkpoints = 3  # newest N kept
    c.progress_bar = True  # tqdm bar on stderr
    c.peak_flops_per_device = 0.0  # for MFU; 0: look up by device kind
    c.distributed = False  # True on multi-host pods / clusters

    c.mesh = ml_collections.ConfigDict()
    c.mesh.data = -1  # data parallel over all devices (125M fits replicated)
    c.mesh.fsdp = 1  # parameter shards
    c.mesh.tensor = 1  # tensor-parallel shards
    c.sharding_rules = sharding.DEFAULT_RULES  # logical axis -> mesh axis (goat_jax/train/sharding.py)

    c.optimizer = ml_collections.ConfigDict()
    c.optimizer.learning_rate = 6e-4  # GPT-3 small peak
    c.optimizer.warmup_steps = 1000  # linear warmup
    c.optimizer.min_lr_ratio = 0.1  # cosine floor
    c.optimizer.b1 = 0.9  # Adam first moment
    c.optimizer.b2 = 0.95  # Adam second moment
    c.optimizer.eps = 1e-8  # Adam epsilon
    c.optimizer.weight_decay = 0.1  # decoupled; not on biases, norms, 1-D or GOAT prior params
    c.optimizer.grad_clip = 1.0  # global-norm clip

    c.model = ml_collections.ConfigDict()
    c.model.name = "lm"  # goat_jax.models registry
    c.model.vocab_size = 32_000  # = data.spm_vocab_size
    c.model.num_layers = 12  # decoder blocks
    c.model.embed_dim = 768  # residual width
    c.model.num_heads = 12  # query heads (head_dim 64)
    c.model.kv_num_heads = 12  # full multi-head attention
    c.model.head_dim = config_dict.placeholder(int)  # None: 768 / 12 = 64
    c.model.mlp_dim = 2560  # SwiGLU hidden (see the module docstring)
    c.model.position_encoding = encoding  # the config argument
    c.model.tie_embeddings = True  # output projection = input embedding
    c.model.max_len = 32_768  # table size for 'learned' / 'naive_prior' (16x extrapolation)
    c.model.training_seq_len = c.get_ref("seq_len")  # GOAT sink normalization / PI scale
    c.model.rope_base = 10_000.0  # RoPE base
    c.model.pos_rank = 8  # GOAT relative rank R (official default)
    c.model.abs_rank = 8  # GOAT absolute rank M (official default)
    c.model.prior_init = "seeded"  # ALiBi-like start
    c.model.prior_gate = "none"  # no query-norm gate
    c.model.enable_key_bias = True  # learned sink u(j)
    c.model.norm_eps = 1e-6  # RMSNorm epsilon
    c.model.dtype = "bfloat16"  # compute dtype (flash kernels need bf16/fp16)
    c.model.param_dtype = "float32"  # master weights
    c.model.remat = False  # 125M at 2048 fits without rematerialization on 16 GB+
    c.model.scan_layers = True  # one compiled block for 12 layers
    c.model.implementation = config_dict.placeholder(str)  # None: cuDNN on GPU, splash on TPU

    c.data = text.default_data_config()  # defaults: goat_jax.data.text; overrides below
    c.data.source = "tfds"  # array_record-prepared TFDS
    c.data.tfds_name = "c4/en"  # C4 English
    c.data.tfds_data_dir = ""  # '' = TFDS default (~/tensorflow_datasets)
    c.data.tfds_train_split = "train"  # 365M documents
    c.data.tfds_eval_split = "validation"  # 365k documents
    c.data.tokenizer = "sentencepiece"  # 32k unigram, byte fallback
    c.data.spm_model_path = "runs/tokenizers/c4_en_32k.model"  # trained here on first use
    c.data.spm_vocab_size = 32_000  # = model.vocab_size
    c.data.spm_train_max_sentences = 2_000_000  # lines of C4 train used for SentencePiece
    c.data.num_eval_batches = 20  # 20 x 256 x 2048 = 10.5M held-out tokens
    c.data.read_threads = 16  # tokenizing threads per host
    return c
