"""The genome GPT of configs/dna_hg38.py at 131,072 bases per window, context-parallel (issue #34).

    python -m experiments.train --config configs/dna_long.py:goat \
        --config.data.paths=/data/hg38.fa --workdir runs/dna_long
    python -m experiments.train --config configs/dna_long.py:rope \
        --config.data.paths=/data/hg38.fa --workdir runs/dna_long_rope
    python -m experiments.compile --config configs/dna_long.py:goat --target v5p-16 \
        --out runs/aot/dna_long_goat_v5p16        # does it fit? (docs/aot.md, benchmarks/context.md:
                                                  # compile times, splash vs flash, the batch per host)

The argument names the position encoding (default 'goat'; any of
goat_jax.models.lm.POSITION_ENCODINGS). The model, optimizer and hg38 FASTA split are
configs/dna_hg38.py's ``<encoding>,fasta`` (the 6kbp parquet rows are too short for a 131k window,
so the source is always a FASTA: hg38 with its ``.fai``, or any FASTA with
``--config.data.paths=... --config.data.train_records=... --config.data.valid_records=...``).
What long context changes, and why:

* ``seq_len`` 131,072 bases, the engine's ceiling when this config was made (``MAX_POSITION``
  was 2**17; it is 2**24 since the phases became exact, goat_jax/prior/positions.py);
  ``model.training_seq_len`` follows it (GOAT's sink normalization
  and RoPE's PI scale are the training length), ``model.max_len`` too (the tables of 'learned' /
  'naive_prior' must hold the window).
* the sequence is split over the devices: ``mesh.context=-1`` (all devices), ``mesh.data=1``;
  attention runs with queries sharded and keys/values all-gathered (goat_jax/kernels/all_gather.py), and
  ``context_load_balance=True`` (the LM is causal: dual-chunk-swap order, every shard the same
  work). On 8 chips a device holds 16,384 bases of each window. Trade context for data with
  e.g. ``--config.mesh.context=4 --config.mesh.data=-1`` (the batch must stay divisible by the
  data axes). seq_len must be a multiple of 2 x context x 128 (splash's blocks) on TPU.
* ``global_batch_size`` 8 windows (the recipe's 8 sequences; 1,048,576 bases per step): any data
  axis of 1, 2, 4 or 8 divides it. Hosts of one context group read the same windows
  (goat_jax/train/sharding.py, batch_groups), so the batch need not divide the host count.
* ``model.remat=True`` (each block recomputed in the backward pass), bf16 compute as the recipe.
* FASTA crops tile the genome (``fasta_stride=0``: one crop per 131,073 bases per epoch; the
  recipe's 6,000-base stride would repeat each base ~22 times), and eval reads 8 batches
  (8 x 8 x 131,072 = 8.4M held-out bases of chr21).

A CPU smoke on 8 fake devices (seconds per step; any FASTA, here pyfaidx's 40 kb hg19 piece):

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m experiments.train \
        --config configs/dna_long.py:goat --workdir /tmp/dna_long_smoke \
        --config.seq_len=1024 --config.mesh.context=4 --config.mesh.data=-1 \
        --config.num_train_steps=2 --config.eval_every_steps=0 --config.model.dtype=float32 \
        --config.data.paths=/usr/share/doc/python-pyfaidx-examples/examples/chr17.hg19.part.fa \
        --config.data.train_records='chr17:1-30000' --config.data.valid_records='chr17:30001-40000' \
        --config.data.test_records='' --config.data.num_eval_batches=1 --config.data.read_threads=1
"""

import ml_collections

from configs import dna_hg38
from goat_jax.config.args import parse_config_arg
from goat_jax.models import lm

LONG_SEQ_LEN = 131_072  # bases per training window


def get_config(arg: str = "goat") -> ml_collections.ConfigDict:
    """The long-window hg38 config; ``arg`` = ``'<position_encoding>'``."""
    args = parse_config_arg(arg, "configs/dna_long.py", encoding=(lm.POSITION_ENCODINGS, "goat"))
    c = dna_hg38.get_config(f"{args['encoding']},fasta")  # the recipe on an hg38 FASTA
    c.seq_len = LONG_SEQ_LEN  # 131,072 bases; model.training_seq_len follows (dna_hg38 made it a reference)
    c.global_batch_size = 8  # 8 windows = 1,048,576 bases per step; data axes 1/2/4/8 divide it
    c.context_load_balance = True  # causal LM: dual-chunk swap, every context shard the same work

    c.mesh = ml_collections.ConfigDict()
    c.mesh.data = 1  # no data parallelism by default: every device holds a piece of each window
    c.mesh.fsdp = 1  # 25.2M parameters: replicated
    c.mesh.context = -1  # the window over all devices (8 chips: 16,384 bases each)
    c.mesh.tensor = 1  # 8 heads of 64: no head split

    c.model.max_len = c.get_oneway_ref("seq_len")  # 'learned' / 'naive_prior' table size: the window unless set
    c.model.dtype = "bfloat16"  # bf16 compute, as the recipe
    c.model.remat = True  # activations of 131k bases: recompute each block in the backward pass

    c.data.fasta_stride = 0  # crops tile the genome: one crop per 131,073 bases per epoch
    c.data.num_eval_batches = 8  # 8 x 8 x 131,072 = 8.4M held-out bases per eval (chr21: 46.7M)
    return c
