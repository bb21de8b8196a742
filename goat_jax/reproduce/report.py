"""The report writer, the top of the harness's library: one section per family
(``OUT/sections/<family>.md``: provenance, setup, headline checks, notes, tables, figures, run
times) and ``OUT/REPORT.md`` assembled from every section on disk, with ``OUT/results.json``.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import time
from collections.abc import Sequence

from goat_jax.reproduce import dna_family, lm_family, vit_family
from goat_jax.reproduce.suites import FAMILY_TITLES, LM_KINDS, ROOT, Job, Suite
from goat_jax.train import run as run_lib


def _git_commit() -> str:
    """The repository's HEAD commit (short), or 'unknown' outside a git checkout."""
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                       stderr=subprocess.DEVNULL, text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _setup_line(job: Job) -> str:
    """One line of the Setup section: the job's spec, overrides and the resolved settings."""
    c = run_lib.read_config(job.workdir).to_dict()  # what actually ran
    m = c["model"]
    head = f"`{job.spec}`{' + ' + str(job.overrides) if job.overrides else ''}: "
    if job.kind == "vit":
        return head + vit_family.setup_line(c)
    return head + (f"{m['num_layers']} layer(s), d {m['embed_dim']}, {m['num_heads']} heads "
                   f"({m.get('kv_num_heads') or m['num_heads']} KV), {c['num_train_steps']} steps x "
                   f"{c['global_batch_size']} x {c['seq_len']} {'bases' if job.kind == 'dna' else 'tokens'}, "
                   f"peak lr {c['optimizer']['learning_rate']}"
                   + (f", seed {c['seed']}" if job.kind == "dna" else ""))


def family_section(family: str, suite: Suite, jobs: Sequence[Job], results: dict[str, dict], out: str,
                   command: str, timings: dict[str, float], total_seconds: float) -> str:
    """One family's part of REPORT.md (``## <Family>`` and its subsections): the provenance of
    this invocation (command, date, commit, compute), the setup, the headline checks with their
    numbers, the notes, every table and figure, and the run times of ``jobs`` (the family's)."""
    mine = {k: v for k, v in timings.items() if k.split(" ", 1)[1] in {j.name for j in jobs}}
    md = [f"## {FAMILY_TITLES[family]}", "",
          f"Command: `{command}`  ", f"Date: {time.strftime('%Y-%m-%d %H:%M %Z')}  ",
          f"Code: git {_git_commit()}  ",
          f"Machine: {platform.machine()}, {os.cpu_count()} CPU cores (shared), no accelerator  ",
          f"Compute: {sum(mine.values()) / 60:.1f} min over this family's stages (training "
          f"{sum(v for k, v in mine.items() if k.startswith('train')) / 60:.1f} min); the invocation "
          f"took {total_seconds / 60:.1f} min (finished runs and cached evaluations are reused)", ""]
    body = ["## Setup (identical across position encodings)", ""]
    for kind, dataset in dict.fromkeys((j.kind, j.dataset) for j in jobs if not j.variant):
        job = next(j for j in jobs if (j.kind, j.dataset) == (kind, dataset))
        body.append(f"* **{kind if dataset in (kind, 'copy_mixture') or kind == 'lm' else dataset}**: "
                    + _setup_line(job))
    body += [f"* **{j.dataset} {j.label}** (extra row): " + _setup_line(j) for j in jobs if j.variant]
    body.append("")
    if family == "lm":
        encodings = list(dict.fromkeys(j.encoding for j in jobs if j.kind in LM_KINDS[:-1]
                                       and not j.variant))
        checks = lm_family.lm_checks(results, encodings)
    elif family == "vit":
        checks = vit_family.vision_checks(jobs, results)
    else:
        memory = dna_family.dna_memory(suite, jobs)
        checks = dna_family.dna_checks(jobs, results, memory)
    body += ["## Headline checks", "", "| claim | result | numbers |", "|---|---|---|"]
    for claim, ok, numbers in checks:
        body.append(f"| {claim} | {'PASS' if ok else ('not measured' if ok is None else '**FAIL**')} | {numbers} |")
    body.append("")
    notes = {"lm": suite.notes, "vit": suite.vit_notes, "dna": suite.dna_notes}[family]
    if notes:
        body += ["## Notes", ""] + [f"* {n}" for n in notes] + [""]
    if family == "lm":
        body += lm_family.lm_sections(suite, jobs, results, out)
    elif family == "vit":
        body += vit_family.vision_section(jobs, results, out)
    else:
        body += dna_family.dna_section(suite, jobs, results, memory)
    body += ["## Run times", "", "| stage | seconds |", "|---|---|"]
    body += [f"| {k} | {v:.0f} |" for k, v in mine.items()]
    # One level deeper than a standalone report: the family is the ## heading.
    md += [("#" + line) if line.startswith("##") else line for line in body]
    return "\n".join(md) + "\n"


def write_report(suite: Suite, jobs: Sequence[Job], results: dict[str, dict], out: str,
                 command: str, timings: dict[str, float], total_seconds: float) -> str:
    """Writes the sections of the families in ``jobs`` to ``OUT/sections/<family>.md``, then
    ``OUT/REPORT.md``: every family section found in ``OUT/sections`` (a family not run this
    time keeps the section of the invocation that last ran it, with that invocation's command,
    date and commit), and merges ``results`` into ``OUT/results.json``. Returns the markdown."""
    os.makedirs(os.path.join(out, "sections"), exist_ok=True)
    for family in FAMILY_TITLES:
        fam_jobs = [j for j in jobs if j.family == family]
        if fam_jobs:
            text = family_section(family, suite, fam_jobs, results, out, command, timings, total_seconds)
            with open(os.path.join(out, "sections", f"{family}.md"), "w") as f:
                f.write(text)
    sections = []
    for family in FAMILY_TITLES:
        path = os.path.join(out, "sections", f"{family}.md")
        if os.path.exists(path):
            with open(path) as f:
                sections.append((family, f.read()))
    md = [f"# GOAT experiments, `{suite.name}` suite", "",
          "Each family below was produced by the command, at the date and commit, written under its "
          "heading: `python -m experiments.reproduce --suite " + suite.name + "` runs every family, "
          "`--families vit,dna` (say) reruns those and keeps the other sections as they were "
          "(`sections/<family>.md`).", ""]
    md += [f"* [{FAMILY_TITLES[f]}](#{FAMILY_TITLES[f].lower()})" for f, _ in sections] + [""]
    text = "\n".join(md) + "\n" + "\n".join(body for _, body in sections)
    with open(os.path.join(out, "REPORT.md"), "w") as f:
        f.write(text)
    merged = {}
    if os.path.exists(os.path.join(out, "results.json")):
        with open(os.path.join(out, "results.json")) as f:
            merged = json.load(f)
    merged.update(results)
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(merged, f, indent=1, default=float)
    return text

