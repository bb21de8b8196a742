"""The language family of the report harness (``experiments.reproduce``): what is evaluated on
each LM, retrieval and toy run, the headline checks against the paper's language claims, and
the report's tables and figures for them (one row per encoding, plus any ``Suite.lm_variants``
rows and one extra set of tables per ``Suite.retrieval_variants`` entry).

Results are keyed by ``Job.name`` (``kind/dataset/label``): ``lm/jargon/goat``,
``passkey/passkey/rope``, ``niah/niah_official/goat`` (a retrieval variant), ``toy/copy_mixture/goat``.
"""

from __future__ import annotations

import dataclasses
import math
import os
import statistics
import time
from collections.abc import Sequence
from typing import Any, Optional

import flax.linen as nn
import jax
import numpy as np

from goat_jax.config.files import load_config
from goat_jax.eval import plots, toy
from goat_jax.eval import chunked, extrapolation, lm_run
from goat_jax import cli
from goat_jax.eval import runs as ev
from goat_jax.reproduce import layout, records, stats
from goat_jax.reproduce.progress import LengthProgress
from goat_jax.reproduce.suites import Job, LayoutCheck, RivalChecks, Suite
from goat_jax.kernels.plan import AttentionPlan


CHANCE_DIGIT_LOSS = math.log(10)  # nats: a uniform guess over the digits 0-9 (passkey keys, NIAH values)


def evaluate_lm_job(job: Job, suite: Suite, progress: Optional[LengthProgress] = None) -> dict[str, Any]:
    """The evaluations of one language-family ``job`` (uncached;
    :func:`goat_jax.reproduce.jobs.evaluate` caches them): LMs get extrapolation, sinks and the
    standard passkey prompt; passkey models the synthetic passkey; NIAH models the grid; the toy
    its prior figure and checks. ``progress``: the LM perplexity lengths an earlier sitting of
    this evaluation finished, taken back, and where each new one is recorded as it finishes
    (:func:`timed_extrapolation`)."""
    if job.kind == "toy":
        res = toy.run_toy(load_config(job.spec, job.overrides), job.workdir, all_heads=True, train=False)
        return {"summary": res["summary"], "sink": res["checks"]["sink"],
                "diagonal": res["checks"]["diagonal"], "loss": res["loss"]}
    run = load_for_evaluation(job)
    out = {"train_len": run.train_len, "step": run.step}
    if job.kind == "lm":
        out["extrapolation"], out["extrapolation_cost"] = timed_extrapolation(
            run, ppl_multipliers(job, suite), suite.lm_eval_tokens, chunked_from=chunked_from(suite),
            chunk_size=suite.lm_eval_chunk_size, progress=progress)
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


def ppl_multipliers(job: Job, suite: Suite) -> tuple[int, ...]:
    """The perplexity lengths (multiples of the training length) of LM ``job``: the suite's
    LM lengths, ``lm_more_multipliers``, and ``lm_long_multipliers`` when the row is one of
    ``lm_long_rows`` (docs/protocols.md, "Extrapolation to 1024x and the 64-wide layout")."""
    out = tuple(suite.lm_ppl_multipliers or suite.multipliers) + tuple(suite.lm_more_multipliers)
    if job.label in suite.lm_long_rows:
        out += tuple(suite.lm_long_multipliers)
    return tuple(sorted(set(out)))


def extra_lm_settings(job: Job, suite: Suite) -> dict[str, Any]:
    """The evaluation settings of LM ``job`` beyond the family's common ones, only those set
    (a suite without them keeps the settings its cached evaluations were made with)."""
    out: dict[str, Any] = {}
    if suite.lm_more_multipliers:
        out["lm_more_multipliers"] = list(suite.lm_more_multipliers)
    if suite.lm_long_multipliers and job.label in suite.lm_long_rows:
        out["lm_long_multipliers"] = list(suite.lm_long_multipliers)
    if suite.lm_eval_tokens:
        out["lm_eval_tokens"] = int(suite.lm_eval_tokens)
    first = chunked_from(suite)
    if first is not None and any(m >= first for m in ppl_multipliers(job, suite)):
        out["lm_chunked_from"] = int(first)  # a row with no such length keeps its cached evaluation
        out["lm_eval_chunk_size"] = int(suite.lm_eval_chunk_size)
    return out


