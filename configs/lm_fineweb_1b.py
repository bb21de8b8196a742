"""1.23B-parameter GOAT language model on FineWeb: the Llama 3.2 1B shape (paper: 1.23B
Llama-style on FineWeb at 2048 tokens; perplexity at 2k-16k).

    python -m experiments.train --config configs/lm_fineweb_1b.py[:rope] --workdir runs/fw_1b

FineWeb is read from parquet files (``data.paths``, e.g. a ``sample/10BT`` or ``100BT``
download of HuggingFaceFW/fineweb; the ``text`` column). Llama 3's tiktoken vocabulary is not
available in this codebase, so a SentencePiece model of the same size (128256) is trained on the
first lines of the training files and saved at ``data.spm_model_path``: the shapes and parameter
count match Llama 3.2 1B, the token boundaries do not.

There is no official FineWeb script (docs/protocols.md, Length extrapolation): the paper gives the
model shape, the data and the training length only. Every other choice here -- optimization,
batch, token budget, tokenizer, GOAT ranks, evaluation -- is ours.

Parameters: 16 x (2048^2 x 2 [q, o] + 2048 x 512 x 2 [k, v] + 3 x 2048 x 8192 [SwiGLU] + 2 x 2048
[norms]) + 128256 x 2048 [tied embedding] + 2048 [final norm] + GOAT prior ~= 1.2359B.
"""

import ml_collections
from ml_collections import config_dict

from goat_jax.config.args import parse_config_arg
from goat_jax.data import text
from goat_jax.models import lm


def get_config(arg: str = "goat") -> ml_collections.ConfigDict:
    """The 1.23B FineWeb config; ``arg`` is the position encoding."""
    encoding = parse_config_arg(arg, "configs/lm_fineweb_1b.py",
                                encoding=(lm.POSITION_ENCODINGS, "goat"))["encoding"]
    c = ml_collections.ConfigDict()
    c.task = "lm"  # next-token prediction
    c.seq_len = 2048  # training context (tokens)

    c.num_train_steps = 24_000  # 24k x 1M = 25B tokens (~20 tokens / parameter, Chinchilla)
    c.global_batch_size = 512  # sequences per step: 512 x 2048 = 1M tokens

    c.mesh = ml_collections.ConfigDict()
    c.mesh.data = 1  # pure data-parallel replicas
    c.mesh.fsdp = -1  # FSDP over all devices: 1.23B params + Adam do not fit replicated

    c.optimizer = ml_collections.ConfigDict()
    c.optimizer.learning_rate = 3e-4  # Llama-style 1B peak
    c.optimizer.warmup_steps = 2000  # linear warmup

    c.model = ml_collections.ConfigDict()
    c.model.vocab_size = 128_256  # Llama 3 vocabulary size (= data.spm_vocab_size)
    c.model.num_layers = 16  # Llama 3.2 1B
    c.model.embed_dim = 2048  # Llama 3.2 1B
    c.model.num_heads = 32  # query heads (head_dim 64)
    c.model.kv_num_heads = 8  # GQA, 4 query heads per KV head
    c.model.head_dim = config_dict.placeholder(int)  # None: 2048 / 32 = 64
    c.model.mlp_dim = 8192  # SwiGLU hidden
    c.model.position_encoding = encoding  # the config argument
    c.model.tie_embeddings = True  # Llama 3.2 1B ties input and output embeddings
    c.model.max_len = 32_768  # table size for 'learned' / 'naive_prior' (16x extrapolation)
    c.model.training_seq_len = c.get_oneway_ref("seq_len")  # GOAT sink normalization / PI scale (seq_len unless set)
    c.model.rope_base = 500_000.0  # Llama 3 RoPE base
    c.model.pos_rank = 8  # GOAT relative rank R (ours: the official module's default)
    c.model.abs_rank = 8  # GOAT absolute rank M (ours: the official module's default)
    c.model.prior_init = "seeded"  # ALiBi-like start
    c.model.prior_gate = "none"  # no query-norm gate
    c.model.enable_key_bias = True  # learned sink u(j)
    c.model.norm_eps = 1e-5  # Llama 3 RMSNorm epsilon
    c.model.dtype = "bfloat16"  # compute dtype (flash kernels need bf16/fp16)
    c.model.param_dtype = "float32"  # master weights
    c.model.remat = True  # recompute blocks in the backward pass: activations dominate at 1B
    c.model.scan_layers = True  # one compiled block for 16 layers
    c.model.implementation = config_dict.placeholder(str)  # None: cuDNN on GPU, splash on TPU

    c.data = text.default_data_config()  # defaults: goat_jax.data.text; overrides below
    c.data.source = "parquet"  # FineWeb parquet shards
    c.data.paths = ("data/fineweb/sample/100BT/*.parquet",)  # HuggingFaceFW/fineweb download
    c.data.eval_paths = ()  # empty: hold out eval_fraction of the row groups
    c.data.eval_fraction = 0.001  # ~0.1% of row groups held out (by content hash)
    c.data.text_key = "text"  # FineWeb text column
    # Our choice (no official FineWeb script exists): whole pages packed with segment ids, since
    # most pages are shorter than the 2048-token context (docs/packing.md, Which to use). On
    # H100/H200 the automatic kernel runs them on cuDNN's packed layout (goat_jax/kernels/
    # cudnn_packed.py; benchmarks/aot.md); older GPUs run 'flash'; TPUs splash.
    c.data.packing = "documents"  # our choice (above); "concat" is the alternative
    c.data.tokenizer = "sentencepiece"  # see the module docstring
    c.data.spm_model_path = "runs/tokenizers/fineweb_128k.model"  # trained here on first use
    c.data.spm_vocab_size = 128_256  # = model.vocab_size
    c.data.spm_train_max_sentences = 2_000_000  # lines used to train SentencePiece
    c.data.num_eval_batches = 10  # 10 x 512 x 2048 = 10.5M held-out tokens
    c.data.read_threads = 16  # reading + tokenizing threads per host
    return c
