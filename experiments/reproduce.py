"""Reproduce the paper's language experiments at one scale: one command -> REPORT.md + figures.

    python -m experiments.reproduce --suite tiny                   # ~1 h on 2 CPU cores
    python -m experiments.reproduce --suite smoke --out /tmp/rep   # seconds: the harness end to end
    python -m experiments.reproduce --suite paper --dry_run        # the cluster commands, printed

For every position encoding (GOAT and the baselines RoPE, RoPE-PI, ALiBi, sinusoidal, NoPE, all
with the same model, steps and data) the suite trains

* a byte-level LM on the Jargon File -> perplexity at 1x..16x the training length
  (non-overlapping windows), the standard passkey prompt (greedy, KV cache), attention sinks;
* a synthetic passkey model -> teacher-forced key accuracy at 1x..16x;
* a synthetic NIAH model -> span token accuracy over lengths x depths (heatmaps);

plus the toy copy-mixture GOAT model and its prior figure, then writes ``OUT/REPORT.md`` (the
command, date, settings, the headline checks with PASS/FAIL, all tables) and its PNGs. Runs
live under ``--workdir`` and resume: re-running after an interruption retrains nothing that
finished, and evaluations are cached per run (``reproduce_eval.json``).

``--suite paper`` cannot run on a CPU: it builds the same runs with the full-scale configs
(configs/lm_c4_125m.py, configs/lm_fineweb_1b.py, configs/retrieval_tiny.py:*,paper) as shell
commands (``experiments.train`` + ``experiments.evaluate``) and runs them one after another,
or prints them with ``--dry_run`` for a cluster scheduler.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import platform
import shlex
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import Optional

ENCODINGS = ("goat", "rope", "rope_pi", "alibi", "sinusoidal", "nope")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def log(msg: str) -> None:
    """A progress line (flushed: the suite usually runs under nohup into a log file)."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ----------------------------------------------------------------------------------------------
# Suites: which configs, which overrides (identical across encodings), which evaluations
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Suite:
    """One scale of the reproduction. Config specs are ``'file.py:arg'`` with ``{enc}``
    (position encoding) and ``{task}`` (retrieval task) filled in; overrides are dotted
    config fields applied to every encoding alike."""

    name: str
    lm: tuple[tuple[str, str], ...]  # (dataset label, config spec) of the perplexity LMs
    retrieval: str  # config spec of the synthetic retrieval models
    toy: str  # config spec of the toy copy-mixture model
    lm_overrides: dict = dataclasses.field(default_factory=dict)
    retrieval_overrides: dict = dataclasses.field(default_factory=dict)
    toy_overrides: dict = dataclasses.field(default_factory=dict)
    tasks: tuple[str, ...] = ("passkey", "niah")
    multipliers: tuple[int, ...] = (1, 2, 4, 8, 16)  # evaluation lengths / training length
    num_examples: int = 64  # synthetic passkey examples per length
    niah_examples: int = 16  # NIAH examples per (length, depth) cell
    niah_depths: tuple[float, ...] = (0.1, 0.3, 0.5, 0.7, 0.9)  # official GOAT depths
    standard_trials: int = 8  # standard passkey prompts per length (greedy decoding)
    sink_examples: int = 8  # held-out windows for the sink statistics
    notes: tuple[str, ...] = ()  # how the settings were chosen, and what to read into the numbers


