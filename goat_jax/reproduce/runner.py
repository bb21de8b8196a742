"""One invocation of the report harness (what ``python -m experiments.reproduce`` calls): pick
the suite's runs, train and evaluate each (resuming; evaluations cached), write the report; or,
for the paper suite and ``dry_run``, print or run the shell commands instead.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Iterator, Sequence
from typing import Optional

import jax

from goat_jax import _extras
with _extras.imports(__name__):  # optional packages: one-line error naming the extra
    from absl import logging as absl_logging
from goat_jax import cli, files
from goat_jax.models import lm, vit
from goat_jax.reproduce import guard
from goat_jax.reproduce import jobs as jobs_lib
from goat_jax.reproduce import lm_family, paper, paper_table, report, stats
from goat_jax.reproduce import status as status_lib
from goat_jax.reproduce import records as records_lib
from goat_jax.reproduce import workers
from goat_jax.reproduce.suites import FAMILIES, FAMILY_TITLES, ROOT, SUITES, Job, Suite, plan
from goat_jax.train import interrupts
from goat_jax.train import lock as lock_lib
from goat_jax.train import trainer


def select_retrieval_variants(suite: Suite, labels: Optional[Sequence[str]]) -> Suite:
    """``suite`` with only the retrieval variants named in ``labels`` (None: all of them; an
    empty list or ['none']: none); ValueError naming the suite's variants for an unknown one."""
    if labels is None:
        return suite
    wanted = [v for v in labels if v and v != "none"]
    known = [v.label for v in suite.retrieval_variants]
    if set(wanted) - set(known):
        raise ValueError(f"--retrieval_variants {','.join(labels)}: suite {suite.name!r} has "
                         f"{', '.join(known) or 'none'}; give some of them or 'none'.")
    return dataclasses.replace(suite, retrieval_variants=tuple(
        v for v in suite.retrieval_variants if v.label in wanted))


def check_encodings(encodings: Optional[Sequence[str]], vit_encodings: Optional[Sequence[str]],
                    dna_encodings: Optional[Sequence[str]]) -> None:
    """Refuses an unknown name in ``--encodings`` / ``--dna_encodings`` (the language model's
    position encodings) or ``--vit_encodings`` (the ViT's), naming the flag and the choices."""
    for flag, values, allowed in (("--encodings", encodings, lm.POSITION_ENCODINGS),
                                  ("--vit_encodings", vit_encodings, vit.POSITION_ENCODINGS),
                                  ("--dna_encodings", dna_encodings, lm.POSITION_ENCODINGS)):
        unknown = [x for x in (values or []) if x and x not in allowed]
        if unknown:
            raise ValueError(f"{flag} {','.join(values)}: unknown encoding(s) {unknown}; choose from "
                             f"{','.join(allowed)}.")


