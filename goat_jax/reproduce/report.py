"""The report writer, the top of the harness's library: one section per family
(``OUT/sections/<family>.md``: provenance, setup, headline checks, notes, tables, figures, run
times) and ``OUT/REPORT.md`` assembled from every section on disk, with ``OUT/results.json``.
"""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import time
from collections.abc import Sequence
from typing import Optional

from goat_jax import files
from goat_jax.reproduce import dna_family, lm_family, stats, vit_family
from goat_jax.reproduce import jobs as jobs_lib
from goat_jax.reproduce import records
from goat_jax.reproduce.suites import FAMILY_TITLES, LM_KINDS, ROOT, Job, Suite


def _git_commit() -> str:
    """The repository's HEAD commit (short), or 'unknown' outside a git checkout."""
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                       stderr=subprocess.DEVNULL, text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _setup_line(job: Job) -> str:
    """One line of the Setup section: the job's spec, overrides and the resolved settings."""
    c = records.read_config(job).to_dict()  # what actually ran (the workdir's, or the record's copy)
    m = c["model"]
    head = f"`{job.spec}`{' + ' + str(job.overrides) if job.overrides else ''}: "
    if job.kind == "vit":
        return head + vit_family.setup_line(c)
    return head + (f"{m['num_layers']} layer(s), d {m['embed_dim']}, {m['num_heads']} heads "
                   f"({m.get('kv_num_heads') or m['num_heads']} KV), {c['num_train_steps']} steps x "
                   f"{c['global_batch_size']} x {c['seq_len']} {'bases' if job.kind == 'dna' else 'tokens'}, "
                   f"peak lr {c['optimizer']['learning_rate']}"
                   + (f", seed {c['seed']}" if job.kind == "dna" else ""))


def _base(run_name: str) -> str:
    """A run name without its ``@seed<k>`` suffix (the row it belongs to)."""
    return re.sub(r"@seed\d+$", "", run_name)


def _seed_of(run_name: str) -> int:
    m = re.search(r"@seed(\d+)$", run_name)
    return int(m.group(1)) if m else 0


def _grouped(names: Sequence[str]) -> str:
    """Row names ``kind/dataset/label`` -> ``'`kind/dataset`: a, b; `kind2/...`: c'`` (order kept)."""
    groups: dict[str, list[str]] = {}
    for name in names:
        head, _, label = name.rpartition("/")
        groups.setdefault(head, []).append(label)
    return "; ".join(f"`{head}`: {', '.join(labels)}" for head, labels in groups.items())


def compute_by_seed(timings: dict[str, float], names: set[str]) -> dict[int, dict[str, float]]:
    """Per seed offset k, the compute of the runs whose row (``Job.name``) is in ``names``:
    ``{'stages': train + evaluate seconds, 'train': training seconds, 'wall': this invocation's
    wall clock, 'runs': how many runs the seconds are over}`` (the seeds of a partial report can
    have different run counts, so their minutes are comparable only next to them). ``timings``
    holds ``'train <run name>'`` / ``'eval <run name>'`` (the seconds the stage took when the run
    was made: a reused run counts) and ``'wall <run name>'`` (this invocation's: ~0 for a reused
    run)."""
    out: dict[int, dict[str, float]] = {}
    runs: dict[int, set[str]] = {}
    for key, seconds in timings.items():
        stage, run = key.split(" ", 1)
        if _base(run) not in names:
            continue
        entry = out.setdefault(_seed_of(run), {"stages": 0.0, "train": 0.0, "wall": 0.0, "runs": 0})
        if stage == "wall":
            entry["wall"] += seconds
        else:
            runs.setdefault(_seed_of(run), set()).add(run)
            entry["stages"] += seconds
            entry["train"] += seconds if stage == "train" else 0.0
    for k, names in runs.items():
        out[k]["runs"] = len(names)
    return out