SUITES = {
    # Seconds: every stage of the harness on two encodings, a few steps each (the test).
    "smoke": Suite(
        name="smoke", lm=(("jargon", "configs/lm_tiny.py:{enc},smoke"),),
        retrieval="configs/retrieval_tiny.py:{task},{enc},smoke", toy="configs/toy_copy_mixture.py:smoke",
        lm_overrides={"seq_len": 32, "num_train_steps": 4, "checkpoint_every_steps": 4,
                      "data.num_eval_batches": 1},
        toy_overrides={"num_train_steps": 4, "checkpoint_every_steps": 4, "eval_every_steps": 0},
        multipliers=(1, 16), num_examples=8, niah_examples=8, niah_depths=(0.5,),
        standard_trials=2, sink_examples=2),
    # ~1 hour on 2 CPU cores. Settings chosen once for all encodings (see REPORT.md).
    "tiny": Suite(
        name="tiny", lm=(("jargon", "configs/lm_tiny.py:{enc}"),),
        retrieval="configs/retrieval_tiny.py:{task},{enc}", toy="configs/toy_copy_mixture.py",
        # Every model trains at 64 tokens, so 16x is 1024. MHA instead of lm_tiny's GQA: GOAT's
        # prior is per KV head, and 2 priors per layer cost it ~15% perplexity at this size.
        # 1000 steps: GOAT and RoPE are still improving at 600 (2-3% apart).
        lm_overrides={"seq_len": 64, "global_batch_size": 32, "model.kv_num_heads": 4,
                      "num_train_steps": 1000, "eval_every_steps": 1000, "checkpoint_every_steps": 1000},
        retrieval_overrides={},
        notes=(
            "Settings were fixed for all encodings before this run, from single probe runs (same "
            "seeds, not part of this report): with lm_tiny's GQA (2 KV heads) GOAT reached 8.9 "
            "in-distribution perplexity against RoPE's 7.6 (600 steps at 128 tokens): GOAT's prior "
            "is per KV head, so that model had only two priors per layer. With MHA the gap was "
            "7.78 vs 7.57 at 600 steps and 6.29 vs 6.27 at 1000. GQA passkey probes (800 steps) "
            "scored 0-53% (GOAT) and 0-25% (RoPE) beyond 1x; the retrieval models use MHA too, "
            "chosen from the LM probes before any MHA retrieval model was trained.",
            "Training length: at 128 tokens (1000 steps x 16) GOAT's 16x / 1x perplexity ratio "
            "was 1.00 and RoPE's 2.44, i.e. below the 3x of the RoPE claim; at 64 tokens (this "
            "run) the ratios are larger for both. The RoPE >= 3x claim holds here only at the "
            "shorter training length.",
            "GOAT's perplexity rises at 2x and then stays flat: in 256-token windows the loss is "
            "worst at positions 80-128. The sink MLP's absolute features (abs_base 10000: the "
            "0.046 rad/token feature has a period of 136 tokens) leave the range seen at 64 "
            "tokens there, and u(j) stops rising with j for some heads, so attention leaks to "
            "older keys; by position 136 the feature is back in range.",
            "The standard passkey prompt is scored zero-shot on the Jargon LMs: byte models of "
            "this size have never seen the task and score 0% at every length; the row shows the "
            "protocol running (greedy decoding with the KV cache), not a capability.",
            "RoPE-PI equals RoPE at 1x by construction (interpolation scale L / 64 = 1); beyond, "
            "it is evaluated without the fine-tuning that position interpolation relies on, so "
            "it sees positions at a resolution it never trained on.",
            "Sinusoidal trails in-distribution: its fixed encoding (unit amplitude per dimension, "
            "norm 8 at d 128) is ~35x the 0.02-scale token embeddings at init, and the model "
            "shares lm_tiny's init with every other encoding (no sqrt(d) embedding scale).",
        )),
    # The paper's scale, for a cluster: 125M on C4 and 1.23B on FineWeb, official retrieval sizes.
    "paper": Suite(
        name="paper", lm=(("c4_125m", "configs/lm_c4_125m.py:{enc}"),
                          ("fineweb_1b", "configs/lm_fineweb_1b.py:{enc}")),
        retrieval="configs/retrieval_tiny.py:{task},{enc},paper,official", toy="configs/toy_copy_mixture.py",
        num_examples=256, niah_examples=64, standard_trials=64, sink_examples=32),
}


@dataclasses.dataclass(frozen=True)
class Job:
    """One training run and the evaluations made on it."""

    kind: str  # 'lm' | 'passkey' | 'niah' | 'toy'
    dataset: str  # 'jargon', 'c4_125m', ... for LMs; the task otherwise
    encoding: str
    spec: str  # 'configs/file.py:arg'
    overrides: dict
    workdir: str

    @property
    def name(self) -> str:
        """``kind/dataset/encoding`` (what the log says)."""
        return f"{self.kind}/{self.dataset}/{self.encoding}"