def reproduce(suite_name: str, *, command: str, workdir: Optional[str] = None, out: Optional[str] = None,
              families: Sequence[str] = FAMILIES, encodings: Optional[Sequence[str]] = None,
              vit_encodings: Optional[Sequence[str]] = None, dna_encodings: Optional[Sequence[str]] = None,
              retrieval_variants: Optional[Sequence[str]] = None, dry_run: bool = False,
              seeds: Optional[int] = None, jobs: int = 1, status: bool = False,
              report_only: bool = False, compilation_cache: Optional[str] = None,
              records: Optional[str] = None) -> int:
    """Runs (or prints) suite ``suite_name``'s ``families``; returns the process exit code.

    ``workdir``: the runs root (default ``runs/reproduce_<suite>``); ``out``: the report
    directory (default ``reports/<suite>``); encodings default to the suite's; ``command`` is
    the command line written into the report. ``seeds``: trains per run (default the suite's
    ``seeds``; seed = the config's + k); ``jobs``: training jobs run at once in subprocesses
    (1: one after another in this process). Exit code 1 when a job failed (the others are
    reported). ``status``: print where the suite's runs stand (goat_jax/reproduce/status.py) and
    the compute still to go, training and writing nothing. ``report_only``: write the report
    from the runs finished and evaluated so far, training and evaluating nothing (the runs left
    out are listed in it; every number is over the seeds its row has). ``compilation_cache``:
    see :func:`use_compilation_cache` (default ``<workdir>/xla_cache``, 'none' for off).
    ``records``: the run records' folder (goat_jax/reproduce/records.py; default ``<out>/runs``,
    'none' for off): every evaluated run is recorded there, and a run whose workdir is gone is
    reused from a record made by its current config and evaluation settings.
    """
    if suite_name not in SUITES:
        raise ValueError(f"--suite {suite_name}: choose from {', '.join(sorted(SUITES))}.")
    suite = select_retrieval_variants(SUITES[suite_name], retrieval_variants)
    check_encodings(encodings, vit_encodings, dna_encodings)  # --dry_run too: not when a job is reached
    if not families:
        raise ValueError(f"--families is empty; give some of {','.join(FAMILIES)}.")
    encodings = list(encodings or suite.encodings)
    seeds = suite.seeds if seeds is None else int(seeds)
    if seeds < 1:
        raise ValueError(f"--seeds {seeds}: give 1 or more.")
    if int(jobs) < 1:
        raise ValueError(f"--jobs {jobs}: give 1 or more (training jobs run at once).")
    plan_kwargs = {"families": list(families), "vit_encodings": vit_encodings, "dna_encodings": dna_encodings}
    root = workdir or os.path.join("runs", f"reproduce_{suite.name}")
    out = out or os.path.join("reports", suite.name)

    if suite.name == "paper" or dry_run:
        cmds = paper.paper_commands(suite, root, encodings, out, **plan_kwargs) if suite.name == "paper" else [
            f"# in-process: {'train + ' if j.trains else ''}evaluate {j.run_name} ({j.spec}, overrides "
            f"{j.overrides}{', evaluated with ' + str(j.eval_overrides) if j.eval_overrides else ''}) in {j.workdir}"
            for j in plan(suite, root, encodings, seeds=seeds, **plan_kwargs)]
        if dry_run:
            if suite.name == "paper":  # sizes, budgets and departures from the official recipes
                # The language runs: paper_table holds the official language recipes only.
                print(paper_table.render(paper_table.rows(plan(suite, root, encodings, families=["lm"]))))
            print("\n".join(cmds))
            return 0
        for cmd in cmds:
            cli.log(f"$ {cmd}")
            rc = run_command(cmd)
            if rc:
                cli.log(f"failed with exit code {rc}: {cmd}")
                return rc
        return 0

    absl_logging.set_verbosity(absl_logging.WARNING)  # orbax INFO lines would drown the progress log
    t_start = time.time()
    records_root = None if records == "none" else (records or os.path.join(out, "runs"))
    all_jobs = records_lib.attach(plan(suite, root, encodings, seeds=seeds, **plan_kwargs), root, records_root)
    if not all_jobs:
        raise ValueError(f"--families {','.join(families)}: suite {suite.name!r} has no runs there.")
    if not status:  # before any run trains: a report that cannot be written is known now
        files.check_writable(out, "--out")
        if records_root:
            files.check_writable(records_root, "--records")
        if not report_only:
            files.check_writable(root, "--workdir")
    if status:
        absl_logging.set_verbosity(absl_logging.ERROR)  # orbax warns about every read-only checkpoint
        print(status_lib.render([status_lib.run_state(j, suite) for j in all_jobs], suite, root,
                                seeds, int(jobs)))
        return 0
    # One training harness per runs root and report folder (goat_jax/reproduce/guard.py); refused here, in one line.
    with (contextlib.nullcontext() if report_only else guard.hold_harness(root, out)):
        return _run_and_report(suite, all_jobs, root, out, records_root, families, seeds, int(jobs), report_only,
                               compilation_cache, command, t_start)


