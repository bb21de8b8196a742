"""Where a suite stands, without training or evaluating anything: every planned run's state
(what ``python -m experiments.reproduce --status`` prints), counted per family and seed, with the
compute still to go estimated from the runs that finished.

A suite such as ``tiny`` with 3 seeds is ~15 h of 2 CPU cores, run in several sittings: the same
command reuses finished runs and resumes killed ones, and this view says how far it got. Sits
above :mod:`goat_jax.reproduce.jobs` (it reads the same workdirs and evaluation caches) and
below the runner.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
from collections.abc import Sequence
from typing import Optional

from goat_jax.reproduce import jobs as jobs_lib
from goat_jax.reproduce import records as records_lib
from goat_jax.reproduce.suites import FAMILIES, Job, Suite
from goat_jax.train import run as run_lib
from goat_jax.train import trainer

# A run's state, in order of progress: evaluated with this suite's settings / trained to its last
# step, evaluation missing or made with other settings / a checkpoint before the last step /
# a workdir without a checkpoint (killed before its first save, or training now) / nothing yet.
# An evaluated-with row (it trains nothing) is 'waiting' while the run it reads is unfinished.
# 'changed': trained to its last step by a config the job's is not compatible with (the suite or
# a config file changed since); the next invocation's trainer refuses it and says why.
STATES = ("done", "trained", "partial", "started", "missing", "waiting", "changed")


@dataclasses.dataclass(frozen=True)
class RunState:
    """One planned run: ``state`` (one of :data:`STATES`), its newest checkpoint ``step`` of
    ``total`` training steps, and for a finished run the seconds its training and evaluation
    took (``train_seconds``, ``eval_seconds``; None when not done)."""

    job: Job
    state: str
    step: int = 0
    total: int = 0
    train_seconds: Optional[float] = None
    eval_seconds: Optional[float] = None
    lengths_scored: tuple[int, ...] = ()  # a trained run: the lengths its unfinished evaluation scored
    unreadable_record: Optional[str] = None  # its run record exists but cannot be read (the message)


def run_state(job: Job, suite: Suite) -> RunState:
    """The :class:`RunState` of ``job`` read from its workdir (read-only), or from its run
    record when the workdir has no finished run and the record matches (what the harness reuses:
    :func:`goat_jax.reproduce.jobs.reused`)."""
    config = jobs_lib.job_config(job)
    total = int(config.num_train_steps)
    try:
        rec = jobs_lib.recorded(job, suite)
    except records_lib.UnreadableRecord as e:  # the state is the workdir's; the record is named apart
        state = run_state(dataclasses.replace(job, record=None), suite)
        return dataclasses.replace(state, job=job, unreadable_record=str(e))
    if rec is not None and not trainer.is_finished(config, job.workdir):
        return RunState(job, "done", total, total, train_seconds=rec["train_seconds"] if job.trains else 0.0,
                        eval_seconds=float(rec["result"].get("eval_seconds", 0.0)))
    steps = run_lib.checkpoint_steps(job.workdir) if os.path.exists(run_lib.config_path(job.workdir)) else ()
    step = steps[-1] if steps else 0
    cached = jobs_lib.cached_evaluation(job, suite)
    # The same test the harness makes before reusing a run (jobs.reused): last step reached by a
    # compatible config, so 'done' here is what the next invocation skips.
    finished = step >= total and trainer.is_finished(config, job.workdir)
    if step >= total and not finished:
        state = "changed"
    elif not job.trains:  # an evaluated-with row: its run is another row's
        state = "done" if cached else ("trained" if finished else "waiting")
    elif cached and finished:
        state = "done"
    elif finished:
        state = "trained"
    elif step:
        state = "partial"
    else:
        state = "started" if os.path.isdir(job.workdir) else "missing"
    done = state == "done"
    return RunState(job, state, step, total,
                    train_seconds=run_lib.training_seconds(job.workdir) if done and job.trains else (0.0 if done else None),
                    eval_seconds=float(cached.get("eval_seconds", 0.0)) if done else None,
                    lengths_scored=tuple(jobs_lib.lengths_finished(job, suite)) if state == "trained" else ())


def _to_evaluate(s: RunState) -> str:
    """'trained, to evaluate', with the lengths an unfinished evaluation of it has scored."""
    if not s.lengths_scored:
        return "trained, to evaluate"
    return (f"trained, evaluation part done ({len(s.lengths_scored)} length(s) scored, up to "
            f"{max(s.lengths_scored)} tokens; an evaluation of it takes them back)")


def remaining_seconds(states: Sequence[RunState]) -> tuple[float, list[str]]:
    """Compute still to go, in seconds of one job slot: per unfinished run, the median train and
    evaluation seconds of the finished seeds of its own row (``Job.name``) when it has any, else
    of the finished runs of its kind and dataset (``Job.kind``/``dataset``, e.g. every
    ``lm/jargon`` row), the training scaled by the fraction of steps left. Medians, not means:
    on a shared machine a run that had the test suite beside it took several times longer, and
    a row's own seeds carry what sets it apart (a materialized-bias row's long evaluation).
    Returns the total and the kind/dataset groups that have no finished run to estimate from
    (left out)."""
    finished: dict[tuple[str, str, bool], list[RunState]] = {}
    by_row: dict[tuple[str, bool], list[RunState]] = {}
    for s in states:
        if s.state == "done":
            finished.setdefault((s.job.kind, s.job.dataset, s.job.trains), []).append(s)
            by_row.setdefault((s.job.name, s.job.trains), []).append(s)
    total, unknown = 0.0, []
    for s in states:
        if s.state == "done":
            continue
        group = by_row.get((s.job.name, s.job.trains)) or finished.get((s.job.kind, s.job.dataset, s.job.trains))
        if not group:
            name = f"{s.job.kind}/{s.job.dataset}" + ("" if s.job.trains else " (evaluated-with rows)")
            if name not in unknown:
                unknown.append(name)
            continue
        train = statistics.median(g.train_seconds or 0.0 for g in group)
        evaluate = statistics.median(g.eval_seconds or 0.0 for g in group)
        left = 1.0 - (s.step / s.total if s.total and s.state == "partial" else 0.0)
        total += (train * left if s.state in ("partial", "started", "missing") else 0.0) + evaluate
    return total, unknown


def render(states: Sequence[RunState], suite: Suite, root: str, seeds: int, jobs: int = 1) -> str:
    """The status text for ``suite``'s runs: a table of states per family and seed, the
    unfinished runs with their progress, how many of the runs the headline checks read are done,
    and the estimate of :func:`remaining_seconds` (divided by ``jobs`` at once)."""
    lines = [f"suite {suite.name}: {len(states)} runs ({seeds} seed(s)) under {root}", "",
             "| family | seed | " + " | ".join(STATES) + " |", "|---|---|" + "---|" * len(STATES)]
    groups: dict[tuple[str, int], dict[str, int]] = {}
    for s in states:
        counts = groups.setdefault((s.job.family, s.job.seed_offset), dict.fromkeys(STATES, 0))
        counts[s.state] += 1
    order = {f: i for i, f in enumerate(FAMILIES)}
    for (family, seed), counts in sorted(groups.items(), key=lambda kv: (kv[0][1], order[kv[0][0]])):
        lines.append(f"| {family} | +{seed} | " + " | ".join(str(counts[k]) for k in STATES) + " |")
    unfinished = [s for s in states if s.state in ("trained", "partial", "started", "changed")]
    if unfinished:
        lines += ["", "In progress:"] + [
            f"  {s.job.run_name}: " + {"trained": _to_evaluate(s), "partial": f"partial (step {s.step}/{s.total})",
                                       "started": "started, no checkpoint yet",
                                       "changed": f"trained by another config than the job's (in {s.job.workdir}: "
                                                  "move it away to retrain, or restore the config)"}[s.state]
            for s in unfinished]
    missing: dict[str, list[str]] = {}  # what a report still lacks, by row: run name -> seeds
    for s in states:
        if s.state in ("missing", "waiting"):
            missing.setdefault(s.job.name, []).append(f"+{s.job.seed_offset}")
    if missing:
        lines += ["", "Not started (by row; the seeds it lacks; 'waiting': an evaluated-with row whose run is not "
                  "finished):"] + [f"  {name}: seeds {' '.join(seeds)}" for name, seeds in missing.items()]
    unreadable = [s for s in states if s.unreadable_record]
    if unreadable:  # the harness runs none of these until the file is restored or moved aside
        lines += ["", "Unreadable run records (the harness neither reuses nor overwrites them; each job is "
                  "reported FAILED until its file is restored or moved aside):"] + [
            f"  {s.job.run_name}: {s.unreadable_record}" for s in unreadable]
    feeding = [s for s in states if jobs_lib.FEEDS_CHECKS[s.job.family](s.job, suite)]
    if feeding:  # what the verdicts wait for: these train first (goat_jax/reproduce/runner.py)
        per: dict[str, list[int]] = {}
        for s in feeding:
            counts = per.setdefault(s.job.family, [0, 0])
            counts[0] += s.state == "done"
            counts[1] += 1
        lines += ["", "Runs the headline checks read (trained first): "
                  + ", ".join(f"{f} {d} of {n} done" for f, (d, n) in per.items())]
    left, unknown = remaining_seconds(states)
    done = sum(s.state == "done" for s in states)
    lines += ["", f"{done} of {len(states)} runs done; still to go"
              + (" for the kinds with a finished run" if unknown else "")
              + f": ~{left / 3600:.1f} h of one job slot"
              + (f", ~{left / 3600 / jobs:.1f} h with {jobs} jobs at once" if jobs > 1 else "")
              + " (medians of the finished runs' own train/eval times: the row's other seeds, else its kind's)"]
    if unknown:
        lines.append("  not counted (no finished run of that kind yet; docs/experiments.md, 'Compute of "
                     "the tiny suite', has measured costs): " + ", ".join(unknown))
    return "\n".join(lines)
