"""125M GOAT language model on C4: the official GOAT C4 recipe, or our Llama-style variant.

    python -m experiments.train --config configs/lm_c4_125m.py[:rope] --workdir runs/c4_125m
    python -m experiments.train --config configs/lm_c4_125m.py:goat,llama --workdir runs/c4_llama

Argument ``'[<position_encoding>][,official|llama]'`` (default ``goat,official``).

'official' is the official ``train_c4.py`` recipe (docs/protocols.md, C4 125M): GPT-2 block
(LayerNorm eps 1e-5, GELU(tanh) MLP 3072, biases, tied embeddings, no position embedding for
GOAT), 12 layers x 768 x 12 heads, N(0, 0.02) init, GOAT R = M = 4 with the sink MLP drawn
N(0, 1e-3), GPT-2 BPE with every 2048-token window starting with BOS, AdamW peak 1e-4 / min
3e-5 / 2000 warmup / cosine, 128 x 2048 tokens per step for 4B tokens, weight decay 0.1 with the
official grouping, seed 1337 (+33 for GOAT), evaluation every 2000 steps on 50 batches. Where
this config differs from the script, the field's comment says so ("ours:"); the known
differences are: C4 is read from TFDS with a full per-epoch shuffle (the script streams
``allenai/c4`` with a 10k shuffle buffer), and our warmup reaches the peak one update earlier
(lr(k) = peak (k + 1) / 2000 for the 0-based update k). The attention projections (GOAT's
included) are drawn N(0, 0.02) like every other Linear (``model.attention_init_std``); the
script's re-draw of the sink MLP at N(0, 1e-3) is what our seeded prior init draws at
``init_scale_prior`` 1e-3 (both kernels N(0, 1e-3), biases 0).

'llama' is ours (no official script): RMSNorm + SwiGLU 2560, no biases, R = M = 8, a 32k
SentencePiece vocabulary trained on C4, GPT-3-small optimization (6e-4, 0.5M tokens per step).

GPT-2 vocabulary files are never downloaded at run time: set ``data.bpe_ranks_path`` (see
``goat_jax.data.tokenizers.write_bpe_ranks``) or ``data.tiktoken_cache_dir``. C4 is read with
TFDS (``c4/en``) prepared as array_record in ``data.tfds_data_dir``
(``tfds build c4/en --file_format=array_record``).

Parameters, official (all counted, tied embedding once, GOAT prior included): 12 x (4 x 768^2 +
4 x 768 attention biases + 2 x 768 x 3072 + 3072 + 768 MLP + 4 x 768 LayerNorms) + 50257 x 768
+ 2 x 768 = 123.65M (GPT-2 small without its 1024 x 768 position table). Llama variant:
12 x (4 x 768^2 + 3 x 768 x 2560 + 2 x 768) + 32000 x 768 + 768 ~= 123.7M (mlp_dim 2560 rather
than 8/3 x 768 brings it to the "125M" class).
"""

import ml_collections
from ml_collections import config_dict

from goat_jax.config.args import parse_config_arg
from goat_jax.data import text
from goat_jax.models import lm

OFFICIAL_SEED = 1337  # train_c4.py's seed; GOAT runs add 33
GOAT_SEED_OFFSET = 33
OFFICIAL_TOKENS = 4_000_000_000  # the official token budget
OFFICIAL_BATCH = 128  # sequences per step (2 per GPU x 8 accumulation x 8 GPUs)


