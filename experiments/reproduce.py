"""Reproduce the paper's experiments at one scale: one command -> REPORT.md + figures.

    python -m experiments.reproduce --suite tiny                   # 3 seeds: ~15 h on 2 CPU cores
    python -m experiments.reproduce --suite tiny --status          # how far it got, what is left
    python -m experiments.reproduce --suite tiny --report_only     # the report of what finished so far
    python -m experiments.reproduce --suite tiny --families dna    # one family: lm, vit or dna
    python -m experiments.reproduce --suite smoke --out /tmp/rep   # minutes: the harness end to end
    python -m experiments.reproduce --suite tiny --families lm --seeds 3 --jobs 2   # part of it
    python -m experiments.reproduce --suite paper --dry_run        # the cluster commands, printed

Three families, each comparing position encodings with everything else identical:

* ``lm`` (language; ``--encodings``: GOAT, RoPE, RoPE-PI, ALiBi, sinusoidal, NoPE), per encoding
  a byte-level LM on the Jargon File -> perplexity at 1x..16x the training length
  (non-overlapping windows), the standard passkey prompt (greedy, KV cache), attention sinks;
  a synthetic passkey model -> teacher-forced key accuracy at 1x..16x; a synthetic NIAH model
  -> span token accuracy over lengths x depths (heatmaps); plus the toy copy-mixture GOAT model
  and its prior figure (goat_jax/reproduce/lm_family.py).
* ``vit`` (vision; ``--vit_encodings``: goat, ape, sincos2d, rope2d, nope): a ViT on
  Fashion-MNIST per encoding -> top-1 and loss at 1x, 1.5x, 2x, 3x the training resolution,
  GOAT's learned 2D prior, CLS attention maps, train images/s (goat_jax/reproduce/vit_family.py).
* ``dna`` (genomes; ``--dna_encodings``: goat, rope, alibi, nope): a genome LM on E. coli per
  encoding -> bits per base, perplexity, accuracy at 1x..8x the training length on held-out
  E. coli, another strain and human DNA, GC agreement, compiled train-step memory GOAT vs RoPE,
  train tokens/s (goat_jax/reproduce/dna_family.py).

Then it writes ``OUT/REPORT.md`` (the command, date, settings, the headline checks of every
family with their verdicts and numbers, all tables) and its PNGs. With ``--seeds N`` every run
trains N times (seed = the config's + k; the toy figure once) and every number is the mean ±
95% Student t interval over seeds; each headline check is judged on the paired difference
(supported / contradicted / inconclusive; goat_jax/reproduce/stats.py), the old fixed
threshold kept as PASS/FAIL next to it. The runs a headline check reads train first, family by
family in the ``--families`` order and every seed of a family before the next family (the
tables' other rows after them), so a suite stopped part way has verdicts to report:
``--report_only`` writes that report from whatever finished. Runs live under
``--workdir`` and resume: re-running after an interruption retrains nothing that finished, and
evaluations are cached per run (``reproduce_eval.json``). Each evaluated run is also *recorded*
under ``--records`` (default ``OUT/runs``; goat_jax/reproduce/records.py): its numbers, config
and the small files the report reads, small enough to commit beside the report, and reused when
the workdir is gone (a suite spread over machines or sittings that do not keep their disk). A suite is a ``Suite`` in
``goat_jax/reproduce/suites.py: SUITES``; extra LM rows (``LMVariant``) and retrieval variants
(``RetrievalVariant``) are one-line entries there (docs/experiments.md, "Adding rows"). This file
parses the command line; the harness is the library package ``goat_jax/reproduce/``.

``--suite paper`` cannot run on a CPU: it builds the same runs with the full-scale configs
(configs/lm_c4_125m.py, configs/lm_fineweb_1b.py, configs/retrieval_tiny.py:*,paper,
configs/vit_s16_imagenet.py, configs/dna_hg38.py) as shell commands (``experiments.train`` +
``experiments.evaluate``) and runs them one after another, or prints them with ``--dry_run``
for a cluster scheduler.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from collections.abc import Sequence
from typing import Optional

from goat_jax import cli
from goat_jax.reproduce import runner
from goat_jax.reproduce.suites import DNA_ENCODINGS, ENCODINGS, FAMILIES, ROOT, SUITES, VIT_ENCODINGS


def _split(value: Optional[str]) -> Optional[list[str]]:
    """A comma list flag -> its non-empty items; None when the flag was not given."""
    return [x for x in value.split(",") if x] if value else None


PATH_FLAGS = ("--workdir", "--out", "--records", "--compilation_cache")  # where files go: not what is computed


def report_command(argv: Sequence[str]) -> str:
    """The command line written into the report, runnable by a user from the repository root:
    ``argv`` with each path flag (:data:`PATH_FLAGS`) made relative to the repository root when
    it lies inside it, and dropped when it lies outside (another machine's folder, e.g. a
    workdir on a scratch disk: the default under the repository computes the same report).
    ``none`` (no compilation cache) is kept as written."""
    root = os.path.realpath(ROOT)
    out: list[str] = []
    items = list(argv)
    i = 0
    while i < len(items):
        flag, value, step = items[i], None, 1
        name = flag.split("=", 1)[0]
        if name in PATH_FLAGS:
            if "=" in flag:
                value = flag.split("=", 1)[1]
            elif i + 1 < len(items):
                value, step = items[i + 1], 2
        if value is None or value == "none":
            out += items[i:i + step]
        else:
            path = os.path.realpath(value)
            if path == root or path.startswith(root + os.sep):
                out += [name, os.path.relpath(path, root)]
        i += step
    return "python -m experiments.reproduce " + " ".join(shlex.quote(a) for a in out)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """CLI: runs (or prints) a suite; returns the process exit code."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--suite", choices=sorted(SUITES), default="tiny")
    p.add_argument("--workdir", default=None, help="runs root (default runs/reproduce_<suite>)")
    p.add_argument("--out", default=None, help="report dir (default reports/<suite>)")
    p.add_argument("--records", default=None,
                   help="run records: each finished run's evaluated numbers, config and small files, written as "
                   "soon as it is evaluated and reused when its workdir is gone (default <out>/runs; 'none': off)")
    p.add_argument("--families", default=",".join(FAMILIES),
                   help="comma list of families to run and report: lm (language models, retrieval, toy), "
                   "vit (vision), dna (genomes); default all")
    p.add_argument("--encodings", default=None, help="language family (LMs, retrieval): comma list "
                   f"(default: the suite's, {','.join(ENCODINGS)}; smoke: goat,rope)")
    p.add_argument("--vit_encodings", default=None, help="vision family: comma list (default: the "
                   f"suite's, {','.join(VIT_ENCODINGS)}; smoke: goat,ape)")
    p.add_argument("--dna_encodings", default=None, help="DNA family: comma list (default: the "
                   f"suite's, {','.join(DNA_ENCODINGS)}; smoke: goat,rope)")
    p.add_argument("--retrieval_variants", default=None,
                   help="comma list of the suite's retrieval variants to train and report (default: all "
                   "of them; 'none': only the default retrieval runs)")
    p.add_argument("--seeds", type=int, default=None,
                   help="trains per run, seed = the config's + k (default: the suite's; tiny 3, smoke 1); "
                   "every number is then mean ± 95%% Student t interval over seeds, finished seeds are reused")
    p.add_argument("--jobs", type=int, default=1,
                   help="training jobs at once, each in a subprocess logging to <workdir>.log (default 1: "
                   "one after another; 2 on 2 cores finishes the tiny suite sooner)")
    p.add_argument("--dry_run", action="store_true", help="print the commands, run nothing")
    p.add_argument("--status", action="store_true",
                   help="print where every planned run stands (done, trained, partial at step k/N, ...) per "
                   "family and seed, and the compute still to go; trains and writes nothing")
    p.add_argument("--report_only", action="store_true",
                   help="write the report from the runs finished and evaluated so far (listing the others), "
                   "training and evaluating nothing: the verdicts of a suite still running")
    p.add_argument("--compilation_cache", default=None,
                   help="persistent XLA compilation cache shared by every job (default <workdir>/xla_cache; "
                   "'none': off; a set JAX_COMPILATION_CACHE_DIR wins): seeds k > 0 load the programs seed 0 compiled")
    args = p.parse_args(argv)
    command = report_command(sys.argv[1:] if argv is None else argv)
    return runner.reproduce(
        args.suite, command=command, workdir=args.workdir, out=args.out,
        families=_split(args.families) or [], encodings=_split(args.encodings),
        vit_encodings=_split(args.vit_encodings), dna_encodings=_split(args.dna_encodings),
        retrieval_variants=None if args.retrieval_variants is None else args.retrieval_variants.split(","),
        dry_run=args.dry_run, seeds=args.seeds, jobs=args.jobs, status=args.status,
        report_only=args.report_only, compilation_cache=args.compilation_cache, records=args.records)


if __name__ == "__main__":
    from goat_jax import platforms  # pylint: disable=g-import-not-at-top
    platforms.avoid_libtpu_without_tpu()  # before any JAX backend starts (goat_jax/platforms.py)
    sys.exit(cli.run(main))  # config and input errors: one line (GOAT_DEBUG=1: traceback)