def _peak_rss_mib() -> Optional[float]:
    try:
        import resource  # pylint: disable=g-import-not-at-top  # POSIX only
    except ImportError:
        return None
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: KiB


def chunked_from(suite: Suite) -> Optional[int]:
    """The shortest length (a multiple of the training length) that the suite scores through
    the KV-cache chunked evaluation, or None (every length as one full-window forward)."""
    return suite.lm_chunked_from or None


def timed_extrapolation(run: lm_run.LMRun, multipliers: Sequence[int], max_tokens: Optional[int],
                        chunked_from: Optional[int] = None,
                        chunk_size: int = 512, progress: Optional[LengthProgress] = None) -> tuple[dict, dict]:
    """(perplexity by length, its cost by length): the perplexity of
    :func:`goat_jax.eval.runs.eval_extrapolation` one length at a time, shortest first, on the
    first ``max_tokens`` held-out tokens (None: the whole stream), read and tokenized once,
    with each length's wall-clock seconds (its compile included) and the process's peak
    resident memory after it (MiB; the peak so far, so with lengths in increasing order a rise
    belongs to that length). Lengths of ``chunked_from`` x the training length and longer are
    scored through the KV cache in chunks of ``chunk_size`` queries
    (:mod:`goat_jax.eval.chunked`: the same logits, memory chunk x length instead of length
    squared; docs/protocols.md, "Extrapolation to 1024x and the 64-wide layout"). A length with
    no full window is left out, as the evaluation itself leaves it out.

    ``progress``: a length it holds is taken back with its cost (seconds and memory as measured
    in the sitting that scored it), not scored again; each length scored here is put into it
    as soon as it finishes, so a killed evaluation resumes at its first unscored length. The
    numbers are those of one uninterrupted evaluation: every length is scored on its own, on
    the same held-out tokens."""
    ext, cost = {}, {}
    multipliers = sorted(multipliers)
    pending = []
    for m in multipliers:
        held = progress.get(m * run.train_len) if progress is not None else None
        if held is None:
            pending.append(m)
        else:
            ext[m * run.train_len], cost[m * run.train_len] = held
    if not pending:
        return ext, cost
    if run.is_synthetic:  # fresh task windows per length: nothing to read once
        stream = None
    else:
        stream = ev.heldout_stream(run, max_tokens)
    full_nll, chunked_nll = extrapolation.make_nll_fn(run.apply_fn), None
    for m in pending:
        t0 = time.time()
        use_chunks = chunked_from is not None and m >= chunked_from
        if stream is None:
            res = ev.eval_extrapolation(run, (m,), max_tokens=max_tokens,
                                        chunk_size=chunk_size if use_chunks else None)
        else:
            if use_chunks and chunked_nll is None:
                chunked_nll = chunked.make_chunked_nll_fn(run.model, chunk_size)
            res = extrapolation.perplexity_by_length(
                run.apply_fn, run.params, stream.tokens, run.train_len, (m,), tokens_per_batch=8192,
                nll_fn=chunked_nll if use_chunks else full_nll, bos_id=stream.bos_id,
                progress=lambda msg: cli.log(f"    {run.label} {msg}" + (f" (chunks of {chunk_size})"
                                                                         if use_chunks else "")))
            res = {int(n): {"ppl": r.ppl, "nll": r.nll, "tokens": r.num_tokens} for n, r in res.items()}
        for n, r in res.items():
            ext[int(n)] = r
            cost[int(n)] = {"seconds": time.time() - t0, "peak_rss_mib": _peak_rss_mib(),
                            **({"chunk_size": chunk_size} if use_chunks else {})}
            if progress is not None:
                progress.put(int(n), ext[int(n)], cost[int(n)])
    ext, cost = dict(sorted(ext.items())), dict(sorted(cost.items()))
    if stream is not None and not ext:  # every length skipped: an empty table would read as a result
        ev.no_full_window("extrapolation", run, multipliers, len(stream.tokens))
    return ext, cost


