"""Tiny genome LM on E. coli K-12 MG1655 (Debian ``ragout-examples``): minutes on a 2-core CPU.

    python -m experiments.train --config configs/dna_tiny.py:goat --workdir runs/dna_tiny
    python -m experiments.train --config configs/dna_tiny.py:rope --workdir runs/dna_tiny_rope
    python -m experiments.evaluate --workdir runs/dna_tiny --evals dna \
        --fasta /usr/share/doc/ragout/examples/E.Coli/references/DH1.fasta.gz

The argument names the position encoding (default 'goat'; any of
goat_jax.models.lm.POSITION_ENCODINGS), optionally followed by ',smoke': a seconds-long variant
for tests, and/or ',long': the long-window protocol (512-base windows, 8,192 bases per step,
1500 steps; docs/protocols.md). The model is the official genome GPT (configs/dna_hg38.py) shrunk to 2 layers of
width 128 (GOAT keeps the official R = 2, M = 8); the genome's last 10% (463,968 bp) is held out
for validation. Everything else is identical across encodings.
"""

import ml_collections

from goat_jax.config.args import parse_config_arg
from goat_jax.data import dna
from goat_jax.models import lm
from goat_jax.tasks import dna as dna_task


def get_config(arg: str = "goat") -> ml_collections.ConfigDict:
    """The tiny DNA config; ``arg`` = ``'<position_encoding>[,long][,smoke]'``."""
    args = parse_config_arg(arg, "configs/dna_tiny.py", encoding=(lm.POSITION_ENCODINGS, "goat"),
                            size=(("smoke",), None), protocol=(("long",), None))
    smoke, long, encoding = args["size"] == "smoke", args["protocol"] == "long", args["encoding"]
    c = ml_collections.ConfigDict()
    c.task = "dna"  # next-base prediction (goat_jax/tasks/dna.py)
    c.seq_len = 256  # training context (bases)

    c.num_train_steps = 800  # 800 x 16 x 256 = 3.3M bases, ~0.8 epochs of the training 90%
    c.global_batch_size = 16  # crops per step
    c.log_every_steps = 20  # metrics cadence
    c.eval_every_steps = 200  # held-out cadence (0: never)
    c.checkpoint_every_steps = 200  # checkpoint cadence (also at the end and on SIGTERM)
    c.keep_checkpoints = 2  # newest N kept

    c.optimizer = ml_collections.ConfigDict()
    c.optimizer.learning_rate = 2e-3  # small models take large steps
    c.optimizer.warmup_steps = 50  # linear warmup
    c.optimizer.min_lr_ratio = 0.0  # cosine to 0, as the official recipe
    c.optimizer.b2 = 0.99  # Adam second moment

    c.model = dna_task.official_model_config(encoding)  # then shrunk:
    c.model.num_layers = 2  # official 8
    c.model.embed_dim = 128  # official 512
    c.model.num_heads = 4  # head dim 32 (GOAT: 5 prior dims, 27 content)
    c.model.mlp_dim = 512  # MLP 4x
    c.model.max_len = 4096  # table size for 'learned' / 'naive_prior' (up to 16x)
    c.model.training_seq_len = c.get_oneway_ref("seq_len")  # GOAT sink normalization = L (seq_len unless set)

    c.data = dna.default_dna_data_config()  # E. coli MG1655, last 10% held out
    c.data.num_eval_batches = 16  # 16 x 16 x 256 = 65k held-out bases per eval
    c.data.read_threads = 1  # 2-core machine

    if long:  # the long-window protocol (docs/protocols.md, "Tiny DNA protocol: long windows")
        # Half the official 1024-base window at the official 8,192 bases per step; 1500 steps
        # (12.3M bases, ~3 epochs of the training 90%) for a model clearly past the uniform guess.
        c.seq_len = 512
        c.global_batch_size = 16
        c.num_train_steps = 1500
        c.eval_every_steps = 500
        c.checkpoint_every_steps = 100  # a killed run loses at most 100 steps (minutes, not an hour)
        c.model.max_len = 8192  # up to 16x
        c.data.num_eval_batches = 8  # 8 x 16 x 512 = 65k held-out bases per eval
    if smoke:  # seconds per run: CLI and engine tests
        c.seq_len = 64
        c.num_train_steps = 10
        c.global_batch_size = 8
        c.log_every_steps = 1
        c.eval_every_steps = 5
        c.checkpoint_every_steps = 5
        c.optimizer.warmup_steps = 2
        c.model.num_layers = 1
        c.model.embed_dim = 64
        c.model.num_heads = 2
        c.model.mlp_dim = 128
        c.data.num_eval_batches = 2
    return c
