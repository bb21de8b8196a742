"""The report harness's reliability (issue: reliability round 4), through the real CLI entry
point ``experiments.reproduce.main`` on smoke-sized suites:

* SIGTERM mid-training stops the harness (exit 143) after the trainer saved; the unfinished run
  is never evaluated, cached or reported, and an evaluation cache is reused only for the
  checkpoint it evaluated;
* seeds run in parts (``--seeds 1`` then ``--seeds 2``) give exactly the report of one sitting
  (a fresh evaluation equals its cache read back);
* a partial report's headline checks pair the same seeds in every column;
* an ``--out`` / ``--workdir`` that cannot be written is refused before any run trains.
"""

import dataclasses
import json
import re
import os
import signal
import threading
import time

import pytest

from experiments import reproduce
from goat_jax.reproduce import jobs as jobs_lib
from goat_jax.reproduce import report, stats, suites
from goat_jax.train import run as run_lib


def _suite(name, encodings):
    """The smoke suite's language models alone (no retrieval, toy or variants), short
    evaluations: the cheapest suite whose headline checks compare encodings."""
    return dataclasses.replace(suites.SUITES["smoke"], name=name, tasks=(), toy="", encodings=encodings,
                               lm_variants=(), retrieval_variants=(), multipliers=(1, 2),
                               standard_trials=1, sink_examples=1)


def _argv(name, tmp_path, out="out"):
    return ["--suite", name, "--families", "lm", "--workdir", str(tmp_path / "runs"),
            "--out", str(tmp_path / out)]


def _sigterm_once_training(workdir, deadline=300.0):
    """Sends this process SIGTERM once the run in ``workdir`` has logged a training step and the
    trainer's own SIGTERM handler is installed (never the default one, which would end pytest)."""
    t0 = time.time()
    while time.time() - t0 < deadline:
        try:
            steps = [r["step"] for r in run_lib.read_metrics(workdir) if "train_loss" in r]
        except OSError:
            steps = []
        handler = signal.getsignal(signal.SIGTERM)
        if steps and callable(handler) and handler is not signal.default_int_handler:
            os.kill(os.getpid(), signal.SIGTERM)
            return
        time.sleep(0.05)