def load_for_evaluation(job: Job) -> lm_run.LMRun:
    """``job``'s trained run, its model rebuilt with ``job.eval_overrides`` (model fields set at
    evaluation time, the params untouched) for an evaluated-with row; ValueError naming the
    field when the override changes the parameters the run trained."""
    run = lm_run.load_lm_run(job.workdir)
    if not job.eval_overrides:
        return run
    config = run.config.copy_and_resolve_references()
    with config.unlocked():
        for key, value in job.eval_overrides.items():
            config.model[key.removeprefix("model.")] = value
    model = run.task.build_model(config, AttentionPlan.from_config(config))  # the overrides' plan
    ids = np.zeros((1, run.train_len), np.int32)
    shapes = jax.eval_shape(model.init, jax.random.PRNGKey(0), ids)["params"]
    if jax.tree.structure(nn.unbox(shapes)) != jax.tree.structure(run.params):
        raise ValueError(f"lm_variants {job.label!r}: eval_overrides {job.eval_overrides} change the "
                         "model's parameters; an evaluated-with row may only change evaluation-time fields.")
    return dataclasses.replace(run, config=config, model=model)


def synthetic_passkey(row: dict[str, Any]) -> dict[int, Any]:
    """``{length: accuracy}`` of a retrieval row's synthetic passkey (``{}`` when it has none)."""
    return {int(n): a for n, a in ((row or {}).get("passkey") or {}).get("synthetic", {}).items()}


def niah_by_length(grid: Optional[dict[str, Any]]) -> dict[int, Any]:
    """``{length: value-span token accuracy, mean over depths}`` of a NIAH row's grid (``{}``
    when it has none): what the NIAH table shows and the checks judge. The mean is taken per
    seed, so an aggregated grid of :class:`~goat_jax.reproduce.stats.Estimate` s gives
    Estimates with their seeds and interval (``np.mean`` would read them as plain floats and
    drop the seeds: a check would then judge the sign of a mean, with no interval)."""
    if not grid:
        return {}
    lengths, rows = grid["lengths"], grid["token_accuracy"]
    if len(rows) != len(lengths) or not all(rows):
        raise ValueError(f"NIAH grid: {len(rows)} rows of token_accuracy for {len(lengths)} lengths "
                         "(one non-empty row of depths per length expected).")
    return {int(n): sum(row) / len(row) for n, row in zip(lengths, rows)}


def headline_dataset(suite: Suite) -> str:
    """The LM dataset the language checks judge: the suite's first (``jargon`` in the tiny and
    smoke suites, ``c4_125m`` in the paper suite); the others are tables."""
    return suite.lm[0][0]


def feeds_checks(job: Job, suite: Suite) -> bool:
    """Whether :func:`lm_checks` reads ``job``'s result: the plain-encoding LMs on the
    :func:`headline_dataset` (extrapolation, in-distribution perplexity against every baseline)
    and the GOAT and RoPE synthetic passkey models; with ``suite.rival_checks``, also the
    candidate's and the rival's LM on that dataset and their default passkey and NIAH rows
    (:func:`rival_checks`). The harness trains these first (goat_jax/reproduce/runner.py)."""
    rival = suite.rival_checks
    if rival is not None:  # the rows of the checks against the rival (variants among them)
        if job.kind == "lm" and job.dataset == headline_dataset(suite) and job.label in (rival.candidate,
                                                                                          rival.lm_rival):
            return True
        if job.kind in ("passkey", "niah") and job.dataset == job.kind and job.label in (rival.candidate,
                                                                                          rival.retrieval_rival):
            return True
    if job.kind == "lm" and job.dataset == headline_dataset(suite) and layout.feeds(job, suite):
        return True
    if job.variant:
        return False
    return ((job.kind == "lm" and job.dataset == headline_dataset(suite))
            or (job.kind == "passkey" and job.dataset == "passkey" and job.encoding in ("goat", "rope")))


