"""The paper suite for a cluster: every run of a suite as shell commands (``experiments.train``
per run, then ``experiments.evaluate`` per group of runs, then the toy), which
``experiments.reproduce --suite paper`` runs one after another or prints with ``--dry_run``.
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Sequence
from typing import Optional

from goat_jax.config.files import load_config
from goat_jax.reproduce import vit_family
from goat_jax.reproduce.suites import Suite, plan


def paper_commands(suite: Suite, root: str, encodings: Optional[Sequence[str]], out: str,
                   **plan_kwargs) -> list[str]:
    """``experiments.train`` per run, then ``experiments.evaluate`` per group of runs (all
    encodings side by side), then the toy. Override values are passed as ``--config.x=y``.
    Evaluated-with rows (``Job.trains`` False) are left out: they train nothing, and their
    evaluation is the trained row's with ``experiments.evaluate --position_encoding`` /
    ``--logn_scaling``.
    ``plan_kwargs``: :func:`plan`'s ``families``, ``vit_encodings``, ``dna_encodings``."""
    py = "python -m"
    cmds, groups = [], {}
    jobs = plan(suite, root, encodings, **plan_kwargs)
    for job in jobs:
        if job.kind == "toy" or not job.trains:
            continue
        flags = " ".join(f"--config.{k}={shlex.quote(str(v))}" for k, v in job.overrides.items())
        cmds.append(f"{py} experiments.train --config {job.spec} --workdir {job.workdir} {flags}".strip())
        groups.setdefault((job.kind, job.dataset), []).append(job)
    # Language runs: the official C4 evaluation (docs/protocols.md): 512-query chunks through the
    # KV cache and the last-layer diagnostics with u(j) curves.
    evals = {"lm": "extrapolation,passkey,sinks,diagnostics --chunk_size 512", "passkey": "passkey",
             "niah": "niah"}
    mults = ",".join(str(m) for m in suite.multipliers)
    for (kind, dataset), group in groups.items():
        labelled = any(j.variant for j in group)  # variant rows share an encoding: name every run
        dirs = " ".join(f"--workdir {j.workdir}" + (f" --label {shlex.quote(j.label)}" if labelled else "")
                        for j in group)
        if kind == "vit":
            res = vit_family.resolutions_for(load_config(group[0].spec, group[0].overrides), suite.vit_scales)
            what = f"--evals resolution --resolutions {','.join(map(str, res))}"
        elif kind == "dna":  # one command per genome: --max_bases caps the files together
            for _, path in suite.dna_genomes:
                name = os.path.basename(path).split(".")[0]
                cmds.append(f"{py} experiments.evaluate {dirs} --evals dna --fasta {shlex.quote(path)} "
                            f"--multipliers {','.join(map(str, suite.dna_multipliers))} --gc_windows "
                            f"{suite.dna_gc_windows}" + (f" --max_bases {suite.dna_max_bases}" if suite.dna_max_bases
                                                         else "") + f" --out {os.path.join(out, 'dna_' + name)}")
            continue
        else:
            what = (f"--evals {evals[kind]} --multipliers {mults} --num_examples {suite.num_examples} "
                    f"--num_trials {suite.standard_trials}")
        cmds.append(f"{py} experiments.evaluate {dirs} {what} --out {os.path.join(out, dataset)}")
    if any(j.kind == "toy" for j in jobs):
        cmds.append(f"{py} experiments.toy_prior --config {suite.toy} --workdir {os.path.join(root, 'toy')} "
                    "--all_heads")
    return cmds