def _run_and_report(suite: Suite, all_jobs: Sequence[Job], root: str, out: str, records_root: Optional[str],
                    families: Sequence[str], seeds: int, jobs: int, report_only: bool,
                    compilation_cache: Optional[str], command: str, t_start: float) -> int:
    """:func:`reproduce` past its checks: trains and evaluates ``all_jobs`` (``report_only``:
    reads the finished ones) and writes the report; returns the exit code. A stop signal
    (SIGTERM, Ctrl-C, SIGHUP) stops it after the running trainers save, writes no report and
    returns 128 + the signal's number."""
    cache = None if report_only else use_compilation_cache(compilation_cache, root)  # report_only compiles nothing
    cli.log(f"suite {suite.name}: {len(all_jobs)} runs ({seeds} seed(s)) under {root}, report in {out}"
            + (f", records in {records_root}" if records_root else "")
            + (f", {jobs} at once" if jobs > 1 else "") + (f"; XLA compilation cache {cache}" if cache else ""))
    try:
        with interrupts.raise_on_stop():  # between trainings (a trainer takes the signals while it runs)
            raw, timings, failed, held = run_jobs(all_jobs, suite, jobs, t_start, families, train=not report_only)
    except (jobs_lib.RunStopped, interrupts.Stopped) as e:  # saved, nothing unfinished evaluated
        signum = getattr(e, "signum", signal.SIGTERM)
        cli.log(f"stopped: {e}")
        cli.log("no report written; the same command resumes every stopped run from its checkpoint"
                + (" and every evaluation from its last finished length" if isinstance(e, interrupts.Stopped) else ""))
        return interrupts.exit_code(signum)
    unfinished = [j.run_name for j in all_jobs if j.run_name not in raw and j.run_name not in failed]
    if report_only and not raw:
        raise ValueError(f"--report_only: none of the {len(all_jobs)} planned runs under {root} has finished "
                         "and been evaluated; run without --report_only first (--status shows where they stand).")
    # The report: one row per (kind, dataset, label) from seed 0's job, its numbers aggregated
    # over the seeds that finished (a failed seed leaves the others' estimate, and is listed).
    rows = [j for j in all_jobs if j.seed_offset == 0]
    results = {}
    for job in rows:
        done = sorted((j for j in all_jobs if j.name == job.name and j.run_name in raw), key=lambda j: j.seed_offset)
        if done:  # every number an Estimate over these seeds, paired with others by seed
            results[job.name] = stats.aggregate([raw[j.run_name] for j in done], [j.seed_offset for j in done])
    per_seed_results = {j.run_name: {"seed_offset": j.seed_offset, **raw[j.run_name]}
                        for j in all_jobs if j.run_name in raw}
    with guard.report_writing(out):  # one report writer at a time (another harness's --report_only)
        dest = _report_folder(out, rows, all_jobs, per_seed_results)
        lm_family.copy_toy_figures(rows, dest)
        report.write_report(suite, rows, results, dest, command, timings, time.time() - t_start,
                            per_seed=per_seed_results, failed=failed, seeds=seeds, unfinished=unfinished)
    cli.log(f"wrote {os.path.join(dest, 'REPORT.md')} after {(time.time() - t_start) / 60:.1f} min")
    for family in dict.fromkeys(j.family for j in rows):  # this invocation's verdicts, for the log
        with open(os.path.join(dest, "sections", f"{family}.md")) as f:
            part = f.read().split("### Headline checks", 1)[-1]
        print(f"{FAMILY_TITLES[family]}: headline checks" + part.split("\n### ", 1)[0])
    for name, holder in held.items():
        cli.log(f"not run (held by another process) {name}: {holder}")
    for name, error in failed.items():
        cli.log(f"FAILED {name}: {error}")
    return 1 if failed else 0