def lm_checks(results: dict[str, dict], encodings: Sequence[str],
              multiplier: int = 16, dataset: str = "jargon") -> list[stats.Check]:
    """The language claims as :class:`goat_jax.reproduce.stats.Check` s (claim, the old
    threshold's PASS/FAIL or None if not measured, numbers, verdict on the paired difference).
    Extrapolation is judged at ``multiplier`` x the training length (the longest measured if
    shorter), on the LMs of ``dataset`` (the report passes :func:`headline_dataset`). Only the
    plain encodings take part (variant rows are shown, not judged)."""
    lm = {e: results.get(f"lm/{dataset}/{e}", {}).get("extrapolation") for e in encodings}
    lm = {e: {int(n): v["ppl"] for n, v in r.items()} for e, r in lm.items() if r}
    pk = {e: synthetic_passkey(results.get(f"passkey/passkey/{e}")) for e in encodings}
    pk = {e: r for e, r in pk.items() if r}
    checks = []

    def at(r):  # the judged length: multiplier x the shortest, or the longest below it
        n1 = min(r)
        return max(n for n in r if n <= multiplier * n1)

    def ratio(e):
        r = lm.get(e, {})
        return r[at(r)] / r[min(r)] if len(r) > 1 else None

    g, rr = ratio("goat"), ratio("rope")
    if g is not None and rr is not None:
        top = at(lm["goat"]) // min(lm["goat"])
        checks.append(stats.judged(f"GOAT perplexity at {top}x <= 1.3 x its in-distribution perplexity",
                                   g <= 1.3, f"GOAT {top}x / 1x = {g:.2f}", g - 1.3, -1, "ratio - 1.3", ".2f"))
        checks.append(stats.judged(f"RoPE perplexity at {top}x >= 3 x its in-distribution perplexity",
                                   rr >= 3.0, f"RoPE {top}x / 1x = {rr:.2f}", rr - 3.0, +1, "ratio - 3", ".2f"))
        checks.append(stats.judged(f"GOAT's {top}x / 1x perplexity ratio < RoPE's", g < rr,
                                   f"GOAT {g:.2f}, RoPE {rr:.2f}", g - rr, -1, "GOAT - RoPE", ".2f"))
    base = {e: r[min(r)] for e, r in lm.items() if e != "goat"}
    if "goat" in lm and base:
        best = min(base, key=base.get)
        g1 = lm["goat"][min(lm["goat"])]
        gap = g1 / base[best] - 1
        checks.append(stats.judged("GOAT in-distribution perplexity within 2% of the best baseline", gap <= 0.02,
                                   f"GOAT {g1:.3f} vs {best} {base[best]:.3f} ({100 * gap:+.1f}%)",
                                   100 * gap - 2, -1, f"GOAT / {best} - 1 - 2% (points)", ".1f"))
        if "rope" in lm:
            r1 = lm["rope"][min(lm["rope"])]
            checks.append(stats.judged("GOAT in-distribution perplexity < RoPE's", g1 < r1,
                                       f"GOAT {g1:.3f}, RoPE {r1:.3f}", g1 - r1, -1, "GOAT - RoPE"))
    for e, cmp_, thr in (("goat", ">=", 0.9), ("rope", "<=", 0.5)):
        r = pk.get(e)
        if r:
            n8 = 8 * min(r)
            acc = r.get(n8)
            name = "GOAT" if e == "goat" else "RoPE"
            claim = f"{name} synthetic passkey accuracy at 8x the training length {cmp_} {100 * thr:.0f}%"
            if acc is None:
                checks.append(stats.Check(claim, None, "not measured"))
                continue
            ok = acc >= thr if cmp_ == ">=" else acc <= thr
            checks.append(stats.judged(claim, ok, f"{100 * acc:.0f}% at {n8}", 100 * (acc - thr),
                                       1 if cmp_ == ">=" else -1, f"accuracy - {100 * thr:.0f}% (points)", ".0f"))
    return checks


