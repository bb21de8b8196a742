"""Benchmarks the genome model's training step, GOAT vs RoPE; writes benchmarks/dna.md.

    python -m experiments.bench_dna [--out benchmarks/dna.md] [--lengths 1024,4096,16384]

1. Memory: XLA's ``memory_analysis()`` of the compiled training step (forward, backward, AdamW
   update) of the official genome GPT (configs/dna_hg38.py: d 512, 8 layers, 8 heads, bf16
   compute) at each length, with the batch set so every step holds the official 8 x 1024 = 8,192
   bases (at least one sequence). Arguments = parameters + Adam moments + batch; temporaries =
   activations and workspace. Compiling needs no execution, so every length is measured on any
   host. On a GPU, the device's peak bytes after running ``--timed_steps`` steps is added.
2. Throughput: training tokens/s of the same step, GOAT and RoPE alternating, median of
   ``--repeats``, at ``--timed_length`` (default 1024, the official L).

The measurement is goat_jax/reproduce/dna_bench.py (the DNA report section uses it too).
"""

from __future__ import annotations

from goat_jax import _extras
with _extras.imports(__name__):  # the 'train' extra: one line naming it if absent
    from absl import app
    from absl import flags

from goat_jax.reproduce import dna_bench

_OUT = flags.DEFINE_string("out", "benchmarks/dna.md", "Markdown file to write.")
_LENGTHS = flags.DEFINE_string("lengths", "1024,4096,16384", "Sequence lengths (memory).")
_TOKENS = flags.DEFINE_integer("tokens_per_step", dna_bench.OFFICIAL_TOKENS_PER_STEP,
                               "Bases per step (official 8 x 1024).")
_DTYPE = flags.DEFINE_string("dtype", "bfloat16", "Compute dtype (official: bfloat16).")
_TIMED_LENGTH = flags.DEFINE_integer("timed_length", 1024, "Length of the tokens/s measurement.")
_TIMED_STEPS = flags.DEFINE_integer("timed_steps", 5, "Measured steps per repeat.")
_IMPL = flags.DEFINE_string("implementation", "", "Attention kernel (model.implementation): '' = "
                            "auto (goat_jax.kernels: 'flash' on CPU above 16 MiB of logits, cuDNN on a "
                            "GPU in bf16), 'xla' for XLA's materialized attention.")
_TIMED_TOKENS = flags.DEFINE_integer("timed_tokens", 0, "Bases per step of the tokens/s "
                                     "measurement (0: --tokens_per_step; a CPU needs fewer).")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Alternating GOAT / RoPE repeats (median); 0: "
                                "memory only.")
_TIMED_DTYPE = flags.DEFINE_string("timed_dtype", "", "Compute dtype for tokens/s ('' = --dtype; "
                                   "CPUs emulate bfloat16 slowly, so float32 is fairer there).")


def main(argv):
    """Entry point: measures, writes ``--out`` and prints it."""
    del argv
    # The command line that made the table, as the table names it.
    command = (f"python -m experiments.bench_dna --lengths {_LENGTHS.value} --dtype {_DTYPE.value}"
               f"{' --timed_dtype ' + _TIMED_DTYPE.value if _TIMED_DTYPE.value else ''}"
               f"{' --timed_tokens %d' % _TIMED_TOKENS.value if _TIMED_TOKENS.value else ''}"
               f"{' --implementation ' + _IMPL.value if _IMPL.value else ''} --timed_steps "
               f"{_TIMED_STEPS.value} --repeats {_REPEATS.value}")
    text = dna_bench.run_benchmark(
        [int(x) for x in _LENGTHS.value.split(",") if x], dtype=_DTYPE.value, tokens_per_step=_TOKENS.value,
        implementation=_IMPL.value, timed_length=_TIMED_LENGTH.value, timed_steps=_TIMED_STEPS.value,
        timed_tokens=_TIMED_TOKENS.value, timed_dtype=_TIMED_DTYPE.value, repeats=_REPEATS.value,
        command=command)
    with open(_OUT.value, "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    from goat_jax import platforms  # pylint: disable=g-import-not-at-top
    platforms.avoid_libtpu_without_tpu()  # before any JAX backend starts (goat_jax/platforms.py)
    app.run(main)
