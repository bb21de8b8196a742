"""The official GOAT genome recipe: a 25.2M GPT on the human reference genome (paper section 6).

    python -m experiments.train --config configs/dna_hg38.py:goat \
        --config.data.paths='/data/hg38_6kbp/*.parquet' --workdir runs/dna_hg38
    python -m experiments.train --config configs/dna_hg38.py:rope,fasta \
        --config.data.paths=/data/hg38.fa --workdir runs/dna_hg38_rope

The argument is ``<position_encoding>[,fasta]``. Default data: the parquet chunks of the
``InstaDeepAI/human_reference_genome`` dataset, config ``6kbp`` (6,200-base rows, 100 shared with
each neighbour; columns ``sequence`` and ``chromosome``): each sample is 1,025 bases at a uniform
offset in [0, 200] of a row, as in the official ``genome.py``. With ``,fasta`` it reads an hg38
FASTA instead (``chr1``..``chr22``, ``chrX``, ``chrY``; index it once with ``samtools faidx`` so
it is read a slice at a time), with the same crops drawn from 6,000-base chunks.

Recipe (docs/protocols.md, DNA): GPT pre-LN (LayerNorm 1e-5, GELU(tanh) MLP 4x, biases, tied
embeddings), d 512, 8 layers, 8 heads, vocab 5 ("ACGNT"); GOAT R = 2, M = 8, seeded,
training_seq_len 1024; RoPE base 1e4 over the full head; AdamW 3e-4, weight decay 0.1, 100 warmup
steps, cosine to 0 at 1,000 steps, clip 1, batch 8 x 1024, bf16, eval every 200 steps.

Choices where the recipe is silent or the engine differs, said here:
* validation / test chromosomes: 21 / 22 (the official split is not recorded). The dataset's
  ``chromosome`` values must match: an unknown name is an error that lists the ones present.
* Adam betas / eps: PyTorch AdamW defaults (0.9, 0.999, 1e-8), the recipe names none.
* early stopping after 5 evals without improvement is not implemented; with eval every 200 of
  1,000 steps it could not trigger before the last step anyway.
"""

import ml_collections

from goat_jax.config.args import parse_config_arg
from goat_jax.data import dna
from goat_jax.models import lm
from goat_jax.tasks import dna as dna_task

# Autosomes and sex chromosomes: what the 6kbp dataset holds (no alts, unplaced or chrM).
HG38_CHROMOSOMES = [f"chr{i}" for i in range(1, 23)] + ["chrX", "chrY"]


def get_config(arg: str = "goat") -> ml_collections.ConfigDict:
    """The hg38 config; ``arg`` = ``'<position_encoding>[,fasta]'``."""
    args = parse_config_arg(arg, "configs/dna_hg38.py", encoding=(lm.POSITION_ENCODINGS, "goat"),
                            source=(("fasta",), None))
    use_fasta, encoding = args["source"] == "fasta", args["encoding"]
    c = ml_collections.ConfigDict()
    c.task = "dna"  # next-base prediction (goat_jax/tasks/dna.py)
    c.seq_len = 1024  # training context (bases); crops hold seq_len + 1

    c.num_train_steps = 1000  # official: cosine to 0 at 1,000 steps
    c.global_batch_size = 8  # official batch 8 x 1024
    c.log_every_steps = 10  # metrics cadence
    c.eval_every_steps = 200  # official eval cadence
    c.checkpoint_every_steps = 200  # checkpoint cadence (also at the end and on SIGTERM)
    c.keep_checkpoints = 2  # newest N kept

    c.optimizer = ml_collections.ConfigDict()
    c.optimizer.learning_rate = 3e-4  # official peak
    c.optimizer.warmup_steps = 100  # official linear warmup
    c.optimizer.min_lr_ratio = 0.0  # official: cosine to 0
    c.optimizer.b2 = 0.999  # PyTorch AdamW default
    c.optimizer.decay_grouping = "official_genome"  # official: decay on every parameter

    c.model = dna_task.official_model_config(encoding)  # 25.2M GPT, d 512, 8 layers, 8 heads
    c.model.training_seq_len = c.get_oneway_ref("seq_len")  # GOAT sink normalization = L (seq_len unless set)
    c.model.dtype = "bfloat16"  # official bf16 autocast
    c.model.remat = False  # 8 x 1024 fits easily

    c.data = dna.default_dna_data_config()  # then the hg38 source below
    if use_fasta:
        c.data.source = "fasta"  # an hg38 FASTA (plain/bgzip) with its .fai
        c.data.paths = ("hg38.fa",)  # set --config.data.paths to your file
        c.data.train_records = tuple(n for n in HG38_CHROMOSOMES if n not in ("chr21", "chr22"))  # the rest
        c.data.valid_records = ("chr21",)  # held out (our choice, see the module docstring)
        c.data.test_records = ("chr22",)  # held out for the final numbers
        c.data.fasta_stride = 6000  # chunk = 6,000 starts: one crop per 6 kb per epoch, as the rows
    else:
        c.data.source = "parquet"  # the human_reference_genome 6kbp chunks
        c.data.paths = ("human_reference_genome_6kbp/*.parquet",)  # set to your copy
        c.data.valid_records = ("21",)  # 'chromosome' values held out (our choice)
        c.data.test_records = ("22",)  # held out for the final numbers
        c.data.max_offset = 200  # official: offset uniform in [0, 200]
    c.data.eval_offsets = "hashed"  # official: fixed hashed eval offsets
    c.data.short_records = "skip"  # chromosome-end rows shorter than 1,025 bases: skipped, logged
    c.data.num_eval_batches = 50  # 50 x 8 x 1024 = 410k held-out bases per eval
    c.data.read_threads = 4  # reader threads
    return c