def test_sigterm_mid_training_evaluates_nothing_and_stops_the_harness(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(suites.SUITES, "smoke_sigterm", _suite("smoke_sigterm", ("goat",)))
    real_config = jobs_lib.job_config

    def long_config(job):  # long enough that SIGTERM lands mid-training; no checkpoint but SIGTERM's
        config = real_config(job)
        config.num_train_steps, config.checkpoint_every_steps, config.eval_every_steps = 5000, 5000, 0
        return config

    monkeypatch.setattr(jobs_lib, "job_config", long_config)
    workdir = tmp_path / "runs" / "jargon" / "goat"
    killer = threading.Thread(target=_sigterm_once_training, args=(str(workdir),), daemon=True)
    killer.start()
    rc = reproduce.main(_argv("smoke_sigterm", tmp_path))
    killer.join(timeout=5)
    log = capsys.readouterr().out
    assert rc == jobs_lib.STOPPED_EXIT_CODE, log
    assert "training stopped at step" in log and "not evaluated" in log
    steps = run_lib.checkpoint_steps(str(workdir))
    assert steps and 0 < steps[-1] < 5000  # the trainer saved where it stopped
    assert not (workdir / jobs_lib.EVAL_CACHE).exists()  # nothing evaluated, nothing cached
    assert not (tmp_path / "out" / "REPORT.md").exists()

    # The unfinished run is never reported: --status says partial, --report_only has nothing.
    assert reproduce.main(_argv("smoke_sigterm", tmp_path) + ["--status"]) == 0
    assert "partial" in capsys.readouterr().out
    with pytest.raises(ValueError, match="none of the 1 planned runs"):
        reproduce.main(_argv("smoke_sigterm", tmp_path) + ["--report_only"])

    # An evaluation of the unfinished run is refused, and a cache is reused only for the
    # weights it read (the checkpoint step), even where the suite's settings match.
    suite = suites.SUITES["smoke_sigterm"]
    job = suites.plan(suite, str(tmp_path / "runs"), families=["lm"])[0]
    with pytest.raises(jobs_lib.RunStopped, match="not finished"):
        jobs_lib.evaluate(job, suite)
    weights = jobs_lib.evaluated_weights(job)
    assert weights == {"checkpoint_step": steps[-1], "seed": 0}
    cache = {"eval_settings": jobs_lib.eval_settings(job, suite), "weights": weights}
    (workdir / jobs_lib.EVAL_CACHE).write_text(json.dumps(cache))
    assert jobs_lib.cached_evaluation(job, suite) == cache
    for other in ({**weights, "checkpoint_step": steps[-1] + 1}, None):
        (workdir / jobs_lib.EVAL_CACHE).write_text(json.dumps({**cache, "weights": other}))
        assert jobs_lib.cached_evaluation(job, suite) is None
    assert jobs_lib.reused(job, suite) is None  # and never for an unfinished run


def _without_timing(results):
    """results.json's rows without what differs between sittings by design (stage seconds)."""
    def strip(x):
        if isinstance(x, dict):
            return {k: strip(v) for k, v in x.items() if k not in ("eval_seconds",)}
        if isinstance(x, list):
            return [strip(v) for v in x]
        return x
    return strip(results)


def _checks(report_md):
    section = report_md.split("### Headline checks", 1)[1].split("\n### ", 1)[0]
    return [line for line in section.splitlines() if line.startswith("| GOAT") or line.startswith("| RoPE")]


@pytest.mark.slow(reason="trains the smoke suite's seeds in two sittings (~30 s of an idle core); reuse of finished runs is in tests/test_reproduce_seeds.py")
def test_seeds_run_in_parts_give_the_report_of_one_sitting(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(suites.SUITES, "smoke_parts", _suite("smoke_parts", ("goat", "rope")))
    argv = _argv("smoke_parts", tmp_path)
    assert reproduce.main(argv + ["--seeds", "1"]) == 0
    assert reproduce.main(argv + ["--seeds", "2"]) == 0  # seed 0 read from its cache, seed 1 fresh
    log = capsys.readouterr().out
    assert "reused 2 finished and evaluated run(s); 2 to go" in log
    parts = json.loads((tmp_path / "out" / "results.json").read_text())
    parts_md = (tmp_path / "out" / "REPORT.md").read_text()
    # Every number of both encodings over both seeds, the perplexity row and checks included.
    for enc in ("goat", "rope"):
        ext = parts[f"lm/jargon/{enc}"]["extrapolation"]
        assert set(ext) == {"32", "64"}, ext
        assert len(parts[f"lm/jargon/{enc}"]["seeds"]) == 2
    checks = _checks(parts_md)
    assert len(checks) == 5 and all("not measured" not in c for c in checks), checks
    # The same report from the caches alone (every seed read back): identical numbers.
    assert reproduce.main(argv[:-1] + [str(tmp_path / "again"), "--seeds", "2", "--report_only"]) == 0
    again = json.loads((tmp_path / "again" / "results.json").read_text())
    assert _without_timing(again) == _without_timing(parts)
    assert _checks((tmp_path / "again" / "REPORT.md").read_text()) == checks


def test_a_partial_reports_checks_pair_the_same_seeds_in_every_column(tmp_path):
    """GOAT finished seeds 0 and 1, RoPE only seed 0. GOAT's 2-seed mean is below RoPE's, but on
    seed 0 (the only pair) GOAT is worse: the threshold column must say FAIL, as the difference."""
    suite = _suite("smoke_pairs", ("goat", "rope"))
    jobs = [j for j in suites.plan(suite, str(tmp_path), families=["lm"]) if j.seed_offset == 0]

    def lm(ppl1, ppl2):
        return {"train_len": 32, "step": 20, "extrapolation": {"32": {"ppl": ppl1}, "64": {"ppl": ppl2}}}

    results = {"lm/jargon/goat": stats.aggregate([lm(5.2, 6.0), lm(4.0, 5.0)], [0, 1]),
               "lm/jargon/rope": stats.aggregate([lm(5.0, 20.0)], [0])}
    checks = {c.claim: c for c in report.headline_checks("lm", suite, jobs, results)}
    check = checks["GOAT in-distribution perplexity < RoPE's"]
    assert check.numbers == "GOAT 5.200, RoPE 5.000" and check.ok is False, check
    assert check.difference == "GOAT - RoPE = 0.200" and check.verdict == stats.ONE_SEED
    ratio = checks["GOAT's 2x / 1x perplexity ratio < RoPE's"]
    assert ratio.numbers == "GOAT 1.15, RoPE 4.00", ratio  # seed 0's GOAT ratio, not the 2-seed mean
    # The checks' restriction leaves the rows (the tables) with every seed they have.
    assert results["lm/jargon/goat"]["extrapolation"]["32"]["ppl"].seeds == (0, 1)


@pytest.mark.parametrize("flag", ["--out", "--workdir"])
def test_an_unwritable_out_or_workdir_is_refused_before_any_run(tmp_path, monkeypatch, flag):
    monkeypatch.setitem(suites.SUITES, "smoke_ro", _suite("smoke_ro", ("goat",)))
    monkeypatch.setattr(jobs_lib, "train_and_evaluate", lambda *a, **k: pytest.fail("a job ran"))
    argv = _argv("smoke_ro", tmp_path)
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    argv[argv.index(flag) + 1] = str(blocker / "sub")
    with pytest.raises(ValueError, match=f"{flag} .*a_file exists and is not a directory"):
        reproduce.main(argv)
    argv[argv.index(flag) + 1] = "/proc/goat-jax-no-such/sub"  # a folder nobody can create files in
    with pytest.raises(ValueError, match=f"{flag} /proc/goat-jax-no-such/sub: cannot write in /proc"):
        reproduce.main(argv)
    assert not (tmp_path / "runs").exists()  # nothing created, nothing trained


def test_an_evaluation_that_read_an_older_checkpoint_than_the_newest_is_not_kept(tmp_path):
    """The newest checkpoint of a finished run does not restore: the evaluators (read-only)
    fall back to an older step, i.e. the weights of an unfinished run. The harness refuses to
    cache or report that evaluation, naming both steps and how to resume."""
    from tests.test_recovery import _truncate_state

    suite = _suite("smoke_damaged", ("goat",))
    job = suites.plan(suite, str(tmp_path / "runs"), families=("lm",))[0]
    job = dataclasses.replace(job, overrides={**job.overrides, "checkpoint_every_steps": 2,
                                              "keep_checkpoints": 2})
    from goat_jax.train import trainer
    trainer.train_and_evaluate(jobs_lib.job_config(job), job.workdir)
    assert list(run_lib.checkpoint_steps(job.workdir)) == [2, 4]
    _truncate_state(os.path.join(job.workdir, "checkpoints", "4"))
    with pytest.raises(RuntimeError, match=r"newest checkpoint \(step 4\) .* does not restore, and the "
                                           r"evaluation read step 2; nothing of it is kept"):
        jobs_lib.evaluate(job, suite)
    assert not os.path.exists(jobs_lib.cache_path(job))


def _sigterm_once_training_in(workdirs, count, deadline=300.0):
    """SIGTERM to this process once ``count`` of the runs in ``workdirs`` have logged a training
    step (each trains in its own job process, so the harness's handler is installed by then)."""
    t0 = time.time()
    while time.time() - t0 < deadline:
        logged = 0
        for workdir in workdirs:
            try:
                logged += any("train_loss" in r for r in run_lib.read_metrics(workdir))
            except OSError:
                pass
        if logged >= count:
            os.kill(os.getpid(), signal.SIGTERM)
            return
        time.sleep(0.1)


@pytest.mark.slow(reason="two job processes trained to a SIGTERM (~30 s of an idle core); the one-job SIGTERM test above "
                         "keeps the preemption promise in the default suite, test_reproduce_workers.py the stop of queued jobs")
def test_sigterm_with_parallel_jobs_stops_every_worker_after_it_saves_and_starts_no_queued_one(tmp_path):
    """``--jobs 2`` with three runs: the harness forwards SIGTERM to its two running job
    processes; each trainer saves where it stopped, the queued run never starts, nothing is
    evaluated or cached, and the harness raises RunStopped (the CLI's exit 143) instead of
    reporting. (On ProcessPoolExecutor such a stop could hang the harness, depending on timing:
    goat_jax/reproduce/workers.py says why, and test_reproduce_workers.py tests its replacement.)"""
    from goat_jax.reproduce import runner

    suite = _suite("smoke_parallel", ("goat", "rope", "alibi"))
    long = {"num_train_steps": 5000, "checkpoint_every_steps": 5000, "eval_every_steps": 0,
            "log_every_steps": 1}
    suite = dataclasses.replace(suite, lm_overrides={**suite.lm_overrides, **long})
    jobs = suites.plan(suite, str(tmp_path / "runs"), families=("lm",))
    assert len(jobs) == 3
    killer = threading.Thread(target=_sigterm_once_training_in, args=([j.workdir for j in jobs], 2), daemon=True)
    killer.start()
    t0 = time.time()
    with pytest.raises(jobs_lib.RunStopped, match="SIGTERM"):
        runner.run_jobs(jobs, suite, 2, time.time(), families=("lm",))
    assert time.time() - t0 < 600  # returned: did not wait on a broken pool
    killer.join(timeout=5)
    started = [job for job in jobs if os.path.exists(job.workdir)]
    assert len(started) == 2, [j.run_name for j in started]
    for job in started:
        steps = run_lib.checkpoint_steps(job.workdir)
        assert steps and 0 < steps[-1] < 5000, (job.run_name, steps)  # saved where it stopped
    for job in jobs:
        assert not os.path.exists(jobs_lib.cache_path(job))  # nothing evaluated, nothing cached
    assert signal.getsignal(signal.SIGTERM) is not None  # the harness restored the previous handler


@pytest.mark.slow(reason="trains 7 smoke runs (~1 min of CPU); the plan, the queue order and the checks "
                         "are tested in the default suite (test_reproduce.py, test_reproduce_seeds.py)")
def test_rival_rows_and_checks_run_through_the_harness(tmp_path, monkeypatch, capsys):
    """The tiny suite's new row kinds on smoke-sized runs, through the real CLI: a retrieval-only
    row trained with an override, a retrieval row and an LM row evaluated with the linear sink
    on GOAT's own models (nothing trained for them), and the checks against the rival, rendered
    with their verdicts in the report."""
    suite = dataclasses.replace(
        _suite("smoke_rival", ("goat", "rope")), tasks=("passkey", "niah"), num_examples=2, niah_examples=2,
        # As in the tiny suite: the LM row trained with the option, the retrieval rows evaluated with it.
        lm_variants=(suites.LMVariant("goat+linear_sink", "goat", spec="configs/lm_tiny.py:{enc},smoke,linear_sink"),),
        retrieval_rows=(suites.LMVariant("rope+base500", "rope", {"model.rope_base": 500.0}),
                        suites.LMVariant("goat+linear_sink", "goat", trained_as="goat",
                                         eval_overrides={"model.sink_extrapolation": "linear"})),
        rival_checks=suites.RivalChecks("goat+linear_sink", lm_rival="rope", retrieval_rival="rope+base500",
                                        ppl_multipliers=(2,), retrieval_multipliers=(2,)))
    monkeypatch.setitem(suites.SUITES, "smoke_rival", suite)
    assert reproduce.main(_argv("smoke_rival", tmp_path)) == 0
    out = tmp_path / "out"
    results = json.loads((out / "results.json").read_text())
    for name in ("lm/jargon/goat+linear_sink", "passkey/passkey/goat+linear_sink", "niah/niah/goat+linear_sink",
                 "passkey/passkey/rope+base500", "niah/niah/rope+base500"):
        assert name in results, name
    assert not (tmp_path / "runs" / "passkey" / "goat+linear_sink").exists()  # evaluated GOAT's model
    assert (tmp_path / "runs" / "passkey" / "rope+base500" / "config.json").exists()  # trained its own
    report = (out / "REPORT.md").read_text()
    for claim in ("goat+linear_sink perplexity at 2x < rope's",
                  "goat+linear_sink synthetic passkey accuracy at 2x > rope+base500's",
                  "goat+linear_sink NIAH accuracy at 2x > rope+base500's"):
        assert re.search(re.escape(claim) + r" \| inconclusive \(1 seed\) \| goat\+linear_sink - ", report), claim
    assert "trains nothing: the goat run evaluated with model.sink_extrapolation=linear" in report


def test_the_sigterm_event_is_set_by_a_sigterm_only_and_the_handler_is_restored():
    """``runner._sigterm_event``'s event is set by a SIGTERM and by nothing else: a block that
    ends normally leaves it unset (an event set on exit once made every --jobs > 1 run that
    finished read as stopped by SIGTERM, writing no report), and the previous handler is back after
    the block either way."""
    from goat_jax.reproduce import runner

    before = signal.getsignal(signal.SIGTERM)
    with runner._sigterm_event() as event:  # pylint: disable=protected-access
        assert signal.getsignal(signal.SIGTERM) is not before
    assert not event.is_set()
    assert signal.getsignal(signal.SIGTERM) is before
    with runner._sigterm_event() as event:  # pylint: disable=protected-access
        os.kill(os.getpid(), signal.SIGTERM)
        assert event.wait(5)
    assert event.is_set()
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_failing_job_with_one_slot_is_recorded_and_the_others_go_on(tmp_path, monkeypatch, capsys):
    """``--jobs 1`` runs the jobs in this process: an exception in one (e.g. an evaluation that
    runs out of memory) is logged with its traceback and listed as failed, the next job still
    trains, and the exit code is 1."""
    monkeypatch.setitem(suites.SUITES, "smoke_fail", _suite("smoke_fail", ("goat", "rope")))
    real = jobs_lib.train_and_evaluate

    def fail_goat(job, suite, *a, **k):
        if job.label == "goat":
            raise MemoryError("RESOURCE_EXHAUSTED: out of memory allocating 51.6 GB")
        return real(job, suite, *a, **k)

    monkeypatch.setattr(jobs_lib, "train_and_evaluate", fail_goat)
    assert reproduce.main(_argv("smoke_fail", tmp_path) + ["--jobs", "1"]) == 1
    log = capsys.readouterr().out
    assert re.search(r"lm/jargon/goat\S* FAILED:\nTraceback", log), log[-2000:]
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert "extrapolation" in results["lm/jargon/rope"]  # the job after the failure trained and was evaluated
    assert "RESOURCE_EXHAUSTED" in (tmp_path / "out" / "REPORT.md").read_text()


def test_an_evaluation_killed_part_way_resumes_at_its_first_unscored_length(tmp_path, monkeypatch, capsys):
    """A sitting that ends mid-evaluation keeps the lengths it scored (``reproduce_eval.lengths.json``
    beside the run); the next evaluation of the same weights under the same settings scores only
    the rest, and its result is the one of an uninterrupted evaluation. Lengths kept for other
    weights are never taken back; the file is gone once the evaluation is cached whole."""
    from goat_jax.eval import extrapolation

    monkeypatch.setitem(suites.SUITES, "smoke_lengths",
                        dataclasses.replace(_suite("smoke_lengths", ("goat",)), lm_ppl_multipliers=(1, 2, 4)))
    suite = suites.SUITES["smoke_lengths"]
    job = suites.plan(suite, str(tmp_path / "runs"), families=["lm"])[0]
    jobs_lib.train_and_evaluate(job, suite)  # one sitting: trained, then evaluated whole
    cache, lengths = tmp_path / "runs" / "jargon" / "goat" / jobs_lib.EVAL_CACHE, jobs_lib.lengths_path(job)
    whole = json.loads(cache.read_text())
    assert not os.path.exists(lengths)  # cached whole: nothing per length is left behind
    assert sorted(map(int, whole["extrapolation"])) == [32, 64, 128]

    real, scored = extrapolation.perplexity_by_length, []

    def killed_at(stop):
        def score(*args, **kw):
            n = args[3] * args[4][0]  # train_len x the one multiplier
            if n == stop:
                raise RuntimeError(f"killed while scoring {n}")
            scored.append(n)
            return real(*args, **kw)
        return score

    cache.unlink()
    monkeypatch.setattr(extrapolation, "perplexity_by_length", killed_at(128))
    with pytest.raises(RuntimeError, match="killed while scoring 128"):
        jobs_lib.evaluate(job, suite)
    assert scored == [32, 64] and not cache.exists()
    assert reproduce.main(_argv("smoke_lengths", tmp_path) + ["--status"]) == 0
    assert "evaluation part done (2 length(s) scored, up to 64 tokens" in capsys.readouterr().out

    scored.clear()
    monkeypatch.setattr(extrapolation, "perplexity_by_length", killed_at(None))
    resumed = jobs_lib.evaluate(job, suite)
    assert scored == [128]  # only the unscored length
    assert "taking back the lengths an earlier sitting finished: 32, 64" in capsys.readouterr().out
    assert resumed["extrapolation"] == whole["extrapolation"]
    assert not os.path.exists(lengths) and cache.exists()

    # Lengths kept under another key (other weights) are scored again, never taken back.
    key = jobs_lib.lengths_key(job, suite, {**jobs_lib.evaluated_weights(job), "checkpoint_step": 1})
    from goat_jax.reproduce.progress import LengthProgress
    LengthProgress(lengths, key).put(32, {"ppl": 999.0, "nll": 6.9, "tokens": 1}, {"seconds": 1.0})
    cache.unlink()
    scored.clear()
    again = jobs_lib.evaluate(job, suite)
    assert scored == [32, 64, 128] and again["extrapolation"] == whole["extrapolation"]
    assert "made with other settings or of other weights" in capsys.readouterr().out