def plan(suite: Suite, root: str, encodings: Sequence[str]) -> list[Job]:
    """Every run of ``suite`` for ``encodings``, in order: LMs, retrieval models, the toy."""
    jobs = []
    for dataset, spec in suite.lm:
        for enc in encodings:
            jobs.append(Job("lm", dataset, enc, spec.format(enc=enc), dict(suite.lm_overrides),
                            os.path.join(root, dataset, enc)))
    for task in suite.tasks:
        for enc in encodings:
            jobs.append(Job(task, task, enc, suite.retrieval.format(task=task, enc=enc),
                            dict(suite.retrieval_overrides), os.path.join(root, task, enc)))
    jobs.append(Job("toy", "copy_mixture", "goat", suite.toy, dict(suite.toy_overrides),
                    os.path.join(root, "toy")))
    return jobs


def load_config(spec: str, overrides: Optional[dict] = None):
    """``get_config(arg)`` of ``'configs/file.py:arg'`` (path relative to the repo root) with
    dotted ``overrides`` applied (``{'data.num_eval_batches': 1}``)."""
    path, _, arg = spec.partition(":")
    module_spec = importlib.util.spec_from_file_location(
        os.path.splitext(os.path.basename(path))[0], os.path.join(ROOT, path))
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    config = module.get_config(arg) if arg else module.get_config()
    for key, value in (overrides or {}).items():
        node = config
        *parents, leaf = key.split(".")
        for p in parents:
            node = node[p]
        if leaf not in node:
            raise ValueError(f"override {key}: {spec} has no such field.")
        node[leaf] = value
    return config


# ----------------------------------------------------------------------------------------------
# Running one job: train (with a progress watcher), then evaluate (cached)
# ----------------------------------------------------------------------------------------------


class _Watcher(threading.Thread):
    """Logs ``step N/M, loss, elapsed`` of a training run every ``period`` seconds by reading
    its metrics.jsonl (the trainer flushes each row), so a log file shows where the suite is."""

    def __init__(self, job: Job, total: int, period: float = 30.0):
        super().__init__(daemon=True)
        self.job, self.total, self.period = job, total, period
        self.stop = threading.Event()
        self.start_time = time.time()

    def run(self):
        path = os.path.join(self.job.workdir, "metrics.jsonl")
        while not self.stop.wait(self.period):
            try:
                with open(path) as f:
                    rows = [json.loads(line) for line in f if '"train_loss"' in line]
            except (OSError, json.JSONDecodeError):
                continue
            if rows:
                log(f"  {self.job.name}: step {rows[-1]['step']}/{self.total}, loss "
                    f"{rows[-1]['train_loss']:.3f}, {time.time() - self.start_time:.0f}s")


def train(job: Job) -> dict:
    """Trains (or resumes / skips a finished) ``job``; returns ``{'seconds', 'summary'}``."""
    from goat_jax.train import trainer  # pylint: disable=g-import-not-at-top

    config = load_config(job.spec, job.overrides)
    config.progress_bar = False  # the watcher logs instead (readable in a log file)
    t0 = time.time()
    watcher = _Watcher(job, int(config.num_train_steps))
    watcher.start()
    try:
        summary = trainer.train_and_evaluate(config, job.workdir)
    finally:
        watcher.stop.set()
    loss = summary.get("train_loss")  # absent when the run had already finished
    log(f"  {job.name}: at step {summary['step']} after {time.time() - t0:.0f}s "
        f"({'train loss %.3f' % loss if loss is not None else 'already trained'})")
    return {"seconds": training_seconds(job.workdir), "summary": summary}


def training_seconds(workdir: str) -> float:
    """Wall time of a run's training from its metrics.jsonl (``elapsed_s`` of the last row), so
    a report regenerated later from the workdirs still shows the original times."""
    elapsed = 0.0
    from goat_jax.train import run as run_lib  # pylint: disable=g-import-not-at-top
    with open(run_lib.metrics_path(workdir)) as f:
        for line in f:
            try:
                elapsed = max(elapsed, float(json.loads(line).get("elapsed_s") or 0.0))
            except json.JSONDecodeError:
                continue  # a line torn by a kill
    return elapsed


