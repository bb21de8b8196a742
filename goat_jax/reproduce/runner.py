"""One invocation of the report harness (what ``python -m experiments.reproduce`` calls): pick
the suite's runs, train and evaluate each (resuming; evaluations cached), write the report; or,
for the paper suite and ``dry_run``, print or run the shell commands instead.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import time
from collections.abc import Sequence
from typing import Optional

from goat_jax import _extras
with _extras.imports(__name__):  # optional packages: one-line error naming the extra
    from absl import logging as absl_logging
from goat_jax import cli
from goat_jax.models import lm, vit
from goat_jax.reproduce import jobs as jobs_lib
from goat_jax.reproduce import lm_family, paper, paper_table, report
from goat_jax.reproduce.suites import FAMILIES, FAMILY_TITLES, ROOT, SUITES, Suite, plan


def select_retrieval_variants(suite: Suite, labels: Optional[Sequence[str]]) -> Suite:
    """``suite`` with only the retrieval variants named in ``labels`` (None: all of them; an
    empty list or ['none']: none); ValueError naming the suite's variants for an unknown one."""
    if labels is None:
        return suite
    wanted = [v for v in labels if v and v != "none"]
    known = [v.label for v in suite.retrieval_variants]
    if set(wanted) - set(known):
        raise ValueError(f"--retrieval_variants {','.join(labels)}: suite {suite.name!r} has "
                         f"{', '.join(known) or 'none'}; give some of them or 'none'.")
    return dataclasses.replace(suite, retrieval_variants=tuple(
        v for v in suite.retrieval_variants if v.label in wanted))


def check_encodings(encodings: Optional[Sequence[str]], vit_encodings: Optional[Sequence[str]],
                    dna_encodings: Optional[Sequence[str]]) -> None:
    """Refuses an unknown name in ``--encodings`` / ``--dna_encodings`` (the language model's
    position encodings) or ``--vit_encodings`` (the ViT's), naming the flag and the choices."""
    for flag, values, allowed in (("--encodings", encodings, lm.POSITION_ENCODINGS),
                                  ("--vit_encodings", vit_encodings, vit.POSITION_ENCODINGS),
                                  ("--dna_encodings", dna_encodings, lm.POSITION_ENCODINGS)):
        unknown = [x for x in (values or []) if x and x not in allowed]
        if unknown:
            raise ValueError(f"{flag} {','.join(values)}: unknown encoding(s) {unknown}; choose from "
                             f"{','.join(allowed)}.")


def reproduce(suite_name: str, *, command: str, workdir: Optional[str] = None, out: Optional[str] = None,
              families: Sequence[str] = FAMILIES, encodings: Optional[Sequence[str]] = None,
              vit_encodings: Optional[Sequence[str]] = None, dna_encodings: Optional[Sequence[str]] = None,
              retrieval_variants: Optional[Sequence[str]] = None, dry_run: bool = False) -> int:
    """Runs (or prints) suite ``suite_name``'s ``families``; returns the process exit code.

    ``workdir``: the runs root (default ``runs/reproduce_<suite>``); ``out``: the report
    directory (default ``reports/<suite>``); encodings default to the suite's; ``command`` is
    the command line written into the report.
    """
    if suite_name not in SUITES:
        raise ValueError(f"--suite {suite_name}: choose from {', '.join(sorted(SUITES))}.")
    suite = select_retrieval_variants(SUITES[suite_name], retrieval_variants)
    check_encodings(encodings, vit_encodings, dna_encodings)  # --dry_run too: not when a job is reached
    if not families:
        raise ValueError(f"--families is empty; give some of {','.join(FAMILIES)}.")
    encodings = list(encodings or suite.encodings)
    plan_kwargs = {"families": list(families), "vit_encodings": vit_encodings, "dna_encodings": dna_encodings}
    root = workdir or os.path.join("runs", f"reproduce_{suite.name}")
    out = out or os.path.join("reports", suite.name)

    if suite.name == "paper" or dry_run:
        cmds = paper.paper_commands(suite, root, encodings, out, **plan_kwargs) if suite.name == "paper" else [
            f"# in-process: train + evaluate {j.name} ({j.spec}, overrides {j.overrides}) in {j.workdir}"
            for j in plan(suite, root, encodings, **plan_kwargs)]
        if dry_run:
            if suite.name == "paper":  # sizes, budgets and departures from the official recipes
                # The language runs: paper_table holds the official language recipes only.
                print(paper_table.render(paper_table.rows(plan(suite, root, encodings, families=["lm"]))))
            print("\n".join(cmds))
            return 0
        for cmd in cmds:
            cli.log(f"$ {cmd}")
            rc = subprocess.call(cmd, shell=True, cwd=ROOT)
            if rc:
                cli.log(f"failed with exit code {rc}: {cmd}")
                return rc
        return 0

    absl_logging.set_verbosity(absl_logging.WARNING)  # orbax INFO lines would drown the progress log
    t_start = time.time()
    jobs = plan(suite, root, encodings, **plan_kwargs)
    if not jobs:
        raise ValueError(f"--families {','.join(families)}: suite {suite.name!r} has no runs there.")
    cli.log(f"suite {suite.name}: {len(jobs)} runs under {root}, report in {out}")
    results, timings = {}, {}
    for i, job in enumerate(jobs):
        cli.log(f"[{i + 1}/{len(jobs)}] {job.name}: {job.spec} {job.overrides or ''}")
        timings[f"train {job.name}"] = jobs_lib.train(job)["seconds"]
        results[job.name] = jobs_lib.evaluate(job, suite)
        timings[f"eval {job.name}"] = results[job.name]["eval_seconds"]
        cli.log(f"  elapsed {(time.time() - t_start) / 60:.1f} min")
    os.makedirs(out, exist_ok=True)
    lm_family.copy_toy_figures(jobs, out)
    report.write_report(suite, jobs, results, out, command, timings, time.time() - t_start)
    cli.log(f"wrote {os.path.join(out, 'REPORT.md')} after {(time.time() - t_start) / 60:.1f} min")
    for family in dict.fromkeys(j.family for j in jobs):  # this invocation's verdicts, for the log
        with open(os.path.join(out, "sections", f"{family}.md")) as f:
            part = f.read().split("### Headline checks", 1)[-1]
        print(f"{FAMILY_TITLES[family]}: headline checks" + part.split("\n### ", 1)[0])
    return 0
