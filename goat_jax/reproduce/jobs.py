"""Running one job of the report harness: train it (resuming, or skipping a finished run) with
a progress watcher, then evaluate it once with its family's evaluations (cached in
``WORKDIR/reproduce_eval.json``). Above the family modules, below the runner."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from typing import Optional

from goat_jax import cli, files
from goat_jax.config.files import load_config
from goat_jax.reproduce import dna_family, lm_family, records, vit_family
from goat_jax.reproduce.progress import LengthProgress, finished_lengths
from goat_jax.reproduce.suites import Job, Suite
from goat_jax.train import run as run_lib
from goat_jax.train import tasks as tasks_lib
from goat_jax.train import trainer

EVAL_CACHE = "reproduce_eval.json"  # the harness's own file in a run's workdir (not the trainer's)
STOPPED_EXIT_CODE = 143  # 128 + SIGTERM: what a scheduler expects of a process it stopped


class RunStopped(RuntimeError):
    """A job's training stopped before its step count (SIGTERM, Ctrl-C or SIGHUP: the trainer
    saved a checkpoint and returned): the harness evaluates nothing of it and stops; the same
    command resumes it. ``signum``: the signal (the harness exits with 128 + it)."""

    def __init__(self, message: str, signum: int = signal.SIGTERM):
        super().__init__(message)
        self.signum = int(signum)

    def __reduce__(self):  # sent back from a job process: keep the signal
        return (type(self), (str(self), self.signum))


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
                cli.log(f"  {self.job.run_name}: step {rows[-1]['step']}/{self.total}, loss "
                        f"{rows[-1]['train_loss']:.3f}, {time.time() - self.start_time:.0f}s")


def job_config(job: Job):
    """The config ``job`` trains with: its spec and overrides, the seed moved by the job's
    seed offset (seed k of a multi-seed report trains with the config's seed + k)."""
    config = load_config(job.spec, job.overrides)
    if job.seed_offset:
        config.seed = int(config.seed) + int(job.seed_offset)
    return config


def train(job: Job) -> dict:
    """Trains (or resumes / skips a finished) ``job``; returns ``{'seconds', 'summary'}``.
    An evaluated-with row (``job.trains`` False) trains nothing: its run is another row's."""
    if not job.trains:
        return {"seconds": 0.0, "summary": {}}
    config = job_config(job)
    config.progress_bar = False  # the watcher logs instead (readable in a log file)
    t0 = time.time()
    watcher = _Watcher(job, int(config.num_train_steps))
    watcher.start()
    try:
        summary = trainer.train_and_evaluate(config, job.workdir)
    finally:
        watcher.stop.set()
    if summary.get("preempted") or int(summary.get("step", 0)) < int(config.num_train_steps):
        by = summary.get("stopped_by") or "SIGTERM"
        raise RunStopped(f"{job.run_name}: training stopped at step {summary.get('step')} of "
                         f"{int(config.num_train_steps)} ({by}: a checkpoint was saved); it is not "
                         "evaluated. The same command resumes it from that checkpoint.",
                         signum=signal.Signals[by])
    loss = summary.get("train_loss")  # absent when the run had already finished
    cli.log(f"  {job.run_name}: at step {summary['step']} after {time.time() - t0:.0f}s "
            f"({'train loss %.3f' % loss if loss is not None else 'already trained'})")
    return {"seconds": run_lib.training_seconds(job.workdir), "summary": summary}


# Per family: its evaluations of one job, ``f(job, suite, progress)``; ``progress`` (a
# :class:`~goat_jax.reproduce.progress.LengthProgress`) keeps the LM perplexity lengths one by one.
# The ViT and DNA evaluations take minutes, so they are redone whole after a kill.
_EVALUATORS = {"lm": lm_family.evaluate_lm_job,
               "vit": lambda job, suite, progress: vit_family.evaluate_vit_job(job, suite),
               "dna": lambda job, suite, progress: dna_family.evaluate_dna_job(job, suite)}
# Per family: whether a job's result enters one of its headline checks, ``f(job, suite)``
# (defined next to the checks); the runner trains these first, --status counts them apart.
FEEDS_CHECKS = {"lm": lm_family.feeds_checks, "vit": vit_family.feeds_checks, "dna": dna_family.feeds_checks}


def eval_settings(job: Job, suite: Suite) -> dict:
    """The suite settings ``job``'s evaluations depend on: a cached evaluation made with other
    settings (e.g. fewer lengths) is redone, not reported as if it had these."""
    fields = {"lm": ("multipliers", "lm_ppl_multipliers", "num_examples", "niah_examples", "niah_depths",
                     "standard_trials", "sink_examples"),
              "vit": ("vit_scales", "vit_eval_batches", "vit_canvas_scales"),
              "dna": ("dna_multipliers", "dna_max_bases", "dna_genomes", "dna_gc_windows")}[job.family]
    out = {f: getattr(suite, f) for f in fields}
    if job.kind == "lm":  # only set, so the settings of runs evaluated before these existed still match
        more = lm_family.extra_lm_settings(job, suite)
        out.update(more)
    if job.eval_overrides:
        out["eval_overrides"] = job.eval_overrides
    return json.loads(json.dumps(out, default=list))


def cache_path(job: Job) -> str:
    """The evaluation cache of ``job``: ``WORKDIR/reproduce_eval.json``, or for an
    evaluated-with row (which shares another row's workdir) ``reproduce_eval_<label>.json``."""
    name = EVAL_CACHE if job.trains else EVAL_CACHE.replace(".json", f"_{job.label}.json")
    return os.path.join(job.workdir, name)


def lengths_path(job: Job) -> str:
    """Where ``job``'s evaluation keeps the lengths it has finished while it runs
    (:class:`goat_jax.reproduce.progress.LengthProgress`): :func:`cache_path` with
    ``.lengths.json`` for ``.json``; removed once the whole evaluation is cached."""
    return cache_path(job)[:-len(".json")] + ".lengths.json"


def lengths_key(job: Job, suite: Suite, weights: dict) -> dict:
    """What the per-length results of ``job``'s evaluation depend on, the key of its
    :func:`lengths_path`: the suite's evaluation settings and the weights read."""
    return {"eval_settings": eval_settings(job, suite), "weights": weights}


def lengths_finished(job: Job, suite: Suite) -> list[int]:
    """The lengths of ``job``'s evaluation that an unfinished sitting has scored under this suite's
    settings, of the weights the run holds now (``[]`` if none): what ``--status`` shows."""
    path = lengths_path(job)
    return finished_lengths(path, lengths_key(job, suite, evaluated_weights(job))) if os.path.exists(path) else []


def evaluated_weights(job: Job) -> dict:
    """What identifies the weights an evaluation of ``job`` reads: the step of the run's newest
    complete checkpoint (the one the evaluators restore) and the seed it trained with. Stored
    with every cached evaluation; a cache made of other weights (an earlier checkpoint of a run
    stopped part way, a retrained run) is never reused."""
    steps = run_lib.checkpoint_steps(job.workdir)
    return {"checkpoint_step": int(steps[-1]) if steps else None, "seed": int(job_config(job).seed)}


def cached_evaluation(job: Job, suite: Suite, log: bool = False,
                      weights: Optional[dict] = None) -> Optional[dict]:
    """``job``'s cached evaluation (:func:`cache_path`) if it was made with this suite's settings
    (:func:`eval_settings`) of the weights the run holds now (:func:`evaluated_weights`), else
    None: no cache, one made with other settings or of other weights (e.g. of a checkpoint
    saved before the run finished), or one torn by a kill mid-write (before writes were whole).
    ``log``: say which, when there is a cache. ``weights``: :func:`evaluated_weights` of
    ``job`` when the caller has them already."""
    cache = cache_path(job)
    if not os.path.exists(cache):
        return None
    try:
        cached = files.read_json_object(cache)
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        if log:
            cli.log(f"  {job.run_name}: cached evaluation {cache} is unreadable ({e}); evaluating again")
        return None
    if cached.get("eval_settings") != eval_settings(job, suite):
        if log:
            cli.log(f"  {job.run_name}: cached evaluation made with other settings; evaluating again")
        return None
    weights = weights or evaluated_weights(job)
    if cached.get("weights") != weights:
        if log:
            cli.log(f"  {job.run_name}: cached evaluation is of other weights ({cached.get('weights')}, "
                    f"the run holds {weights}); evaluating again")
        return None
    return cached


def evaluate(job: Job, suite: Suite) -> dict:
    """The evaluations of ``job`` by its family, cached in :func:`cache_path` together with the
    settings they were made with and the weights they read (:func:`evaluated_weights`); a cache
    made with other settings, of other weights (or torn) is redone. Only a finished run is
    evaluated (:class:`RunStopped` otherwise, nothing written). The cache is written whole
    (:func:`goat_jax.files.write_whole`), and a fresh evaluation is returned exactly as a later
    read of its cache returns it (JSON's string keys, lists): a report over seeds evaluated in
    different sittings is the report of one sitting. An LM evaluation killed part way resumes at
    its first unscored length (:func:`lengths_path`; the lengths scored before are taken back,
    under the same settings and weights only)."""
    config = job_config(job)
    if not trainer.is_finished(config, job.workdir):
        steps = run_lib.checkpoint_steps(job.workdir) if os.path.isdir(job.workdir) else ()
        raise RunStopped(f"{job.run_name}: the run in {job.workdir} is not finished (newest checkpoint "
                         f"{steps[-1] if steps else 'none'} of {int(config.num_train_steps)} steps); "
                         "it is not evaluated. Run the same command without --report_only to train it.")
    weights = evaluated_weights(job)
    cached = cached_evaluation(job, suite, log=True, weights=weights)
    if cached is not None:
        return cached
    t0 = time.time()
    progress = LengthProgress(lengths_path(job), lengths_key(job, suite, weights), name=job.run_name, log=True)
    out = _EVALUATORS[job.family](job, suite, progress)
    read = out.get("step")
    if read is not None and weights["checkpoint_step"] is not None and int(read) != weights["checkpoint_step"]:
        # load_run skipped a newest checkpoint that does not restore and read an older one: those
        # are the weights of an unfinished run, so nothing is cached or reported.
        raise RuntimeError(
            f"{job.run_name}: the newest checkpoint (step {weights['checkpoint_step']}) in {job.workdir} does "
            f"not restore, and the evaluation read step {int(read)}; nothing of it is kept. Resume the run "
            f"(`python -m experiments.train --config {job.spec} --workdir {job.workdir}` with the same "
            "overrides, or the same reproduce command once the damaged step is set aside: the trainer moves "
            "it to corrupt_checkpoints/ and trains that step again), then evaluate.")
    out["eval_seconds"] = time.time() - t0 + progress.earlier_seconds()  # a resumed one: every sitting's
    out["eval_settings"] = eval_settings(job, suite)
    out["weights"] = weights
    text = json.dumps(out, default=float)
    files.write_whole(cache_path(job), text)
    progress.remove()  # the whole evaluation is cached: its lengths are in it
    cli.log(f"  {job.run_name}: evaluated in {out['eval_seconds']:.0f}s (checkpoint step {weights['checkpoint_step']})")
    return json.loads(text)


def _with_final_loss(job: Job, evaluation: dict) -> dict:
    """``evaluation`` plus ``final_eval_loss``, read from the run's metrics on every call (not
    cached with the evaluations): whether the model learned its task at all, e.g. a retrieval
    model whose answer loss stayed at chance."""
    return {**evaluation, "final_eval_loss": run_lib.last_logged(job.workdir, "eval_loss")}


def reused(job: Job, suite: Suite) -> Optional[dict]:
    """:func:`train_and_evaluate`'s result for a run that needs neither step, read without
    starting a trainer or compiling anything (a suite resumed in a later sitting re-reads its
    finished runs in seconds): a training job whose run is finished with a compatible config
    (:func:`goat_jax.train.trainer.is_finished`) and whose evaluation is cached with this
    suite's settings; an evaluated-with row likewise when the run it evaluates is finished and
    its own evaluation is cached (it trains nothing: 0 training seconds, the run's are its
    row's); failing those, a job whose run record matches (:func:`recorded`; the result then
    carries ``from_record``). None otherwise: the job then runs as usual (and the trainer names
    any incompatibility)."""
    cached = cached_evaluation(job, suite)
    if cached is None or not trainer.is_finished(job_config(job), job.workdir):
        return recorded(job, suite)
    seconds = run_lib.training_seconds(job.workdir) if job.trains else 0.0
    return {"train_seconds": seconds, "result": _with_final_loss(job, cached), "wall_seconds": 0.0}


def recorded(job: Job, suite: Suite) -> Optional[dict]:
    """``job``'s result from its run record (:func:`goat_jax.reproduce.records.read`) when the
    record was made by the config the job trains with now and with this suite's evaluation
    settings; None otherwise (or when records are off). Raises
    :class:`goat_jax.reproduce.records.UnreadableRecord` naming a record file that cannot be read."""
    if not job.record:
        return None
    config = job_config(job)
    task = tasks_lib.get_task(config.task)
    return records.read(job, config.to_dict(), eval_settings(job, suite), task.resume_safe_fields,
                        tasks_lib.field_defaults(task))


def write_record(job: Job, result: dict) -> bool:
    """Records ``result`` (what :func:`train_and_evaluate` or :func:`reused` returned) for
    ``job`` (:func:`goat_jax.reproduce.records.write`); nothing for a result read from the
    record itself, or when records are off. Returns whether a file was written."""
    if not job.record or result.get("from_record"):
        return False
    config = job_config(job).to_dict()
    try:
        return records.write(job, config, result)
    except records.UnreadableRecord as e:  # the run's own evaluation is here: it replaces the torn file, said
        cli.log(f"  {job.run_name}: run record {e.path} was unreadable ({e.reason}); replaced by the "
                f"evaluation of the run in {job.workdir}")
        return records.write(job, config, result, replace_unreadable=True)


def train_and_evaluate(job: Job, suite: Suite, log_path: str = "") -> dict:
    """Trains then evaluates ``job``: ``{'train_seconds', 'result', 'wall_seconds'}`` (this
    call's wall clock: ~0 for a reused run); ``result`` is :func:`evaluate`'s plus
    ``final_eval_loss``, the run's last logged held-out loss (None if it logged none). With ``log_path`` the
    process's stdout and stderr go to that file (a worker of ``--jobs J``: one log per job)."""
    if log_path:
        os.makedirs(os.path.dirname(log_path) or ".", exist_ok=True)
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        for stream in (1, 2):
            os.dup2(fd, stream)
        os.close(fd)
        from absl import logging as absl_logging  # pylint: disable=g-import-not-at-top  # worker only
        absl_logging.set_verbosity(absl_logging.WARNING)
    t0 = time.time()
    seconds = train(job)["seconds"]
    result = _with_final_loss(job, evaluate(job, suite))
    return {"train_seconds": seconds, "result": result, "wall_seconds": time.time() - t0}