def _report_folder(out: str, rows: Sequence[Job], all_jobs: Sequence[Job], per_seed: dict) -> str:
    """Where this invocation's report goes: ``out``, unless the report there holds runs (still
    planned, of the families written now) that this one lacks: then ``out/partial`` (emptied
    first), and the fuller report stays (:func:`goat_jax.reproduce.guard.lacking_runs`; an
    unreadable ``results.json`` counts as fuller). Says which in the log."""
    families = {j.family for j in rows}
    try:
        lacking = guard.lacking_runs(out, families, [j.run_name for j in all_jobs], per_seed)
        why = (f"it reports {len(lacking)} run(s) this invocation has no result for ("
               + ", ".join(lacking[:4]) + (", ..." if len(lacking) > 4 else "") + ")") if lacking else ""
    except ValueError as e:  # an unreadable results.json: nothing to compare with, nothing replaced
        why = f"{e}, so this invocation cannot tell whether its report is fuller"
    if not why:
        return out
    dest = os.path.join(out, guard.PARTIAL)
    shutil.rmtree(dest, ignore_errors=True)
    cli.log(f"kept the report in {out}: {why}; this invocation's report is {dest}/REPORT.md")
    return dest


def run_command(cmd: str) -> int:
    """Runs the shell command ``cmd`` (a ``--suite paper`` step) from the repository root in a
    process group of its own and returns its exit code. A stop signal to the harness (SIGTERM,
    Ctrl-C, SIGHUP) is passed to the whole group as SIGTERM, so the command's trainer saves a
    checkpoint and ends (it used to keep running, orphaned, when the harness was killed); the
    harness then returns 128 + the signal's number, having waited for it."""
    proc = subprocess.Popen(cmd, shell=True, cwd=ROOT, start_new_session=True)
    try:
        with interrupts.raise_on_stop():
            return proc.wait()
    except interrupts.Stopped as e:
        cli.log(f"{interrupts.name(e.signum)}: stopping `{cmd}` (SIGTERM: its trainer saves a checkpoint); "
                "the same command resumes")
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        proc.wait()
        deadline = time.time() + 600  # the shell may end first: wait for the group's trainer to save
        while time.time() < deadline:
            try:
                os.killpg(proc.pid, 0)
            except (ProcessLookupError, PermissionError):
                break
            time.sleep(0.1)
        return interrupts.exit_code(e.signum)