def rival_checks(results: dict[str, dict], rival: RivalChecks, dataset: str) -> list[stats.Check]:
    """The checks of ``rival.candidate`` against the rival (docs/protocols.md, "The strongest
    rival and the linear sink"): perplexity at each of ``rival.ppl_multipliers`` x the training
    length on the LMs of ``dataset`` (claim: the candidate's is lower than ``rival.lm_rival``'s),
    then synthetic passkey accuracy and NIAH accuracy (mean over depths) at each of
    ``rival.retrieval_multipliers`` (claim: the candidate's is higher than
    ``rival.retrieval_rival``'s). Paired over seeds as every headline check; a length that is
    not measured (or a row without results) is a "not measured" check, never left out."""
    checks = []
    cand, lm_rival = (results.get(f"lm/{dataset}/{e}", {}).get("extrapolation")
                      for e in (rival.candidate, rival.lm_rival))
    for m in rival.ppl_multipliers:
        claim = f"{rival.candidate} perplexity at {m}x < {rival.lm_rival}'s"
        if not cand or not lm_rival:
            checks.append(stats.Check(claim, None, "not measured"))
            continue
        c, r = ({int(n): v["ppl"] for n, v in x.items()} for x in (cand, lm_rival))
        n = m * min(c)
        if n not in c or n not in r:
            checks.append(stats.Check(claim, None, f"not measured ({n} tokens not evaluated)"))
            continue
        checks.append(stats.judged(claim, c[n] < r[n], f"{rival.candidate} {c[n]:.3f}, {rival.lm_rival} "
                                   f"{r[n]:.3f} at {n}", c[n] - r[n], -1, f"{rival.candidate} - {rival.lm_rival}"))
    if rival.flat_multiplier:
        m, thr = rival.flat_multiplier, rival.flat_ratio
        claim = f"{rival.candidate} perplexity at {m}x <= {thr:g} x its in-distribution perplexity"
        c = {int(n): v["ppl"] for n, v in (cand or {}).items()}
        n = m * min(c) if c else None
        if n is None or n not in c:
            checks.append(stats.Check(claim, None, "not measured" if n is None else f"not measured ({n} tokens not evaluated)"))
        else:
            ratio = c[n] / c[min(c)]
            checks.append(stats.judged(claim, ratio <= thr, f"{rival.candidate} {m}x / 1x = {ratio:.3f}",
                                       ratio - thr, -1, f"ratio - {thr:g}", ".3f"))

    def accuracy(kind: str, label: str) -> dict[int, Any]:
        r = results.get(f"{kind}/{kind}/{label}", {})
        return synthetic_passkey(r) if kind == "passkey" else niah_by_length(r.get("niah"))

    for kind, title in (("passkey", "synthetic passkey"), ("niah", "NIAH")):
        c, r = accuracy(kind, rival.candidate), accuracy(kind, rival.retrieval_rival)
        for m in rival.retrieval_multipliers:
            claim = f"{rival.candidate} {title} accuracy at {m}x > {rival.retrieval_rival}'s"
            n = m * min(c) if c else None
            if n is None or n not in c or n not in r:
                checks.append(stats.Check(claim, None, "not measured"))
                continue
            checks.append(stats.judged(claim, c[n] > r[n], f"{rival.candidate} {100 * c[n]:.0f}%, "
                                       f"{rival.retrieval_rival} {100 * r[n]:.0f}% at {n}",
                                       100 * (c[n] - r[n]), +1,
                                       f"{rival.candidate} - {rival.retrieval_rival} (points)", ".0f"))
    return checks


def layout_checks(results: dict[str, dict], checks: Sequence[LayoutCheck], dataset: str) -> list[stats.Check]:
    """The language family's non-inferiority checks among ``checks`` (:class:`~goat_jax.reproduce.
    suites.LayoutCheck` of family 'lm'; docs/protocols.md, "Extrapolation to 1024x and the 64-wide
    layout"): per check, the paired relative perplexity difference ``candidate / reference - 1``
    at ``multiplier`` x the training length on the LMs of ``dataset``, judged against ``margin``
    by :func:`goat_jax.reproduce.layout.judge` (supported when its interval lies below it); the
    difference at ``shown_multiplier`` goes into the numbers, unjudged. A row without results is
    a "not measured" check."""
    def by_length(label, metric):
        ext = results.get(f"lm/{dataset}/{label}", {}).get("extrapolation")
        return {int(n): v[metric] for n, v in ext.items()} if ext else None

    return [layout.judge(lc, by_length(lc.candidate, lc.metric), by_length(lc.reference, lc.metric))
            for lc in layout.of_family(checks, "lm")]


def _per_seed(value: Any) -> list[float]:
    """The seeds' values of a number of the aggregated results (an Estimate), or [value]."""
    if value is None:
        return []
    return [float(x) for x in value.values] if hasattr(value, "values") else [float(value)]


