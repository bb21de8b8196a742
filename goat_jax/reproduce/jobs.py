"""Running one job of the report harness: train it (resuming, or skipping a finished run) with
a progress watcher, then evaluate it once with its family's evaluations (cached in
``WORKDIR/reproduce_eval.json``). Above the family modules, below the runner."""

from __future__ import annotations

import json
import os
import threading
import time

from goat_jax import cli
from goat_jax.config_files import load_config
from goat_jax.reproduce import dna_family, lm_family, vit_family
from goat_jax.reproduce.suites import Job, Suite
from goat_jax.train import run as run_lib
from goat_jax.train import trainer

EVAL_CACHE = "reproduce_eval.json"  # the harness's own file in a run's workdir (not the trainer's)


class _Watcher(threading.Thread):
    """Logs ``step N/M, loss, elapsed`` of a training run every ``period`` seconds by reading
    its metrics (the trainer flushes each row), so a log file shows where the suite is."""

    def __init__(self, job: Job, total: int, period: float = 30.0):
        super().__init__(daemon=True)
        self.job, self.total, self.period = job, total, period
        self.stop = threading.Event()
        self.start_time = time.time()

    def run(self):
        while not self.stop.wait(self.period):
            try:
                rows = [r for r in run_lib.read_metrics(self.job.workdir) if "train_loss" in r]
            except OSError:
                continue  # no metrics yet
            if rows:
                cli.log(f"  {self.job.name}: step {rows[-1]['step']}/{self.total}, loss "
                        f"{rows[-1]['train_loss']:.3f}, {time.time() - self.start_time:.0f}s")


def train(job: Job) -> dict:
    """Trains (or resumes / skips a finished) ``job``; returns ``{'seconds', 'summary'}``."""
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
    cli.log(f"  {job.name}: at step {summary['step']} after {time.time() - t0:.0f}s "
            f"({'train loss %.3f' % loss if loss is not None else 'already trained'})")
    return {"seconds": run_lib.training_seconds(job.workdir), "summary": summary}


_EVALUATORS = {"lm": lm_family.evaluate_lm_job, "vit": vit_family.evaluate_vit_job,
               "dna": dna_family.evaluate_dna_job}


def evaluate(job: Job, suite: Suite) -> dict:
    """The evaluations of ``job`` by its family (cached in ``WORKDIR/reproduce_eval.json``)."""
    cache = os.path.join(job.workdir, EVAL_CACHE)
    if os.path.exists(cache):
        with open(cache) as f:
            return json.load(f)
    t0 = time.time()
    out = _EVALUATORS[job.family](job, suite)
    out["eval_seconds"] = time.time() - t0
    with open(cache, "w") as f:
        json.dump(out, f, default=float)
    cli.log(f"  {job.name}: evaluated in {out['eval_seconds']:.0f}s")
    return out
