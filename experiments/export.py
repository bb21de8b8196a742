"""A trained LM run to the Hugging Face format, and back (docs/export.md).

    python -m experiments.export --workdir runs/tiny --out runs/tiny_hf
    python -m experiments.export --workdir runs/tiny --out runs/tiny_hf --step 400 --dtype bfloat16
    python -m experiments.export --from_hf runs/tiny_hf --workdir runs/tiny_again

The first form writes OUT: ``model.safetensors`` (PyTorch layout, ``{"format": "pt"}``; sharded
with an index past ``--max_shard_size``), ``config.json`` (``auto_map`` to the two modeling files),
``configuration_goat.py``, ``modeling_goat.py``, the run's tokenizer (``tokenizer.json``),
``generation_config.json`` and a ``README.md`` model card; ``transformers`` loads it with
``AutoModelForCausalLM.from_pretrained(OUT, trust_remote_code=True)``. The second makes a
goat-jax run (config.json + a checkpoint) of such a folder; float32 weights come back bit-equal.
Every check runs before anything is read or written; an existing non-empty OUT needs ``--overwrite``.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Optional

from goat_jax import cli


def main(argv: Optional[Sequence[str]] = None) -> str:
    """CLI entry point; returns the folder written (OUT, or the new workdir with --from_hf)."""
    from goat_jax.export import writer  # pylint: disable=g-import-not-at-top
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workdir", required=True, help="the run to export (or, with --from_hf, the new run to make)")
    p.add_argument("--out", default=None, help="the folder to write (export); not with --from_hf")
    p.add_argument("--from_hf", default=None, help="an exported folder to make a goat-jax run of, in --workdir")
    p.add_argument("--step", type=int, default=None, help="the checkpoint to export (default: the newest); "
                   "with --from_hf the step of the checkpoint made (default: the exported one)")
    p.add_argument("--dtype", default="float32", help=f"the stored weights' dtype, one of {writer.DTYPES} "
                   "(the prior's parameters stay float32)")
    p.add_argument("--max_shard_size", default=writer.DEFAULT_SHARD_SIZE,
                   help="one model.safetensors up to this size, shards with an index past it (e.g. 5GB, 200MB)")
    p.add_argument("--tokenizer", default="run", help="'run': write the run's tokenizer; 'none': no tokenizer files")
    p.add_argument("--overwrite", action="store_true", help="replace an existing, non-empty --out")
    args = p.parse_args(argv)
    if args.from_hf is not None:
        given = [f"--{n}" for n in ("out", "dtype", "max_shard_size", "tokenizer", "overwrite")
                 if getattr(args, n) != p.get_default(n)]
        if given:
            raise ValueError(f"--from_hf makes a run in --workdir; {', '.join(given)} belong(s) to the export "
                             "(drop them).")
        out = writer.import_hf(args.from_hf, args.workdir, step=args.step)
        cli.log(f"made the goat-jax run {out} of {args.from_hf}")
        return out
    if args.out is None:
        raise ValueError("--out is required: the folder to write the Hugging Face export into "
                         "(or give --from_hf FOLDER to import one).")
    out = writer.export_run(args.workdir, args.out, step=args.step, dtype=args.dtype, overwrite=args.overwrite,
                            max_shard_size=args.max_shard_size, tokenizer=args.tokenizer)
    cli.log(f"exported {args.workdir} to {out}: AutoModelForCausalLM.from_pretrained({out!r}, trust_remote_code=True)")
    return out


if __name__ == "__main__":
    from goat_jax import platforms  # pylint: disable=g-import-not-at-top
    platforms.avoid_libtpu_without_tpu()  # before any JAX backend starts (goat_jax/platforms.py)
    cli.run(main)
