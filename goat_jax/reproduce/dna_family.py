"""The DNA family of the report harness (``experiments.reproduce``): genome LMs on E. coli K-12
MG1655 (configs/dna_tiny.py) with GOAT, RoPE, ALiBi and NoPE, everything else identical.

Per run (cached with the run's other evaluations; goat_jax.eval.dna does the scoring):

* the held-out region of the training genome (the config's ``data.valid_records``: the last
  10% of MG1655), its first ``Suite.dna_max_bases`` bases: NLL (nats, bits per base),
  perplexity and next-base accuracy on non-overlapping windows of 1x..8x the training length;
* the same on each of ``Suite.dna_genomes`` (a different E. coli strain, DH1, and 40 kb of
  human chr17), capped alike;
* GC agreement (docs/experiments.md, section DNA) on ``Suite.dna_gc_windows`` windows spread
  over the whole held-out region, with its two model-free references;
* train tokens/s from the run's metrics.jsonl.

Once per report: the compiled training-step memory (arguments + temporaries, XLA's
``memory_analysis``, compile only) of the official genome GPT with GOAT and with RoPE at
``Suite.dna_memory_lengths`` (:func:`goat_jax.reproduce.dna_bench.memory_row`), cached next to
the runs.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any, Optional

from goat_jax import cli, files
from goat_jax.data.fasta import N_ID
from goat_jax.eval import dna as dna_eval
from goat_jax.eval import lm_run
from goat_jax.eval.runs import table
from goat_jax.reproduce import dna_bench
from goat_jax.reproduce import layout, records, stats
from goat_jax.reproduce.suites import Job, LayoutCheck, Suite
from goat_jax.train import run as run_lib

MEMORY_DTYPE = "bfloat16"  # the official recipe's compute dtype
MEMORY_KERNEL = "xla"  # materialized attention, as benchmarks/dna.md


def evaluate_dna_job(job: Job, suite: Suite) -> dict[str, Any]:
    """The evaluations of one DNA ``job`` (uncached; :func:`goat_jax.reproduce.jobs.evaluate`
    caches them): ``{'train_len', 'step', 'heldout': {...}, 'genomes': {label: {...}}, 'tokens_per_sec'}``
    (each of the scored sets as goat_jax.eval.dna.evaluate_records returns it, plus ``'data'``)."""
    run = lm_run.load_lm_run(job.workdir)
    seed = int(run.config.seed)
    whole, info = dna_eval.heldout_records(run.config.data, "valid")
    records, names = dna_eval.first_bases(whole, info["records"], suite.dna_max_bases)
    info = {**info, "records": names, "bases": [len(r) for r in records],
            "n_bases": int(sum(int((r == N_ID).sum()) for r in records))}
    out = {"train_len": run.train_len, "step": run.step}
    out["heldout"] = {"data": info, **dna_eval.evaluate_records(
        run.model, run.params, records, run.train_len, multipliers=suite.dna_multipliers,
        gc_records=whole, gc_num_windows=suite.dna_gc_windows, seed=seed)}
    cli.log(f"  {job.name}: held-out E. coli scored")
    out["genomes"] = {}
    for label, path in suite.dna_genomes:
        out["genomes"][label] = dna_eval.evaluate_fasta(
            run.model, run.params, [path], run.train_len, max_bases=suite.dna_max_bases,
            multipliers=suite.dna_multipliers, gc_num_windows=0, seed=seed)
        cli.log(f"  {job.name}: {label} scored")
    out["tokens_per_sec"] = run_lib.median_throughput(job.workdir)
    return out


def dna_memory(suite: Suite, jobs: Sequence[Job]) -> list[dict]:
    """Compiled train-step memory of GOAT and RoPE at each of ``suite.dna_memory_lengths``
    (:func:`goat_jax.reproduce.dna_bench.memory_row`: the official genome GPT, 8,192 bases per
    step, ``MEMORY_DTYPE``, kernel ``MEMORY_KERNEL``; ``suite.dna_memory_model`` shrinks it for
    tests). Cached in ``reproduce_memory.json`` next to the DNA runs, keyed by the settings, and
    copied next to their records (read from there when the runs are gone)."""
    dna_jobs = [j for j in jobs if j.kind == "dna"]
    if not dna_jobs or not suite.dna_memory_lengths:
        return []
    cache, kept = records.family_file(dna_jobs[0], records.MEMORY_FILE)  # the record's copy: kept
    key = json.dumps({"lengths": list(suite.dna_memory_lengths), "model": suite.dna_memory_model,
                      "dtype": MEMORY_DTYPE, "kernel": MEMORY_KERNEL}, sort_keys=True)
    for path in (cache, kept):
        if path and os.path.exists(path):
            try:
                cached = files.read_json_object(path)
            except ValueError as e:  # a derived cache (JSON or decoding error, not an object): measured again, said
                cli.log(f"  compiled-memory cache {path} is unreadable ({e}); measuring again")
                continue
            if cached.get("key") == key:
                records.copy_into(path, kept)  # a cache made before records existed gets its copy
                return cached["rows"]
    rows = []
    for n in suite.dna_memory_lengths:
        for e in ("goat", "rope"):
            rows.append(dna_bench.memory_row(e, n, MEMORY_DTYPE, tokens_per_step=8192, timed_steps=0,
                                             implementation=MEMORY_KERNEL,
                                             model_overrides=suite.dna_memory_model))
            cli.log(f"  memory {e} L={n}: {rows[-1]['arguments'] + rows[-1]['temporaries']:.1f} MiB")
    os.makedirs(os.path.dirname(cache), exist_ok=True)
    files.write_whole(cache, json.dumps({"key": key, "rows": rows}))  # a kill mid-write leaves the old one
    records.copy_into(cache, kept)
    return rows


def _runs(jobs: Sequence[Job], results: dict[str, dict]) -> dict[str, dict]:
    """``{label: result}`` of the evaluated DNA runs, in plan order."""
    return {j.label: results[j.name] for j in jobs if j.kind == "dna" and j.name in results}


def _scores(entry: dict, key: str = "bits_per_base", where: str = "heldout",
            genome: Optional[str] = None) -> dict[int, float]:
    block = entry["genomes"][genome] if genome else entry[where]
    return {int(w): v[key] for w, v in block["by_length"].items()}


def _total(row: dict) -> float:
    return row["arguments"] + row["temporaries"]


def feeds_checks(job: Job, suite: Suite) -> bool:
    """Whether the DNA checks read ``job``'s result: the GOAT and RoPE genome LMs (every check
    of :func:`dna_checks` is GOAT against RoPE; ALiBi and NoPE are table rows) and the rows of
    ``suite``'s DNA layout checks (:func:`layout_checks`). As every family's ``feeds_checks``
    (:data:`goat_jax.reproduce.jobs.FEEDS_CHECKS`)."""
    return job.kind == "dna" and ((not job.variant and job.encoding in ("goat", "rope")) or layout.feeds(job, suite))


def layout_checks(results: dict[str, dict], checks: Sequence[LayoutCheck]) -> list[stats.Check]:
    """The DNA family's non-inferiority checks among ``checks`` (family 'dna'; docs/protocols.md,
    "Extrapolation to 1024x and the 64-wide layout"): the check's metric (e.g. bits per base) on
    the held-out region by window length, judged by :func:`goat_jax.reproduce.layout.judge`; a
    row without results is "not measured"."""
    def by_length(label, metric):
        entry = results.get(f"dna/dna/{label}")
        return _scores(entry, metric) if entry else None

    return [layout.judge(lc, by_length(lc.candidate, lc.metric), by_length(lc.reference, lc.metric), unit="bases")
            for lc in layout.of_family(checks, "dna")]


def dna_checks(jobs: Sequence[Job], results: dict[str, dict], memory: list[dict]) -> list[stats.Check]:
    """The paper's genomics claims at this scale as :class:`goat_jax.reproduce.stats.Check` s
    (verdict on the paired GOAT - RoPE difference; the old comparison as PASS/FAIL):
    GOAT's held-out NLL below RoPE's (at the training length, and at the longest evaluated
    length, where the paper's extrapolation claim lives); GOAT's compiled train-step
    memory (arguments + temporaries) below RoPE's at every measured length; GOAT's GC
    agreement r above RoPE's."""
    runs = _runs(jobs, results)
    g, r = runs.get("goat"), runs.get("rope")
    checks = []
    if g and r:
        n1 = int(g["train_len"])
        bg, br = _scores(g), _scores(r)
        top = max(set(bg) & set(br))
        checks.append(stats.judged(
            f"DNA: GOAT held-out NLL < RoPE's at the training length ({n1} bases)", bg[n1] < br[n1],
            f"bits/base at {n1}: GOAT {bg[n1]:.4f}, RoPE {br[n1]:.4f}; at {top} ({top // n1}x): GOAT "
            f"{bg[top]:.4f}, RoPE {br[top]:.4f}", bg[n1] - br[n1], -1, "GOAT - RoPE (bits/base)", ".4f"))
        if top != n1:
            checks.append(stats.judged(
                f"DNA: GOAT held-out NLL < RoPE's at {top // n1}x the training length ({top} bases)",
                bg[top] < br[top], f"bits/base at {top}: GOAT {bg[top]:.4f}, RoPE {br[top]:.4f}",
                bg[top] - br[top], -1, "GOAT - RoPE (bits/base)", ".4f"))
    if memory:
        by = {(m["encoding"], m["length"]): _total(m) for m in memory}
        lengths = sorted({m["length"] for m in memory})
        ok = all(by[("goat", n)] < by[("rope", n)] for n in lengths)
        worst = max(by[("goat", n)] - by[("rope", n)] for n in lengths)  # deterministic: no seeds
        checks.append(stats.judged(
            "DNA: GOAT compiled train-step memory < RoPE's (official model, every length)", ok,
            "GOAT / RoPE MiB: " + ", ".join(f"{by[('goat', n)]:.1f} / {by[('rope', n)]:.1f} at {n}"
                                           for n in lengths), worst, -1, "max GOAT - RoPE (MiB, compiled)", ".1f"))
    if g and r and "r_model" in g["heldout"].get("gc", {}) and "r_model" in r["heldout"].get("gc", {}):
        gg, gr = g["heldout"]["gc"], r["heldout"]["gc"]
        ref = {k: stats.seed_invariant(gg[k]) for k in ("r_prompt", "r_halves")}  # no model: same windows
        checks.append(stats.judged(
            "DNA: GC agreement r (samples vs. the true continuation) GOAT > RoPE", gg["r_model"] > gr["r_model"],
            f"GOAT {gg['r_model']:.3f}, RoPE {gr['r_model']:.3f} ({gg['num_windows']} windows; no-model "
            f"references: prompt {ref['r_prompt']:.3f}, halves {ref['r_halves']:.3f})",
            gg["r_model"] - gr["r_model"], +1, "GOAT - RoPE (r)"))
    return checks


def dna_section(suite: Suite, jobs: Sequence[Job], results: dict[str, dict], memory: list[dict]) -> list[str]:
    """The DNA section (markdown lines)."""
    runs = _runs(jobs, results)
    if not runs:
        return []
    first = next(iter(runs.values()))
    n1 = int(first["train_len"])
    fmt = lambda n: f"{n} ({n / n1:g}x)"  # noqa: E731
    held = first["heldout"]["data"]
    md = ["## DNA: genome language models (E. coli K-12 MG1655)", "",
          f"Scored on non-overlapping windows of 1x..{max(suite.dna_multipliers)}x the training length "
          f"({n1} bases); a window's every base is scored. Held out: {', '.join(held['records'])} "
          f"({sum(held['bases']):,} bases scored: the first of the held-out region; never trained on).", ""]
    sets = [("held-out E. coli MG1655", None)] + [(label, label) for label, _ in suite.dna_genomes]
    for title, genome in sets:
        try:
            bits = {k: _scores(e, genome=genome) for k, e in runs.items()}
            acc = {k: _scores(e, "accuracy", genome=genome) for k, e in runs.items()}
            ppl = {k: _scores(e, "ppl", genome=genome) for k, e in runs.items()}
        except KeyError:
            continue
        data = (first["genomes"][genome] if genome else first["heldout"])["data"]
        md += [f"### {title}: {', '.join(os.path.basename(f) for f in data['files'])}, "
               f"{sum(data['bases']):,} bases", "",
               "Bits per base:", "", table(bits, first_col="encoding", header_fmt=fmt), "",
               "Perplexity (per base; 4 is a uniform guess over ACGT):", "",
               table(ppl, first_col="encoding", header_fmt=fmt), "",
               "Next-base accuracy:", "", table(acc, pct=True, first_col="encoding", header_fmt=fmt), ""]
    md += ["### GC agreement on the held-out region (docs/experiments.md, section DNA)", "",
           "| encoding | r(sample, truth) | r(prompt, truth), no model | r(halves of truth), no model | "
           "mean GC sample / truth | windows |", "|---|---:|---:|---:|---:|---:|"]
    for k, e in runs.items():
        gc = e["heldout"].get("gc") or {}
        if "error" in gc:
            md.append(f"| {k} | {gc['error']} | | | | |")
        elif gc:
            fixed = {f: stats.seed_invariant(gc[f]) for f in ("r_prompt", "r_halves", "mean_gc_true")}
            md.append(f"| {k} | {gc['r_model']:.3f} | {fixed['r_prompt']:.3f} | {fixed['r_halves']:.3f} | "
                      f"{gc['mean_gc_sample']:.3f} / {fixed['mean_gc_true']:.3f} | {gc['num_windows']} |")
    md += ["", "### Memory and throughput", "",
           "| encoding | train tokens/s (median, metrics.jsonl) |", "|---|---:|"]
    for k, e in runs.items():
        t = e.get("tokens_per_sec")
        md.append(f"| {k} | {'-' if t is None else f'{t:,.0f}'} |")
    md.append("")
    if memory:
        model = (f"the official genome GPT (configs/dna_hg38.py) with {suite.dna_memory_model}"
                 if suite.dna_memory_model else "the official genome GPT (configs/dna_hg38.py: d 512, 8 layers)")
        md += [f"Compiled training-step memory (XLA `memory_analysis()`, compile only) of {model}, "
               f"{MEMORY_DTYPE}, attention kernel `{MEMORY_KERNEL}`, 8,192 bases per step "
               "(experiments.bench_dna):", "",
               "| length | batch | encoding | arguments MiB | temporaries MiB | total MiB |", "|---|---|---|---:|---:|---:|"]
        for m in memory:
            md.append(f"| {m['length']} | {m['batch']} | {m['encoding']} | {m['arguments']:.1f} | "
                      f"{m['temporaries']:.1f} | {_total(m):.1f} |")
        md += ["", "GOAT runs the same attention kernel as RoPE on q/k widened by its prior channels, so "
               "its step needs the same memory (slightly more: the extra channels); the paper's "
               "2.86 GB -> 1.83 GB comes from its RoPE implementation, not from the encoding. Train "
               "tokens/s are read from runs on a shared CPU; compare them with care.", ""]
    return md