def cost_table(costs: dict[str, dict[int, Any]]) -> list[str]:
    """The lines under the perplexity table on what one evaluation at each length cost: per
    length, how it was scored (whole windows or query chunks through the KV cache), how many
    evaluations (rows x seeds) measured it, the median and the range of their wall-clock seconds
    (compile included), the row whose median is the largest, and the largest peak resident
    memory of an evaluating process after that length. ``costs``: ``{row: {length: {'seconds',
    'peak_rss_mib'[, 'chunk_size']}}}``, each number one per seed (an Estimate) or a float.
    Every evaluation counts, not one row's first seed: on a shared machine a length scored
    beside other work takes several times longer, so one sample can mislead by that much."""
    lengths = sorted({int(n) for r in costs.values() for n in r})
    if not lengths:
        return []
    lines = ["Cost of one evaluation by length: wall-clock seconds of one row's evaluation at that length "
             "(its compile included) and the evaluating process's peak resident memory after it (a running "
             "maximum: a chunked length shows at least the peak of the whole-window lengths scored before it in "
             "the same process), over every row and seed evaluated there. The machine is shared and most runs had another beside them "
             "(2 cores, 2 jobs), some also the test suite: the median is the typical cost, the range "
             "shows the load.", "",
             "| length | scored as | evaluations | median s | range s | slowest row (its median s) | "
             "peak memory, max (MiB) |", "|---|---|---|---|---|---|---|"]
    for n in lengths:
        here = {e: r[n] for e, r in costs.items() if n in r}
        seconds = {e: _per_seed(c.get("seconds")) for e, c in here.items()}
        every = [x for v in seconds.values() for x in v]
        slowest = max(seconds, key=lambda e: statistics.median(seconds[e]) if seconds[e] else -1.0)
        rss = [x for c in here.values() for x in _per_seed(c.get("peak_rss_mib"))]
        chunks = sorted({int(x) for c in here.values() for x in _per_seed(c.get("chunk_size"))})
        how = (f"{'/'.join(map(str, chunks))}-query chunks" if chunks else "whole windows") + \
            (" (some rows whole)" if chunks and any(c.get("chunk_size") is None for c in here.values()) else "")
        lines.append(f"| {n} | {how} | {len(every)} | {statistics.median(every):.0f} | "
                     f"{min(every):.0f}-{max(every):.0f} | {slowest} ({statistics.median(seconds[slowest]):.0f}) | "
                     + (f"{max(rss):.0f}" if rss else "-") + " |")
    return lines


def ratio_line(ext: dict[str, dict[int, Any]]) -> str:
    """The line under a perplexity table: each row's perplexity at its longest evaluated length
    over its perplexity at the shortest (the training length), with that length named once when
    every row shares it and per row otherwise."""
    longest = {e: max(r) for e, r in ext.items()}
    shared = len(set(longest.values())) == 1
    head = (f"Ratio of the perplexity at {next(iter(longest.values()))} tokens to the in-distribution "
            "(1x) one: " if shared else "Ratio of the perplexity at each row's longest length to the "
            "in-distribution (1x) one: ")
    return head + ", ".join(f"{e} {r[longest[e]] / r[min(r)]:.2f}" + ("" if shared else f" (at {longest[e]})")
                            for e, r in ext.items())


