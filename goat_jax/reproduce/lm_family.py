"""The language family of the report harness (``experiments.reproduce``): what is evaluated on
each LM, retrieval and toy run, the headline checks against the paper's language claims, and
the report's tables and figures for them (one row per encoding, plus any ``Suite.lm_variants``
rows and one extra set of tables per ``Suite.retrieval_variants`` entry).

Results are keyed by ``Job.name`` (``kind/dataset/label``): ``lm/jargon/goat``,
``passkey/passkey/rope``, ``niah/niah_official/goat`` (a retrieval variant), ``toy/copy_mixture/goat``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, Optional

import numpy as np

from goat_jax.config_files import load_config
from goat_jax.eval import plots, toy
from goat_jax.eval import runs as ev
from goat_jax.reproduce.suites import Job, Suite


def evaluate_lm_job(job: Job, suite: Suite) -> dict[str, Any]:
    """The evaluations of one language-family ``job`` (uncached;
    :func:`goat_jax.reproduce.jobs.evaluate` caches them): LMs get extrapolation, sinks and the
    standard passkey prompt; passkey models the synthetic passkey; NIAH models the grid; the toy
    its prior figure and checks."""
    if job.kind == "toy":
        res = toy.run_toy(load_config(job.spec, job.overrides), job.workdir, all_heads=True, train=False)
        return {"summary": res["summary"], "sink": res["checks"]["sink"],
                "diagonal": res["checks"]["diagonal"], "loss": res["loss"]}
    run = ev.load_lm_run(job.workdir)
    out = {"train_len": run.train_len, "step": run.step}
    if job.kind == "lm":
        out["extrapolation"] = ev.eval_extrapolation(run, suite.multipliers)
        out["sinks"] = ev.eval_sinks(run, num_examples=suite.sink_examples)
        out["passkey"] = ev.eval_passkey(run, suite.multipliers, variants=("standard",),
                                         num_trials=suite.standard_trials)
    elif job.kind == "passkey":
        out["passkey"] = ev.eval_passkey(run, suite.multipliers, variants=("synthetic",),
                                         num_examples=suite.num_examples)
    else:
        out["niah"] = ev.eval_niah(run, suite.multipliers, depths=suite.niah_depths,
                                   num_examples=suite.niah_examples)
    return out


def lm_checks(results: dict[str, dict], encodings: Sequence[str]) -> list[tuple[str, Optional[bool], str]]:
    """The language claims: ``[(claim, passed or None if not measured, numbers)]``. Only the
    plain encodings take part (variant rows such as ``goat+<option>`` are shown, not judged)."""
    lm = {e: results.get(f"lm/jargon/{e}", {}).get("extrapolation") for e in encodings}
    lm = {e: {int(n): v["ppl"] for n, v in r.items()} for e, r in lm.items() if r}
    pk = {e: results.get(f"passkey/passkey/{e}", {}).get("passkey", {}).get("synthetic") for e in encodings}
    pk = {e: {int(n): a for n, a in r.items()} for e, r in pk.items() if r}
    checks = []

    def ratio(e):
        r = lm.get(e, {})
        return r[max(r)] / r[min(r)] if len(r) > 1 else None

    g, rr = ratio("goat"), ratio("rope")
    if g is not None and rr is not None:
        top = max(lm["goat"]) // min(lm["goat"])
        checks.append((f"GOAT perplexity at {top}x <= 1.3 x its in-distribution perplexity",
                       g <= 1.3, f"GOAT {top}x / 1x = {g:.2f}"))
        checks.append((f"RoPE perplexity at {top}x >= 3 x its in-distribution perplexity",
                       rr >= 3.0, f"RoPE {top}x / 1x = {rr:.2f}"))
    base = {e: r[min(r)] for e, r in lm.items() if e != "goat"}
    if "goat" in lm and base:
        best = min(base, key=base.get)
        gap = lm["goat"][min(lm["goat"])] / base[best] - 1
        checks.append(("GOAT in-distribution perplexity within 2% of the best baseline", gap <= 0.02,
                       f"GOAT {lm['goat'][min(lm['goat'])]:.3f} vs {best} {base[best]:.3f} ({100 * gap:+.1f}%)"))
    for e, cmp_, thr in (("goat", ">=", 0.9), ("rope", "<=", 0.5)):
        r = pk.get(e)
        if r:
            n8 = 8 * min(r)
            acc = r.get(n8)
            ok = None if acc is None else (acc >= thr if cmp_ == ">=" else acc <= thr)
            checks.append((f"{'GOAT' if e == 'goat' else 'RoPE'} synthetic passkey accuracy at 8x the "
                           f"training length {cmp_} {100 * thr:.0f}%", ok,
                           "not measured" if acc is None else f"{100 * acc:.0f}% at {n8}"))
    return checks


def length_table(rows: dict[str, dict[int, float]], train_len: int, pct: bool = False) -> str:
    """Runs x lengths, each length header also given as a multiple of the training length."""
    return ev.table(rows, pct=pct, first_col="encoding", header_fmt=lambda n: f"{n} ({n / train_len:g}x)")


def _train_len(results: dict[str, dict], kind: str, dataset: Optional[str] = None) -> int:
    """The training length of the first evaluated run of ``kind`` (and ``dataset``)."""
    prefix = f"{kind}/{dataset}/" if dataset else kind + "/"
    return next(int(r["train_len"]) for name, r in results.items()
                if name.startswith(prefix) and "train_len" in r)


def lm_sections(suite: Suite, jobs: Sequence[Job], results: dict[str, dict], out: str) -> list[str]:
    """The language family's report sections (markdown lines); writes their PNGs into ``out``."""

    def rows(kind: str, dataset: str, key: str) -> dict[str, Any]:
        """``{row label: results[key]}`` of the runs of ``kind/dataset`` that have ``key``."""
        found = {j.label: results.get(j.name, {}).get(key) for j in jobs
                 if j.kind == kind and j.dataset == dataset}
        return {k: v for k, v in found.items() if v}

    md: list[str] = []
    for dataset, _ in suite.lm:
        ext = {e: {int(n): v["ppl"] for n, v in r.items()} for e, r in rows("lm", dataset, "extrapolation").items()}
        if ext:
            md += [f"## Perplexity by evaluation length ({dataset}, byte level, non-overlapping windows)", "",
                   length_table(ext, _train_len(results, "lm", dataset)), "",
                   "Ratio to the in-distribution (1x) perplexity: " + ", ".join(
                       f"{e} {r[max(r)] / r[min(r)]:.2f}" for e, r in ext.items()), "",
                   f"![perplexity](perplexity_{dataset}.png)", ""]
            plots.plot_perplexity_vs_length(ext, os.path.join(out, f"perplexity_{dataset}.png"),
                                            train_len=min(next(iter(ext.values()))),
                                            title=f"Length extrapolation ({dataset})")
    for suffix, title in [("", "")] + [(f"_{v.label}", f", {v.label} variant") for v in suite.retrieval_variants]:
        pk = {e: {int(n): a for n, a in r["synthetic"].items()}
              for e, r in rows("passkey", "passkey" + suffix, "passkey").items()}
        if pk:
            md += [f"## Synthetic passkey{title} (official GOAT variant: teacher-forced exact match of the "
                   "8-digit key)", "", length_table(pk, _train_len(results, "passkey", "passkey" + suffix), pct=True),
                   "", f"![passkey](passkey_synthetic{suffix}.png)", ""]
            plots.plot_passkey_accuracy(pk, os.path.join(out, f"passkey_synthetic{suffix}.png"),
                                        train_len=min(next(iter(pk.values()))), title=f"Synthetic passkey{title}")
        if suffix:
            continue
        std = {e: {int(n): a for n, a in r["standard"].items()}
               for e, r in rows("lm", suite.lm[0][0], "passkey").items() if r.get("standard")}
        if std:
            md += ["## Standard passkey prompt (greedy decoding with the KV cache; zero-shot on the LMs above)",
                   "", length_table(std, _train_len(results, "lm"), pct=True), ""]
    for suffix, title in [("", "")] + [(f"_{v.label}", f", {v.label} variant") for v in suite.retrieval_variants]:
        niah = rows("niah", "niah" + suffix, "niah")
        if niah:
            mean = {e: dict(zip([int(n) for n in g["lengths"]], np.mean(g["token_accuracy"], axis=1)))
                    for e, g in niah.items()}
            md += [f"## Needle in a haystack{title} (synthetic; value-span token accuracy, mean over depths)", "",
                   length_table(mean, _train_len(results, "niah", "niah" + suffix), pct=True), ""]
            for e, g in niah.items():
                plots.plot_niah_heatmap({k: np.asarray(v) for k, v in g.items()},
                                        os.path.join(out, f"niah{suffix}_{e}.png"), title=f"NIAH{title}, {e}")
            md += [" ".join(f"![niah {e}](niah{suffix}_{e}.png)" for e in niah), ""]
    sk = rows("lm", suite.lm[0][0], "sinks")
    if sk:
        md += ["## Attention sinks (LM, held-out windows at the training length; per layer)", "",
               "| encoding | attention on position 0 (mean over heads) | (max head) | first-key norm / other keys |",
               "|---|---|---|---|"]
        for e, s in sk.items():
            md.append(f"| {e} | " + " / ".join(f"{x:.2f}" for x in s["first_mass"]) + " | " +
                      " / ".join(f"{x:.2f}" for x in s["first_mass_max_head"]) + " | " +
                      " / ".join(f"{x:.2f}" for x in s["key_norm_ratio"]) + " |")
        md.append("")
    toy = results.get("toy/copy_mixture/goat")
    if toy:
        md += ["## Toy copy mixture: the learned prior (paper Figure 1)", "", "![toy prior](toy_prior.png)", "",
               "Every layer/head: [toy_prior_all_heads.png](toy_prior_all_heads.png)", "",
               "```", toy["summary"].strip(), "```", ""]
    return md


def copy_toy_figures(jobs: Sequence[Job], out: str) -> None:
    """Copies the toy run's prior figures (written into its workdir by the evaluation) to ``out``."""
    for job in jobs:
        if job.kind != "toy":
            continue
        for name in ("toy_prior.png", "toy_prior_all_heads.png"):
            if os.path.exists(os.path.join(job.workdir, name)):
                with open(os.path.join(job.workdir, name), "rb") as src, open(os.path.join(out, name), "wb") as dst:
                    dst.write(src.read())