def family_section(family: str, suite: Suite, jobs: Sequence[Job], results: dict[str, dict], out: str,
                   command: str, timings: dict[str, float], total_seconds: float, seeds: int = 1,
                   failed: Optional[dict] = None, seeds_of: Optional[dict[str, int]] = None,
                   unfinished: Sequence[str] = ()) -> str:
    """One family's part of REPORT.md (``## <Family>`` and its subsections): the provenance of
    this invocation (command, date, commit, compute), the setup, the headline checks with their
    numbers, the notes, every table and figure, and the run times of ``jobs`` (the family's).
    ``seeds_of``: how many seeds each row's numbers are over (rows with fewer than ``seeds`` are
    listed); ``unfinished``: the family's planned runs left out because they have not finished
    (``--report_only``), listed under the provenance."""
    names = {j.name for j in jobs}
    mine = {k: v for k, v in timings.items() if not k.startswith("wall ") and _base(k.split(" ", 1)[1]) in names}
    by_seed = compute_by_seed(timings, names)
    failed = failed or {}  # this family's failed runs (write_report picks them)
    md = [f"## {FAMILY_TITLES[family]}", "",
          f"Command: `{command}`  ", f"Date: {time.strftime('%Y-%m-%d %H:%M %Z')}  ",
          f"Code: git {_git_commit()}  ",
          f"Machine: {platform.machine()}, {os.cpu_count()} CPU cores (shared), no accelerator  ",
          f"Compute: {sum(mine.values()) / 60:.1f} min over this family's stages (training "
          f"{sum(v for k, v in mine.items() if k.startswith('train')) / 60:.1f} min); the invocation "
          f"took {total_seconds / 60:.1f} min (finished runs and cached evaluations are reused; "
          f"stage times of reused runs are those of the invocation that made them)  ",
          "Compute per seed (train + evaluate seconds summed over the family's runs, as each run "
          "took them when it was made, so reused runs count; runs that shared the cores with other "
          "jobs took longer than on idle cores): "
          + ", ".join(f"seed +{k} {v['stages'] / 60:.1f} min over {v['runs']} run{'s' if v['runs'] != 1 else ''} "
                      f"(training {v['train'] / 60:.1f})"
                      for k, v in sorted(by_seed.items()))
          + "; this invocation's wall clock per seed (~0 for reused runs): "
          + ", ".join(f"seed +{k} {v['wall'] / 60:.1f} min" for k, v in sorted(by_seed.items())) + "  ",
          f"Seeds: {seeds} (seed = the config's seed + k, k = 0..{seeds - 1}; the toy figure is trained once). "
          + (f"Every number is the {stats.INTERVAL_NAME} (a row with one seed: its single value); "
             if seeds > 1 else
             "One seed: numbers are single runs, there is no interval, and every verdict is "
             f"'{stats.ONE_SEED}'; ")
          + "a verdict is on the paired (same-seed) difference named next to it: **supported** when its "
          "interval excludes 0 on the claimed side, **contradicted** when it excludes 0 on the other, "
          "inconclusive otherwise. The old fixed threshold is kept as a secondary column.", ""]
    if failed:
        md += ["**Failed runs** (left out of the numbers): " + "; ".join(f"`{k}`: {v}" for k, v in failed.items()), ""]
    if unfinished:
        by_seed: dict[int, list[str]] = {}
        for k in unfinished:
            by_seed.setdefault(_seed_of(k), []).append(_base(k))
        md += [f"**Partial report** (`--report_only`: written from the runs finished so far, training "
               f"nothing): {len(unfinished)} planned run(s) of this family have not finished and are left "
               "out: " + "; ".join(f"seed +{k}: {_grouped(v)}" for k, v in sorted(by_seed.items())) + ".", ""]
    fewer: dict[int, list[str]] = {}
    for j in jobs:  # plan order
        n = (seeds_of or {}).get(j.name, seeds)
        if n < seeds and j.kind != "toy":  # the toy figure is trained once by design
            fewer.setdefault(n, []).append(j.name)
    if fewer:
        md += [f"**Rows with fewer than {seeds} seeds** (their numbers, and every check that pairs them, "
               "are over the seeds they have; a check's seed count is next to its verdict): "
               + "; ".join(f"{n} seed{'s' if n > 1 else ''}: {_grouped(v)}" for n, v in sorted(fewer.items()))
               + ".", ""]
    body = ["## Setup (identical across position encodings)", ""]
    for kind, dataset in dict.fromkeys((j.kind, j.dataset) for j in jobs if not j.variant):
        job = next(j for j in jobs if (j.kind, j.dataset) == (kind, dataset))
        body.append(f"* **{kind if dataset in (kind, 'copy_mixture') or kind == 'lm' else dataset}**: "
                    + _setup_line(job))
    body += [f"* **{j.dataset} {j.label}** (extra row): " + _setup_line(j)
             + ("" if j.trains else f"; trains nothing: the {os.path.basename(j.workdir)} run evaluated with "
                + ", ".join(f"{k}={v}" for k, v in j.eval_overrides.items()))
             for j in jobs if j.variant]
    body.append("")
    memory = dna_family.dna_memory(suite, jobs) if family == "dna" else []
    checks = headline_checks(family, suite, jobs, results, memory)
    body += ["## Headline checks", "", "| claim | verdict | paired difference | numbers | threshold |",
             "|---|---|---|---|---|"]
    for c in checks:
        word = f"**{c.verdict}**" if c.verdict in (stats.SUPPORTED, stats.CONTRADICTED) else (c.verdict or "-")
        if c.seeds is not None and 1 < c.seeds < seeds:
            word += f" ({c.seeds} of {seeds} seeds)"
        body.append(f"| {c.claim} | {word} | {c.difference or '-'} | {c.numbers} | "
                    f"{'PASS' if c.ok else ('not measured' if c.ok is None else '**FAIL**')} |")
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
    body += ["## Run times", "", "| stage (@seed<k>: seed + k) | seconds |", "|---|---|"]
    body += [f"| {k} | {v:.0f} |" for k, v in mine.items()]
    # One level deeper than a standalone report: the family is the ## heading.
    md += [("#" + line) if line.startswith("##") else line for line in body]
    return "\n".join(md) + "\n"