def evaluate(job: Job, suite: Suite) -> dict:
    """The evaluations of ``job`` (cached in ``WORKDIR/reproduce_eval.json``)."""
    from goat_jax.eval import runs as ev  # pylint: disable=g-import-not-at-top

    cache = os.path.join(job.workdir, "reproduce_eval.json")
    if os.path.exists(cache):
        with open(cache) as f:
            return json.load(f)
    t0 = time.time()
    if job.kind == "toy":
        from goat_jax.eval import toy  # pylint: disable=g-import-not-at-top
        res = toy.run_toy(load_config(job.spec, job.overrides), job.workdir, all_heads=True,
                          train=False)
        out = {"summary": res["summary"], "sink": res["checks"]["sink"],
               "diagonal": res["checks"]["diagonal"], "loss": res["loss"]}
    else:
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
    out["eval_seconds"] = time.time() - t0
    with open(cache, "w") as f:
        json.dump(out, f, default=float)
    log(f"  {job.name}: evaluated in {out['eval_seconds']:.0f}s")
    return out


# ----------------------------------------------------------------------------------------------
# The paper suite: shell commands for a cluster
# ----------------------------------------------------------------------------------------------


def paper_commands(suite: Suite, root: str, encodings: Sequence[str], out: str) -> list[str]:
    """``experiments.train`` per run, then ``experiments.evaluate`` per group of runs (all
    encodings side by side), then the toy. Override values are passed as ``--config.x=y``."""
    py = "python -m"
    cmds, groups = [], {}
    for job in plan(suite, root, encodings):
        if job.kind == "toy":
            continue
        flags = " ".join(f"--config.{k}={shlex.quote(str(v))}" for k, v in job.overrides.items())
        cmds.append(f"{py} experiments.train --config {job.spec} --workdir {job.workdir} {flags}".strip())
        groups.setdefault((job.kind, job.dataset), []).append(job)
    evals = {"lm": "extrapolation,passkey,sinks", "passkey": "passkey", "niah": "niah"}
    mults = ",".join(str(m) for m in suite.multipliers)
    for (kind, dataset), jobs in groups.items():
        dirs = " ".join(f"--workdir {j.workdir}" for j in jobs)
        cmds.append(f"{py} experiments.evaluate {dirs} --evals {evals[kind]} --multipliers {mults} "
                    f"--num_examples {suite.num_examples} --num_trials {suite.standard_trials} "
                    f"--out {os.path.join(out, dataset)}")
    cmds.append(f"{py} experiments.toy_prior --config {suite.toy} --workdir {os.path.join(root, 'toy')} "
                "--all_heads")
    return cmds


# ----------------------------------------------------------------------------------------------
# The report
# ----------------------------------------------------------------------------------------------


def headline_checks(results: dict[str, dict], encodings: Sequence[str]) -> list[tuple[str, Optional[bool], str]]:
    """The issue's acceptance numbers: ``[(claim, passed or None if not measured, numbers)]``."""
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


def _table(rows: dict[str, dict[int, float]], train_len: int, pct: bool = False) -> str:
    """Runs x lengths, each length header also given as a multiple of the training length."""
    from goat_jax.eval.runs import table  # pylint: disable=g-import-not-at-top
    return table(rows, pct=pct, first_col="encoding", header_fmt=lambda n: f"{n} ({n / train_len:g}x)")


def _git_commit() -> str:
    """The repository's HEAD commit (short), or 'unknown' outside a git checkout."""
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                       stderr=subprocess.DEVNULL, text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _train_len(results: dict[str, dict], kind: str) -> int:
    """The training length of the first evaluated run of ``kind``."""
    return next(int(r["train_len"]) for name, r in results.items()
                if name.startswith(kind + "/") and "train_len" in r)


