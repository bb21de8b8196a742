"""The genome GPT of configs/dna_hg38.py at 1,048,576 bases per window (Evo 2's context), with
ring attention over the ``context`` axis (issue #49).

    python -m experiments.compile --config configs/dna_1m.py:goat --target v5p-128 \
        --out runs/aot/dna_1m_goat_v5p128        # does it fit? (benchmarks/context.md)
    python -m experiments.train --config configs/dna_1m.py:goat \
        --config.data.paths=/data/hg38.fa --workdir runs/dna_1m

The argument names the position encoding (default 'goat'; any encoding that packs into q/k:
'goat', 'rope', 'alibi_packed', ..., not the materialized biases, which cannot travel around a
ring). Everything else is configs/dna_long.py's (the hg38 FASTA split, the recipe's model and
optimizer, remat, bf16, load-balanced context parallelism over all devices), and what a
million-base window changes, and why:

* ``seq_len`` 1,048,576 bases (``MAX_POSITION`` is 2**24 since the prior's and RoPE's phases are
  exact at any position: goat_jax/prior/angles.py); ``model.training_seq_len`` and
  ``model.max_len`` follow it.
* ``context_strategy='ring'``: keys and values pass around the context axis (goat_jax/kernels/ring.py),
  so a device holds two blocks of ``T / c`` keys, not the whole window: with all-gather the
  gathered K/V alone would be 2.03 GiB per window per layer on every device (benchmarks/context.md).
  Each block pair runs on the platform's fused kernel (``model.implementation`` None: the
  automatic choice under ring is splash blocks on a TPU, cuDNN blocks on a GPU, the flash
  kernel's block loops on CPU; goat_jax/kernels/ring_blocks.py).
* ``seq_len`` must be a multiple of ``2 x mesh.context`` (load balancing); on v5p-128 (64 chips)
  a device holds 16,384 bases of the window.
* ``global_batch_size`` 1 window per step (1,048,576 bases), ``mesh.data = 1``: every device
  holds a piece of the one window. ``model.scan_layers`` compiles one layer body.
* eval reads 2 batches (2 x 1,048,576 held-out bases of chr21).
"""

import ml_collections

from configs import dna_long
from goat_jax.config.args import parse_config_arg
from goat_jax.models import lm

WINDOW = 1_048_576  # bases per training window (2**20)


def get_config(arg: str = "goat") -> ml_collections.ConfigDict:
    """The million-base hg38 config; ``arg`` = ``'<position_encoding>'``."""
    args = parse_config_arg(arg, "configs/dna_1m.py", encoding=(lm.POSITION_ENCODINGS, "goat"))
    c = dna_long.get_config(args["encoding"])
    c.seq_len = WINDOW  # 1,048,576 bases; model.training_seq_len / max_len follow (dna_long links them)
    c.global_batch_size = 1  # one window per step: 1,048,576 bases
    c.context_strategy = "ring"  # K/V around the ring: per-device K/V memory O(T / c), not O(T)
    c.context_load_balance = True  # causal: dual-chunk swap, every shard the same work per ring step
    c.mesh.data = 1  # every device holds a piece of the one window
    c.mesh.context = -1  # the window over all devices (v5p-128, 64 chips: 16,384 bases each)
    c.model.scan_layers = True  # one layer body to compile (8 layers)
    c.data.num_eval_batches = 2  # 2 x 1,048,576 held-out bases per eval
    return c