def get_config(arg: str = "goat") -> ml_collections.ConfigDict:
    """The 125M C4 config; ``arg`` names the position encoding and the variant."""
    parsed = parse_config_arg(arg, "configs/lm_c4_125m.py",
                              encoding=(lm.POSITION_ENCODINGS, "goat"),
                              variant=(("official", "llama"), "official"))
    encoding, official = parsed["encoding"], parsed["variant"] == "official"
    c = ml_collections.ConfigDict()
    c.task = "lm"  # next-token prediction
    c.seq_len = 2048  # training context (tokens)

    c.optimizer = ml_collections.ConfigDict()

    c.model = ml_collections.ConfigDict()
    c.model.num_layers = 12  # decoder blocks
    c.model.embed_dim = 768  # residual width
    c.model.num_heads = 12  # query heads (head_dim 64)
    c.model.kv_num_heads = 12  # full multi-head attention
    c.model.head_dim = config_dict.placeholder(int)  # None: 768 / 12 = 64
    c.model.position_encoding = encoding  # the config argument
    c.model.tie_embeddings = True  # output projection = input embedding
    c.model.max_len = 32_768  # table size for 'learned' / 'naive_prior' (16x extrapolation)
    c.model.training_seq_len = c.get_oneway_ref("seq_len")  # GOAT sink normalization / PI scale (seq_len unless set)
    c.model.rope_base = 10_000.0  # RoPE base
    c.model.prior_init = "seeded"  # ALiBi-like start (the official module's default)
    c.model.prior_gate = "none"  # no query-norm gate (the official module's default)
    c.model.enable_key_bias = True  # learned sink u(j)
    c.model.init_scale_prior = 1e-3  # sink MLP kernels drawn N(0, 1e-3) (official re-draw)
    c.model.dtype = "bfloat16"  # compute dtype (flash kernels need bf16/fp16)
    c.model.param_dtype = "float32"  # master weights
    c.model.remat = False  # 125M at 2048 fits without rematerialization on 16 GB+
    c.model.scan_layers = True  # one compiled block for 12 layers
    c.model.implementation = config_dict.placeholder(str)  # None: cuDNN on GPU, splash on TPU
    c.model.init_std = 0.02  # N(0, 0.02) embeddings and MLP kernels

    c.data = text.default_data_config()  # defaults: goat_jax.data.text; overrides below
    c.data.source = "tfds"  # array_record-prepared TFDS (ours: the script streams allenai/c4)
    c.data.tfds_name = "c4/en"  # C4 English
    c.data.tfds_data_dir = ""  # '' = TFDS default (~/tensorflow_datasets)
    c.data.tfds_train_split = "train"  # 365M documents
    c.data.tfds_eval_split = "validation"  # 365k documents
    c.data.read_threads = 16  # tokenizing threads per host

    if official:
        c.seed = OFFICIAL_SEED + (GOAT_SEED_OFFSET if encoding == "goat" else 0)  # 1337 (+33 GOAT)
        c.global_batch_size = OFFICIAL_BATCH  # 128 x 2048 = 262k tokens per step
        c.grad_accum_steps = 8  # the script's 8 microbatches per step (2 sequences per GPU on 8)
        c.num_train_steps = -(-OFFICIAL_TOKENS // (OFFICIAL_BATCH * 2048))  # 15,259: 4B tokens
        c.eval_every_steps = 2000  # official cadence
        c.checkpoint_every_steps = 2000  # with every evaluation (ours)
        c.optimizer.learning_rate = 1e-4  # official peak
        c.optimizer.warmup_steps = 2000  # official linear warmup
        c.optimizer.min_lr_ratio = 0.3  # official floor 3e-5 = 0.3 x 1e-4, cosine
        c.optimizer.decay_grouping = "official_c4"  # decay all but .bias/ln/norm/lambda_/key_bias
        c.model.block = "gpt2"  # LayerNorm + GELU(tanh) MLP
        c.model.vocab_size = 50_257  # GPT-2 BPE, <|endoftext|> = 50256
        c.model.mlp_dim = 3072  # 4 x 768
        c.model.use_bias = True  # biases in every Linear
        c.model.attention_init_std = 0.02  # q/k/v/out kernels N(0, 0.02), as every Linear
        c.model.norm_eps = 1e-5  # LayerNorm epsilon
        c.model.pos_rank = 4  # GOAT relative rank R (official C4)
        c.model.abs_rank = 4  # GOAT absolute rank M (official C4)
        c.data.tokenizer = "gpt2"  # GPT-2 BPE through tiktoken, local vocabulary files only
        c.data.bpe_ranks_path = ""  # set to a gpt2.tiktoken file (tokenizers.write_bpe_ranks)
        c.data.tiktoken_cache_dir = ""  # or to a tiktoken cache holding the gpt2 files
        c.data.bos_windows = True  # position 0 of every window is BOS (= EOS); docs end with EOS
        c.data.num_eval_batches = 50  # official: 50 evaluation batches
    else:
        c.seed = 0  # init and data order (ours)
        c.global_batch_size = 256  # ours: 256 x 2048 = 0.5M tokens per step (GPT-3 small)
        c.grad_accum_steps = 1  # raise if a microbatch does not fit
        c.num_train_steps = 20_000  # ours: 20k x 0.5M = 10.5B tokens (~80 tokens / parameter)
        c.eval_every_steps = 1000  # held-out loss cadence (ours)
        c.checkpoint_every_steps = 1000  # checkpoint cadence (ours)
        c.optimizer.learning_rate = 6e-4  # ours: GPT-3 small peak
        c.optimizer.warmup_steps = 1000  # ours: linear warmup
        c.optimizer.min_lr_ratio = 0.1  # ours: cosine floor
        c.optimizer.decay_grouping = "default"  # ours: no decay on biases, norms, 1-D, GOAT prior
        c.model.block = "llama"  # RMSNorm + SwiGLU
        c.model.vocab_size = 32_000  # = data.spm_vocab_size
        c.model.mlp_dim = 2560  # SwiGLU hidden (see the module docstring)
        c.model.use_bias = False  # Llama: no biases
        c.model.attention_init_std = None  # ours: Xavier-uniform projections (the module's own)
        c.model.norm_eps = 1e-6  # RMSNorm epsilon
        c.model.pos_rank = 8  # GOAT relative rank R (the official module's default)
        c.model.abs_rank = 8  # GOAT absolute rank M (the official module's default)
        c.data.tokenizer = "sentencepiece"  # ours: 32k unigram, byte fallback
        c.data.spm_model_path = "runs/tokenizers/c4_en_32k.model"  # trained here on first use
        c.data.spm_vocab_size = 32_000  # = model.vocab_size
        c.data.spm_train_max_sentences = 2_000_000  # lines of C4 train used for SentencePiece
        c.data.num_eval_batches = 20  # ours: 20 x 256 x 2048 = 10.5M held-out tokens
    return c