def write_report(suite: Suite, jobs: Sequence[Job], results: dict[str, dict], out: str,
                 command: str, timings: dict[str, float], total_seconds: float) -> str:
    """Writes ``OUT/REPORT.md`` and the figures from the ``results`` of the trained ``jobs``;
    returns the markdown."""
    import numpy as np  # pylint: disable=g-import-not-at-top
    from goat_jax.eval import plots  # pylint: disable=g-import-not-at-top

    os.makedirs(out, exist_ok=True)
    encodings = list(dict.fromkeys(j.encoding for j in jobs if j.kind != "toy"))
    get = lambda kind, ds, e, key: results.get(f"{kind}/{ds}/{e}", {}).get(key)
    md = [f"# GOAT language experiments, `{suite.name}` suite", "",
          f"Command: `{command}`  ", f"Date: {time.strftime('%Y-%m-%d %H:%M %Z')}  ",
          f"Code: git {_git_commit()}  ",
          f"Machine: {platform.machine()}, {os.cpu_count()} CPU cores (shared), no accelerator  ",
          f"Compute: {sum(timings.values()) / 60:.1f} min over all stages (training "
          f"{sum(v for k, v in timings.items() if k.startswith('train')) / 60:.1f} min); this invocation "
          f"took {total_seconds / 60:.1f} min (finished runs and cached evaluations are reused)", ""]
    md += ["## Setup (identical across position encodings)", ""]
    for kind in dict.fromkeys(j.kind for j in jobs):
        job = next(j for j in jobs if j.kind == kind)
        with open(os.path.join(job.workdir, "config.json")) as f:  # what actually ran
            c = json.load(f)
        m = c["model"]
        md.append(f"* **{kind}**: `{job.spec}`{' + ' + str(job.overrides) if job.overrides else ''}: "
                  f"{m['num_layers']} layer(s), d {m['embed_dim']}, {m['num_heads']} heads "
                  f"({m['kv_num_heads']} KV), {c['num_train_steps']} steps x {c['global_batch_size']} "
                  f"x {c['seq_len']} tokens, peak lr {c['optimizer']['learning_rate']}")
    md.append("")

    checks = headline_checks(results, encodings)
    md += ["## Headline checks", "", "| claim | result | numbers |", "|---|---|---|"]
    for claim, ok, numbers in checks:
        md.append(f"| {claim} | {'PASS' if ok else ('not measured' if ok is None else '**FAIL**')} | {numbers} |")
    md.append("")
    if suite.notes:
        md += ["## Notes", ""] + [f"* {n}" for n in suite.notes] + [""]

    for dataset, _ in suite.lm:
        ext = {e: get("lm", dataset, e, "extrapolation") for e in encodings}
        ext = {e: {int(n): v["ppl"] for n, v in r.items()} for e, r in ext.items() if r}
        if ext:
            md += [f"## Perplexity by evaluation length ({dataset}, byte level, non-overlapping windows)", "",
                   _table(ext, _train_len(results, "lm")), "",
                   "Ratio to the in-distribution (1x) perplexity: " + ", ".join(
                       f"{e} {r[max(r)] / r[min(r)]:.2f}" for e, r in ext.items()), "",
                   f"![perplexity](perplexity_{dataset}.png)", ""]
            plots.plot_perplexity_vs_length(ext, os.path.join(out, f"perplexity_{dataset}.png"),
                                            train_len=min(next(iter(ext.values()))),
                                            title=f"Length extrapolation ({dataset})")
    pk = {e: get("passkey", "passkey", e, "passkey") for e in encodings}
    pk = {e: {int(n): a for n, a in r["synthetic"].items()} for e, r in pk.items() if r}
    if pk:
        md += ["## Synthetic passkey (official GOAT variant: teacher-forced exact match of the 8-digit key)", "",
               _table(pk, _train_len(results, "passkey"), pct=True), "", "![passkey](passkey_synthetic.png)", ""]
        plots.plot_passkey_accuracy(pk, os.path.join(out, "passkey_synthetic.png"),
                                    train_len=min(next(iter(pk.values()))), title="Synthetic passkey")
    std = {e: (get("lm", suite.lm[0][0], e, "passkey") or {}).get("standard") for e in encodings}
    std = {e: {int(n): a for n, a in r.items()} for e, r in std.items() if r}
    if std:
        md += ["## Standard passkey prompt (greedy decoding with the KV cache; zero-shot on the LMs above)", "",
               _table(std, _train_len(results, "lm"), pct=True), ""]
    niah = {e: get("niah", "niah", e, "niah") for e in encodings}
    niah = {e: g for e, g in niah.items() if g}
    if niah:
        mean = {e: dict(zip([int(n) for n in g["lengths"]], np.mean(g["token_accuracy"], axis=1)))
                for e, g in niah.items()}
        md += ["## Needle in a haystack (synthetic; value-span token accuracy, mean over depths)", "",
               _table(mean, _train_len(results, "niah"), pct=True), ""]
        for e, g in niah.items():
            plots.plot_niah_heatmap({k: np.asarray(v) for k, v in g.items()},
                                    os.path.join(out, f"niah_{e}.png"), title=f"NIAH, {e}")
        md += [" ".join(f"![niah {e}](niah_{e}.png)" for e in niah), ""]
    sk = {e: get("lm", suite.lm[0][0], e, "sinks") for e in encodings}
    sk = {e: s for e, s in sk.items() if s}
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
    md += ["## Run times", "", "| stage | seconds |", "|---|---|"]
    md += [f"| {k} | {v:.0f} |" for k, v in timings.items()]
    md.append("")
    text = "\n".join(md)
    with open(os.path.join(out, "REPORT.md"), "w") as f:
        f.write(text)
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(results, f, indent=1, default=float)
    return text


