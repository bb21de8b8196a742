"""Toy copy mixture (paper Figure 1): a small causal GOAT LM whose prior learns a sink and a diagonal.

    python -m experiments.toy_prior                                # train + figure + summary
    python -m experiments.train --config configs/toy_copy_mixture.py --workdir runs/toy

Each token copies the first token (p = 0.5), copies the token at attention lag 1 (p = 0.3), or
is uniform noise over 16 symbols (goat_jax.data.synthetic.copy_mixture_batch). Which earlier
token is copied is fixed by position (the first one, or the one at lag 1), not by content, so
the learned log-prior should put a sink ``u(0)`` on the first key and a peak of ``kappa`` at lag 1. One layer with a
single head keeps that in one head (the figure's four panels); ``--config.model.num_heads=4
--config.model.kv_num_heads=4`` spreads it over heads (GOAT's prior is per KV head).

Argument: '' (default, ~40 s on 2 CPU cores) or 'smoke' (the test's shorter run).
"""

import ml_collections
from ml_collections import config_dict

from goat_jax.config.args import parse_config_arg
from goat_jax.data import synthetic


def get_config(arg: str = "") -> ml_collections.ConfigDict:
    """The toy config; ``arg`` = ``''`` or ``'smoke'``."""
    size = parse_config_arg(arg, "configs/toy_copy_mixture.py", size=(("smoke",), None))["size"]
    smoke = size == "smoke"
    c = ml_collections.ConfigDict()
    c.task = "lm"  # next-token prediction over the synthetic windows
    c.seq_len = 64  # tokens per window

    c.num_train_steps = 600  # ~30 s: the loss is within ~0.05 nats of the Bayes entropy
    c.global_batch_size = 32  # windows per step
    c.log_every_steps = 20  # metrics.jsonl cadence
    c.eval_every_steps = 300  # held-out loss cadence
    c.checkpoint_every_steps = 600  # only the final state is needed for the figure
    c.keep_checkpoints = 1  # newest only

    c.optimizer = ml_collections.ConfigDict()
    c.optimizer.learning_rate = 1e-2  # a 1-layer toy tolerates (and needs) a large step
    c.optimizer.warmup_steps = 20  # linear warmup
    c.optimizer.weight_decay = 0.0  # nothing to regularize in a 16-symbol toy

    c.model = ml_collections.ConfigDict()
    c.model.vocab_size = 16  # the copy-mixture symbols (no specials)
    c.model.num_layers = 1  # one attention layer: positions enter only through its prior
    c.model.embed_dim = 64  # residual width
    c.model.num_heads = 1  # one head, so the sink and the diagonal share one prior
    c.model.kv_num_heads = 1  # no GQA
    c.model.head_dim = config_dict.placeholder(int)  # None: embed_dim // num_heads = 64
    c.model.mlp_dim = 128  # SwiGLU hidden: decodes the mixture of the two copied tokens
    c.model.position_encoding = "goat"  # the learned prior is the object of study
    c.model.tie_embeddings = True  # output projection = input embedding
    c.model.max_len = 1024  # unused by GOAT (table encodings only)
    c.model.training_seq_len = c.get_oneway_ref("seq_len")  # sink MLP position normalization (seq_len unless set)
    c.model.rope_base = 10_000.0  # unused by GOAT
    c.model.pos_rank = 8  # R: enough Fourier terms for a sharp lag-1 peak over 64 lags
    c.model.abs_rank = 4  # M: sink MLP features
    c.model.prior_init = "uniform"  # flat start: whatever the figure shows was learned
    c.model.prior_gate = "none"  # no content gate: the prior alone is plotted
    c.model.enable_key_bias = True  # the learned sink u(j)
    c.model.norm_eps = 1e-6  # RMSNorm epsilon
    c.model.dtype = "float32"  # CPU
    c.model.param_dtype = "float32"  # CPU
    c.model.remat = False  # tiny
    c.model.scan_layers = False  # one layer
    c.model.implementation = config_dict.placeholder(str)  # None: XLA on CPU

    c.data = synthetic.default_synthetic_config("copy_mixture")  # vocab 16, lag 1
    # First-token copies are the most frequent rule. With the generator's defaults (0.25 / 0.5)
    # the sink settles at ~1 nat over the row median: copies of x_0 propagate down the lag
    # chain until half the tokens equal x_0, so averaging the past finds x_0 almost as well.
    c.data.p_first = 0.5  # copy the first token
    c.data.p_prev = 0.3  # copy the token at `lag` (the rest, 0.2, is noise)
    c.data.source = "synthetic"  # goat_jax.train.tasks: synthetic generators instead of text
    c.data.num_eval_batches = 4  # 4 x 32 x 64 = 8k held-out targets

    if smoke:  # the test: half the steps (both checks pass from ~250 steps), same model
        c.num_train_steps = 300
        c.eval_every_steps = 300
        c.checkpoint_every_steps = 300
        c.log_every_steps = 10
        c.progress_bar = False
    return c
