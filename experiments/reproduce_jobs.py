"""Running one job of ``experiments.reproduce``: train it (resuming or skipping a finished run)
with a progress watcher, then evaluate it once (cached in ``WORKDIR/reproduce_eval.json``), and
read its training time and throughput back from its metrics.jsonl."""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Optional

from experiments.reproduce import Job, Suite, load_config, log


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


def train_rate(workdir: str) -> Optional[float]:
    """Median training throughput of a run from its metrics.jsonl (``tokens_per_sec``: tokens/s
    for language and genome models, images/s for ViTs), or None when no row has it."""
    from goat_jax.train import run as run_lib  # pylint: disable=g-import-not-at-top
    rates = []
    with open(run_lib.metrics_path(workdir)) as f:
        for line in f:
            try:
                rate = json.loads(line).get("tokens_per_sec")
            except json.JSONDecodeError:
                continue  # a line torn by a kill
            if rate:
                rates.append(float(rate))
    return float(sorted(rates)[len(rates) // 2]) if rates else None


def evaluate(job: Job, suite: Suite) -> dict:
    """The evaluations of ``job`` (cached in ``WORKDIR/reproduce_eval.json``)."""
    from experiments import report_lm  # pylint: disable=g-import-not-at-top

    cache = os.path.join(job.workdir, "reproduce_eval.json")
    if os.path.exists(cache):
        with open(cache) as f:
            return json.load(f)
    t0 = time.time()
    if job.kind == "vit":
        from experiments import report_vision  # pylint: disable=g-import-not-at-top
        out = report_vision.evaluate_vit_job(job, suite)
    elif job.kind == "dna":
        from experiments import report_dna  # pylint: disable=g-import-not-at-top
        out = report_dna.evaluate_dna_job(job, suite)
    else:
        out = report_lm.evaluate_lm_job(job, suite)
    out["eval_seconds"] = time.time() - t0
    with open(cache, "w") as f:
        json.dump(out, f, default=float)
    log(f"  {job.name}: evaluated in {out['eval_seconds']:.0f}s")
    return out