# ----------------------------------------------------------------------------------------------
# Entry point
# ----------------------------------------------------------------------------------------------


def main(argv: Optional[Sequence[str]] = None) -> int:
    """CLI: runs (or prints) a suite; returns the process exit code."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--suite", choices=sorted(SUITES), default="tiny")
    p.add_argument("--workdir", default=None, help="runs root (default runs/reproduce_<suite>)")
    p.add_argument("--out", default=None, help="report dir (default reports/<suite>)")
    p.add_argument("--encodings", default=None,
                   help=f"comma list (default: {','.join(ENCODINGS)}; smoke: goat,rope)")
    p.add_argument("--dry_run", action="store_true", help="print the commands, run nothing")
    args = p.parse_args(argv)
    suite = SUITES[args.suite]
    encodings = (args.encodings.split(",") if args.encodings
                 else (["goat", "rope"] if suite.name == "smoke" else list(ENCODINGS)))
    root = args.workdir or os.path.join("runs", f"reproduce_{suite.name}")
    out = args.out or os.path.join("reports", suite.name)
    command = "python -m experiments.reproduce " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))

    if suite.name == "paper" or args.dry_run:
        cmds = paper_commands(suite, root, encodings, out) if suite.name == "paper" else [
            f"# in-process: train + evaluate {j.name} ({j.spec}, overrides {j.overrides}) in {j.workdir}"
            for j in plan(suite, root, encodings)]
        if args.dry_run:
            if suite.name == "paper":  # sizes, budgets and departures from the official recipes
                from experiments import paper_table  # pylint: disable=g-import-not-at-top
                print(paper_table.render(paper_table.rows(plan(suite, root, encodings), load_config)))
            print("\n".join(cmds))
            return 0
        for cmd in cmds:
            log(f"$ {cmd}")
            rc = subprocess.call(cmd, shell=True, cwd=ROOT)
            if rc:
                log(f"failed with exit code {rc}: {cmd}")
                return rc
        return 0

    from absl import logging as absl_logging  # pylint: disable=g-import-not-at-top
    absl_logging.set_verbosity(absl_logging.WARNING)  # orbax INFO lines would drown the progress log
    t_start = time.time()
    jobs = plan(suite, root, encodings)
    log(f"suite {suite.name}: {len(jobs)} runs under {root}, report in {out}")
    results, timings = {}, {}
    for i, job in enumerate(jobs):
        log(f"[{i + 1}/{len(jobs)}] {job.name}: {job.spec} {job.overrides or ''}")
        timings[f"train {job.name}"] = train(job)["seconds"]
        results[job.name] = evaluate(job, suite)
        timings[f"eval {job.name}"] = results[job.name]["eval_seconds"]
        log(f"  elapsed {(time.time() - t_start) / 60:.1f} min")
    toy = next(j for j in jobs if j.kind == "toy")
    os.makedirs(out, exist_ok=True)
    for name in ("toy_prior.png", "toy_prior_all_heads.png"):
        if os.path.exists(os.path.join(toy.workdir, name)):
            with open(os.path.join(toy.workdir, name), "rb") as src, open(os.path.join(out, name), "wb") as dst:
                dst.write(src.read())
    text = write_report(suite, jobs, results, out, command, timings, time.time() - t_start)
    log(f"wrote {os.path.join(out, 'REPORT.md')} after {(time.time() - t_start) / 60:.1f} min")
    print(text.split("## Headline checks")[1].split("\n## ")[0] if "## Headline checks" in text else "")
    return 0


if __name__ == "__main__":
    from goat_jax import cli  # pylint: disable=g-import-not-at-top
    sys.exit(cli.run(main))  # config and input errors: one line (GOAT_DEBUG=1: traceback)