def headline_checks(family: str, suite: Suite, jobs: Sequence[Job], results: dict[str, dict],
                    memory: Sequence[dict] = ()) -> list[stats.Check]:
    """``family``'s headline checks of ``results`` (aggregated rows by name; ``jobs``: the
    family's rows; ``memory``: the DNA family's compiled-memory rows). The rows the checks read
    (:data:`goat_jax.reproduce.jobs.FEEDS_CHECKS`) are first restricted to the seeds all of them
    have (:func:`goat_jax.reproduce.stats.on_common_seeds`): in a partial report, where rows can
    have different seeds, every column of a check (difference, numbers, threshold) pairs the same
    seeds. The tables keep every seed a row has."""
    fed, _ = stats.on_common_seeds({j.name: results[j.name] for j in jobs
                                    if j.name in results and jobs_lib.FEEDS_CHECKS[family](j, suite)})
    results = {**results, **fed}
    if family == "lm":
        encodings = list(dict.fromkeys(j.encoding for j in jobs if j.kind in LM_KINDS[:-1] and not j.variant))
        checks = lm_family.lm_checks(results, encodings, suite.lm_check_multiplier, lm_family.headline_dataset(suite))
        if suite.rival_checks is not None:
            checks += lm_family.rival_checks(results, suite.rival_checks, lm_family.headline_dataset(suite))
        checks += lm_family.layout_checks(results, suite.layout_checks, lm_family.headline_dataset(suite))
        return checks
    if family == "vit":
        return vit_family.vision_checks(jobs, results) + vit_family.layout_checks(results, suite.layout_checks)
    return dna_family.dna_checks(jobs, results, list(memory)) + dna_family.layout_checks(results, suite.layout_checks)