def use_compilation_cache(folder: Optional[str], root: str) -> Optional[str]:
    """Points JAX's persistent compilation cache at ``folder`` (None: ``<root>/xla_cache``;
    'none': off) for this process and every job process it starts (they inherit the
    environment), unless ``JAX_COMPILATION_CACHE_DIR`` is already set, which is kept. A run's
    programs do not depend on its seed (the seed is data), so seeds k > 0 and re-evaluations load
    the executables seed 0 compiled: the same compiled code, not a recompile. Returns the folder
    in use (None when off)."""
    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return os.environ["JAX_COMPILATION_CACHE_DIR"]
    if folder == "none":
        return None
    folder = os.path.abspath(folder or os.path.join(root, "xla_cache"))
    os.makedirs(folder, exist_ok=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = folder
    jax.config.update("jax_compilation_cache_dir", folder)  # this process (--jobs 1), if nothing compiled yet
    return folder


class _StopEvent(threading.Event):
    """A :class:`threading.Event` that also keeps the signal that set it (``signum``)."""

    signum: Optional[int] = None


@contextlib.contextmanager
def _sigterm_event() -> Iterator[_StopEvent]:
    """While the block runs, a stop signal to the harness (SIGTERM: ``kill PID``, a scheduler's
    preemption; SIGINT: Ctrl-C; SIGHUP unless ignored) sets the event yielded (its ``signum`` the
    first signal), and nothing else does: :class:`goat_jax.reproduce.workers.JobProcesses` then
    starts no further job and forwards SIGTERM to each running one, whose trainer saves a
    checkpoint at the end of its step and returns (:class:`goat_jax.reproduce.jobs.RunStopped`).
    A second Ctrl-C ends the harness at once (exit 130; its workers, in the same process group,
    got the Ctrl-C too). The previous handlers are restored after the block; a harness not on
    the main thread cannot install any and keeps the default behaviour."""
    event = _StopEvent()

    def handle(signum, frame):  # pylint: disable=unused-argument
        if event.is_set():
            if signum == signal.SIGINT and event.signum == signal.SIGINT:
                print("interrupted again (Ctrl-C): exiting at once", file=sys.stderr, flush=True)
                os._exit(interrupts.exit_code(signum))  # pylint: disable=protected-access
            return
        event.signum = signum
        cli.log(f"{interrupts.name(signum)}: stopping the running jobs after their trainers save; starting no other")
        event.set()

    if threading.current_thread() is not threading.main_thread():
        yield event
        return
    previous = {s: signal.signal(s, handle) for s in interrupts.STOP_SIGNALS
                if s != signal.SIGHUP or signal.getsignal(s) is not signal.SIG_IGN}
    try:
        yield event
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def queue_order(all_jobs: Sequence[Job], suite: Suite, families: Sequence[str] = FAMILIES) -> list[Job]:
    """The order the harness trains ``all_jobs`` in: first every run that a headline check
    reads (:data:`goat_jax.reproduce.jobs.FEEDS_CHECKS`), family by family in the order of ``families`` (the
    ``--families`` flag: ``--families lm,dna,vit`` puts the language checks' runs first) and
    seed by seed within a family, so each family's verdicts get all their seeds as soon as the
    compute allows; then the other runs (the tables' further rows), seed by seed in plan
    order. A suite stopped part way thus has its verdicts' runs, not a random half of the
    tables. An evaluated-with row reads its trained row's run, so that run is queued with it
    and before it (a check reading ``niah/niah/goat+linear_sink`` trains ``niah/niah/goat``
    first, though no check reads that row itself)."""
    rank = {f: i for i, f in enumerate(families)}
    feeding = {id(j) for j in all_jobs if jobs_lib.FEEDS_CHECKS[j.family](j, suite)}
    read_by_feeding = {j.workdir for j in all_jobs if id(j) in feeding and not j.trains}
    feeding |= {id(j) for j in all_jobs if j.trains and j.workdir in read_by_feeding}

    def key(ij):
        i, job = ij
        later = 0 if job.trains else 1  # after every training row of its family and seed
        if id(job) in feeding:
            return (0, rank.get(job.family, len(rank)), job.seed_offset, later, i)
        return (1, 0, job.seed_offset, later, i)

    return [job for _, job in sorted(enumerate(all_jobs), key=key)]


def run_jobs(all_jobs: Sequence[Job], suite: Suite, jobs: int, t_start: float,
             families: Sequence[str] = FAMILIES, train: bool = True):
    """Trains and evaluates ``all_jobs``: ``(raw results by run name, timings, failures by
    run name, runs held by another process by run name)`` (a held run, whose trainer found its
    workdir locked by another process, is one log line and no failure: the report lists it as
    unfinished). ``jobs`` > 1: that many at once, each in a fresh subprocess logging to
    ``<workdir>.log`` (a failure is recorded, the other jobs go on). ``jobs`` = 1: one after
    another in this process (a job's exception is logged with its traceback and recorded as its
    failure; the other jobs go on). Runs that are finished and
    evaluated, or recorded (:func:`goat_jax.reproduce.jobs.reused`), are read first, in this
    process, and take no job slot. The others train in :func:`queue_order` (``families``: the
    order of the ``--families`` flag); an evaluated-with row, which reads another row's run,
    is evaluated as soon as that run is trained (so a sitting that ends part way loses no
    evaluation of weights it trained), and a run known only from its record is trained again
    when an evaluated-with row still needs its weights. Every result is written to its job's
    record (:func:`goat_jax.reproduce.jobs.write_record`) as soon as it exists. ``train``
    False: only the reused runs are read, nothing trains or evaluates (``--report_only``)."""
    raw, timings, failed, held = {}, {}, {}, {}
    written = []

    def record(job, res):
        timings[f"train {job.run_name}"] = res["train_seconds"]
        raw[job.run_name] = res["result"]
        timings[f"eval {job.run_name}"] = res["result"]["eval_seconds"]
        timings[f"wall {job.run_name}"] = res["wall_seconds"]
        if jobs_lib.write_record(job, res):
            written.append(job.run_name)

    # Finished and evaluated runs are read here, in seconds, instead of in a trainer (a job
    # slot, a fresh JAX, a restored state) each: a suite resumed in a later sitting goes straight
    # to its unfinished runs.
    todo, from_records = [], 0
    verbosity = absl_logging.get_verbosity()
    absl_logging.set_verbosity(absl_logging.ERROR)  # orbax warns about every read-only checkpoint
    try:
        for job in all_jobs:
            try:
                done = jobs_lib.reused(job, suite)
            except records_lib.UnreadableRecord as e:  # never retrained over, never reused: named
                failed[job.run_name] = str(e)
                cli.log(f"{job.run_name}: not run: {e}")
                continue
            if done is None:
                todo.append(job)
            else:
                from_records += bool(done.get("from_record"))
                record(job, done)
        for reader in [j for j in todo if not j.trains]:  # the run it evaluates was not run: neither is it
            base = _run_read_by(reader, all_jobs)
            if base is not None and base.run_name in failed:
                failed[reader.run_name] = f"not evaluated: the run it reads ({base.run_name}) failed"
                todo.remove(reader)
        if train:  # an evaluated-with row to do whose run is known only from its record: retrain the run
            queued = {id(j) for j in todo}
            for reader in [j for j in todo if not j.trains]:
                base = _run_read_by(reader, all_jobs)
                if base is not None and id(base) not in queued and not trainer.is_finished(
                        jobs_lib.job_config(base), base.workdir):
                    cli.log(f"{base.run_name}: recorded, but its weights are not in {base.workdir}, and "
                            f"{reader.run_name} evaluates them: training it again")
                    todo.append(base)
                    queued.add(id(base))
                    from_records -= 1  # counted as read from its record above; it trains now
    finally:
        absl_logging.set_verbosity(verbosity)
    if len(todo) + len(failed) < len(all_jobs):
        cli.log(f"reused {len(all_jobs) - len(todo) - len(failed)} finished and evaluated run(s)"
                + (f" ({from_records} from their records)" if from_records else "") + f"; {len(todo)} to go")
    if written:
        cli.log(f"recorded {len(written)} run(s) that had no current record")
    if not train:
        cli.log(f"--report_only: {len(todo)} unfinished run(s) left out of the report")
        return raw, timings, failed, held
    all_jobs = queue_order(todo, suite, families)
    trained = [j for j in all_jobs if j.trains]
    readers: dict[int, list[Job]] = {}  # id(trained job) -> its evaluated-with rows to do
    ready = []  # evaluated-with rows whose run is already trained
    for job in (j for j in all_jobs if not j.trains):
        base = _run_read_by(job, trained)
        (readers.setdefault(id(base), []) if base is not None else ready).append(job)
    if jobs == 1:
        step = 0
        for job in ready + trained:
            for each in [job] + readers.get(id(job), []):
                step += 1
                cli.log(f"[{step}/{len(all_jobs)}] {each.run_name}: {each.spec} {each.overrides or ''}"
                        + (f" evaluated with {each.eval_overrides}" if not each.trains else ""))
                if each.run_name in failed or each.run_name in held:  # its run failed or is held above
                    cli.log(f"  skipped: {failed.get(each.run_name) or held[each.run_name]}")
                    continue
                try:
                    result = jobs_lib.train_and_evaluate(each, suite)
                except jobs_lib.RunStopped:
                    raise
                except lock_lib.WorkdirLockedError as error:  # another process trains it: one line, not a failure
                    _held(each, error, held, readers)
                    continue
                except Exception as error:  # pylint: disable=broad-except  # one job's failure loses no other
                    failed[each.run_name] = f"{type(error).__name__}: {error}"
                    cli.log(f"[{step}/{len(all_jobs)}] {each.run_name} FAILED:\n{traceback.format_exc()}")
                    for reader in readers.get(id(each), []):
                        failed[reader.run_name] = f"not evaluated: the run it reads ({each.run_name}) failed"
                    continue
                record(each, result)
                cli.log(f"  elapsed {(time.time() - t_start) / 60:.1f} min")
        return raw, timings, failed, held
    stopped: list[str] = []
    count = 0
    with _sigterm_event() as sigterm:
        pool = workers.JobProcesses(jobs, jobs_lib.train_and_evaluate, stop=sigterm)

        def submit(job):
            pool.submit(job, job, suite, _log_path(job))  # the job is its outcome's key
            cli.log(f"queued {job.run_name} (log {_log_path(job)})")

        for job in ready + trained:
            submit(job)
        for job, result, error in pool.outcomes():
            count += 1
            if error is None:
                record(job, result)
                cli.log(f"[{count}/{len(all_jobs)}] {job.run_name} done; elapsed "
                        f"{(time.time() - t_start) / 60:.1f} min")
                if not sigterm.is_set():
                    for reader in readers.get(id(job), []):
                        submit(reader)
                continue
            if isinstance(error, jobs_lib.RunStopped):
                stopped.append(str(error))
            elif sigterm.is_set():  # a process ended by the signal outside its trainer: evaluated nothing
                stopped.append(f"{job.run_name}: stopped by {interrupts.name(sigterm.signum)} ({type(error).__name__})")
            elif isinstance(error, lock_lib.WorkdirLockedError):  # another process trains it: one line
                _held(job, error, held, readers)
            else:  # one job's failure loses no other
                failed[job.run_name] = f"{type(error).__name__}: {error} (log {_log_path(job)})"
                cli.log(f"[{count}/{len(all_jobs)}] {job.run_name} FAILED: {failed[job.run_name]}")
                for reader in readers.get(id(job), []):
                    failed[reader.run_name] = f"not evaluated: the run it reads ({job.run_name}) failed"
    if stopped or sigterm.is_set():
        signum = sigterm.signum or signal.SIGTERM
        raise jobs_lib.RunStopped(f"{interrupts.name(signum)}: " + ("; ".join(stopped) or "no job was running"),
                                  signum=signum)
    return raw, timings, failed, held


def _held(job: Job, error: BaseException, held: dict, readers: dict) -> None:
    """Notes ``job`` as held by another process (its trainer's workdir lock, ``error``) in
    ``held``, with one log line, and the rows evaluated with its run as held with it."""
    held[job.run_name] = str(error)
    cli.log(f"  {job.run_name}: not run: {error}")
    for reader in readers.get(id(job), []):
        held[reader.run_name] = f"the run it reads ({job.run_name}) is held by another process"


def _log_path(job: Job) -> str:
    """Where a ``--jobs J`` process writes ``job``'s output: ``<workdir>.log`` for a training
    row, ``<workdir>@<label>.log`` for an evaluated-with row (which shares its run's workdir)."""
    return job.workdir + (".log" if job.trains else f"@{job.label}.log")


def _run_read_by(reader: Job, candidates: Sequence[Job]) -> Optional[Job]:
    """The training job among ``candidates`` whose run evaluated-with row ``reader`` evaluates
    (the same workdir), or None."""
    return next((j for j in candidates if j.trains and j.workdir == reader.workdir), None)