def figure_panels(labels: Sequence[str], layout_checks: Sequence[LayoutCheck] = ()
                      ) -> Optional[list[tuple[str, list[str]]]]:
    """The panels of the report's perplexity and passkey figures
    (:func:`plots.plot_perplexity_vs_length`, :func:`plots.plot_passkey_accuracy`):
    the position encodings (rows without '+'), their variants (rescalings, sink and frequency
    options: the other '+' rows) beside the goat and rope rows they vary, and the layout rows
    of ``layout_checks`` beside goat. Twenty lines in one panel could not be told apart. None
    (one panel) when only one of those groups has rows."""
    in_layout = {name for lc in layout_checks if lc.family == "lm" for name in (lc.candidate, lc.reference)}
    layout_rows = [l for l in labels if l in in_layout]
    base = [l for l in labels if "+" not in l and "@" not in l and l not in in_layout]
    variants = [l for l in labels if l not in base and l not in in_layout]
    groups = [g for g in (base, variants, layout_rows) if g]
    if len(groups) < 2:
        return None
    panels = [("position encodings", base)] if base else []
    if variants:
        panels.append(("variants, beside the rows they vary",
                       [r for r in ("goat", "rope") if r in base] + variants))
    if layout_rows:
        panels.append(("bf16 layout rows, beside float32 goat", [r for r in ("goat",) if r in base] + layout_rows))
    return panels


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

    def answer_loss(kind: str, dataset: str) -> list[str]:
        """A line under a retrieval table: each model's held-out loss on the answer digits at the
        training length, the test of whether it learned the task at all."""
        found = {j.label: results.get(j.name, {}).get("final_eval_loss") for j in jobs
                 if j.kind == kind and j.dataset == dataset}
        found = {k: v for k, v in found.items() if v is not None}
        if not found:
            return []
        return ["Held-out loss on the answer digits at the training length (the run's last evaluation, "
                f"nats per digit; a uniform guess over the 10 digits is ln 10 = {CHANCE_DIGIT_LOSS:.2f}: "
                "a row near it did not learn the task even in distribution, so its scores beyond 1x "
                "say nothing about extrapolation): " + ", ".join(f"{e} {v:.3f}" for e, v in found.items()), ""]

    md: list[str] = []
    for dataset, _ in suite.lm:
        ext = {e: {int(n): v["ppl"] for n, v in r.items()} for e, r in rows("lm", dataset, "extrapolation").items()}
        if ext:
            md += [f"## Perplexity by evaluation length ({dataset}, byte level, non-overlapping windows)", "",
                   length_table(ext, _train_len(results, "lm", dataset)), "",
                   ratio_line(ext), "",
                   *((lines + [""]) if (lines := cost_table({e: {int(n): c for n, c in r.items()} for e, r in
                                                           rows("lm", dataset, "extrapolation_cost").items()})) else []),
                   f"![perplexity](perplexity_{dataset}.png)", ""]
            plots.plot_perplexity_vs_length(ext, os.path.join(out, f"perplexity_{dataset}.png"),
                                            train_len=min(next(iter(ext.values()))),
                                            title=f"Length extrapolation ({dataset})",
                                            panels=figure_panels(list(ext), suite.layout_checks))
    for suffix, title in [("", "")] + [(f"_{v.label}", f", {v.label} variant") for v in suite.retrieval_variants]:
        pk = {e: synthetic_passkey({"passkey": r}) for e, r in rows("passkey", "passkey" + suffix, "passkey").items()}
        if pk:
            md += [f"## Synthetic passkey{title} (official GOAT variant: teacher-forced exact match of the "
                   "8-digit key)", "", length_table(pk, _train_len(results, "passkey", "passkey" + suffix), pct=True),
                   ""] + answer_loss("passkey", "passkey" + suffix) + [f"![passkey](passkey_synthetic{suffix}.png)", ""]
            plots.plot_passkey_accuracy(pk, os.path.join(out, f"passkey_synthetic{suffix}.png"),
                                        train_len=min(next(iter(pk.values()))), title=f"Synthetic passkey{title}",
                                        panels=figure_panels(list(pk), suite.layout_checks))
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
            mean = {e: niah_by_length(g) for e, g in niah.items()}
            md += [f"## Needle in a haystack{title} (synthetic; value-span token accuracy, mean over depths)", "",
                   length_table(mean, _train_len(results, "niah", "niah" + suffix), pct=True), ""]
            md += answer_loss("niah", "niah" + suffix)
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
    """Copies the toy run's prior figures (written into its workdir by the evaluation; or its
    record's copies, :func:`goat_jax.reproduce.records.run_file`) to ``out``."""
    for job in jobs:
        if job.kind != "toy":
            continue
        for name in ("toy_prior.png", "toy_prior_all_heads.png"):
            src = records.run_file(job, name)
            if os.path.exists(src):
                with open(src, "rb") as f, open(os.path.join(out, name), "wb") as dst:
                    dst.write(f.read())
