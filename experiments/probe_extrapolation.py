"""Where a trained GOAT LM loses perplexity past its training length (docs/extrapolation.md).

    python -m experiments.probe_extrapolation --workdir runs/tiny --out runs/tiny_probe

Evaluates the run's held-out stream in windows of ``--multiple`` x the training length with one
part of the prior changed at a time at evaluation (the interventions: goat_jax/eval/probe.py)
and writes ``OUT/probe.json`` and ``OUT/probe.md``; nothing is written to the run.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence
from typing import Any, Optional

from goat_jax import cli
from goat_jax.eval import lm_run
from goat_jax.eval.probe import markdown, probe
from goat_jax.train import run as run_lib


def main(argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
    """CLI entry point; returns the :func:`probe` result."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workdir", required=True, help="a GOAT LM run of experiments.train")
    p.add_argument("--multiple", type=int, default=16, help="long windows, as a power-of-two multiple of seq_len")
    p.add_argument("--out", default=None, help="output dir (default: WORKDIR_probe)")
    args = p.parse_args(argv)
    if args.multiple < 2 or args.multiple & (args.multiple - 1):
        raise ValueError(f"--multiple must be a power of two >= 2, got {args.multiple}.")
    out = args.out or os.path.normpath(args.workdir) + "_probe"
    run_lib.check_output_dir(out, "the probe", "_probe")  # before the probe's work, not after
    result = probe(lm_run.load_lm_run(args.workdir), args.multiple)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "probe.json"), "w") as f:
        json.dump(result, f, indent=1)
    text = markdown(result)
    with open(os.path.join(out, "probe.md"), "w") as f:
        f.write(text)
    print(text)
    return result


if __name__ == "__main__":
    from goat_jax import platforms  # pylint: disable=g-import-not-at-top
    platforms.avoid_libtpu_without_tpu()  # before any JAX backend starts (goat_jax/platforms.py)
    cli.run(main)