def write_report(suite: Suite, jobs: Sequence[Job], results: dict[str, dict], out: str,
                 command: str, timings: dict[str, float], total_seconds: float, *,
                 per_seed: Optional[dict[str, dict]] = None, failed: Optional[dict[str, str]] = None,
                 seeds: int = 1, unfinished: Sequence[str] = ()) -> str:
    """Writes the sections of the families in ``jobs`` to ``OUT/sections/<family>.md``, then
    ``OUT/REPORT.md``: every family section found in ``OUT/sections`` (a family not run this
    time keeps the section of the invocation that last ran it, with that invocation's command,
    date and commit), and merges ``results`` into ``OUT/results.json``: per row its mean over
    seeds (``results[name]``) and every seed's own values (``results[name]['seeds']``,
    ``{run name: values}``, from ``per_seed``). ``unfinished``: run names left out because
    they have not finished (``--report_only``), listed in their family's section. Returns the
    markdown."""
    os.makedirs(os.path.join(out, "sections"), exist_ok=True)
    written = set()
    for family in FAMILY_TITLES:
        fam_jobs = [j for j in jobs if j.family == family and j.name in results]  # failed rows: listed, not shown
        fam_failed = {k: v for k, v in (failed or {}).items()
                      if _base(k) in {j.name for j in jobs if j.family == family}}
        family_names = {j.name for j in jobs if j.family == family}
        seeds_of = None if per_seed is None else {name: sum(_base(k) == name for k in per_seed)
                                                  for name in family_names}
        fam_unfinished = [k for k in unfinished if _base(k) in family_names]
        if fam_jobs:
            text = family_section(family, suite, fam_jobs, results, out, command, timings, total_seconds,
                                  seeds=seeds, failed=fam_failed, seeds_of=seeds_of, unfinished=fam_unfinished)
        elif fam_unfinished and not fam_failed:  # --report_only before any of its runs finished
            text = (f"## {FAMILY_TITLES[family]}\n\nCommand: `{command}`  \nPartial report: none of this "
                    f"family's {len(fam_unfinished)} planned runs has finished yet.\n")
        elif any(j.family == family for j in jobs):  # every run of the family failed: say so, keep no old text
            text = (f"## {FAMILY_TITLES[family]}\n\nCommand: `{command}`  \nEvery run failed: "
                    + "; ".join(f"`{k}`: {v}" for k, v in fam_failed.items()) + "\n")
        else:
            continue
        files.write_whole(os.path.join(out, "sections", f"{family}.md"), text)
        written.add(family)
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
    files.write_whole(os.path.join(out, "REPORT.md"), text)
    old = {}
    if os.path.exists(os.path.join(out, "results.json")):
        with open(os.path.join(out, "results.json")) as f:
            old = json.load(f)
    merged = merge_results(old, results, per_seed, written)
    files.write_whole(os.path.join(out, "results.json"), json.dumps(merged, indent=1, default=float))
    return text


def merge_results(old: dict[str, dict], results: dict[str, dict], per_seed: Optional[dict[str, dict]],
                  families: set[str]) -> dict[str, dict]:
    """``results.json`` after an invocation: ``old`` (the file as it was) with every row of the
    ``families`` written this time replaced by ``results`` (each with its seeds' own values
    from ``per_seed`` under ``'seeds'``). A row of those families that this invocation has no
    result for (not finished, failed, or no longer planned) is dropped, never left over from an
    older protocol; rows of the other families stay as their sections do."""
    merged = {name: value for name, value in old.items() if _family_of(name) not in families}
    for name, value in results.items():
        own = {k: v for k, v in (per_seed or {}).items() if _base(k) == name}
        merged[name] = {**value, "seeds": own} if own else value
    return merged


def _family_of(name: str) -> str:
    """The family of a row name ``kind/dataset/label`` (``lm`` for LMs, retrieval and the toy)."""
    kind = name.split("/", 1)[0]
    return "lm" if kind in LM_KINDS else kind

