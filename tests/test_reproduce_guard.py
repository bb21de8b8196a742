"""Two report harnesses do not fight (issue #67, item 5; goat_jax/reproduce/guard.py). Before, a
second ``experiments.reproduce`` on the same ``--workdir`` ran beside the first: it printed a
traceback for every run the first one's trainers held, marked it FAILED, exited 1, and each wrote
REPORT.md / results.json over the other's. Now:

* a second harness refuses at the start, in one line naming the holder;
* a run whose workdir another process holds is one log line (never a traceback, never FAILED) and
  is listed as unfinished;
* a report lacking runs that the report already in ``--out`` has is written to ``--out/partial``,
  and the fuller one stays.

Nothing trains here: the locks are taken by this process, which is what a second process meets.
"""

import dataclasses
import json

import pytest

from experiments import reproduce
from goat_jax import cli
from goat_jax.reproduce import guard
from goat_jax.reproduce import jobs as jobs_lib
from goat_jax.reproduce import suites
from goat_jax.train import lock as lock_lib


@pytest.fixture
def suite(monkeypatch):
    """The smoke suite's GOAT LM alone (one run: ``lm/jargon/goat``)."""
    s = dataclasses.replace(suites.SUITES["smoke"], name="smoke_guard", tasks=(), toy="", encodings=("goat",),
                            lm_variants=(), retrieval_variants=(), multipliers=(1,), standard_trials=1,
                            sink_examples=1)
    monkeypatch.setitem(suites.SUITES, "smoke_guard", s)
    return s


def _argv(tmp_path):
    return ["--suite", "smoke_guard", "--families", "lm", "--workdir", str(tmp_path / "runs"),
            "--out", str(tmp_path / "out")]


def test_a_second_harness_refuses_at_the_start_in_one_line(suite, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(jobs_lib, "train_and_evaluate", lambda *a, **k: pytest.fail("the second harness ran a job"))
    with guard.hold_harness(str(tmp_path / "runs"), str(tmp_path / "out")):  # the first harness
        with pytest.raises(SystemExit) as exit_:
            cli.run(lambda: reproduce.main(_argv(tmp_path)))
    assert exit_.value.code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: --workdir {tmp_path / 'runs'} is in use by another "
                                               "experiments.reproduce: pid "), err
    assert f"(lock {tmp_path / 'runs' / guard.HARNESS_LOCK})" in err[0]
    # Once the first one is gone, the lock is free: --status takes none anyway.
    assert reproduce.main(_argv(tmp_path) + ["--status"]) == 0


def test_a_held_run_is_one_line_and_a_partial_report_keeps_the_fuller_one(suite, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "REPORT.md").write_text("the fuller report\n")
    (out / "results.json").write_text(json.dumps({"lm/jargon/goat": {"seeds": {"lm/jargon/goat": {"ppl": 1.0}}}}))
    workdir = tmp_path / "runs" / "jargon" / "goat"
    workdir.mkdir(parents=True)
    with lock_lib.hold(str(workdir)):  # a trainer of another process on the run
        rc = reproduce.main(_argv(tmp_path))
    log = capsys.readouterr().out
    assert rc == 0, log
    assert "Traceback" not in log and "FAILED" not in log, log
    held = [l for l in log.splitlines() if "in use by another trainer" in l]
    assert len(held) == 2 and "lm/jargon/goat: not run: workdir" in held[0], held  # when met, and in the summary
    assert (out / "REPORT.md").read_text() == "the fuller report\n"
    assert "lm/jargon/goat" in json.loads((out / "results.json").read_text())
    assert f"kept the report in {out}: it reports 1 run(s) this invocation has no result for (lm/jargon/goat)" in log
    assert "has finished yet" in (out / guard.PARTIAL / "REPORT.md").read_text()  # this invocation's, beside it


def test_a_stopped_paper_harness_passes_sigterm_to_the_command_it_runs(tmp_path, monkeypatch, capsys):
    """``--suite paper`` runs shell commands one after another; a SIGTERM to the harness left the
    running command going, orphaned. It is now passed on (the command's trainer would save)."""
    import os  # pylint: disable=g-import-not-at-top
    import signal  # pylint: disable=g-import-not-at-top
    import sys  # pylint: disable=g-import-not-at-top
    import threading  # pylint: disable=g-import-not-at-top
    import time  # pylint: disable=g-import-not-at-top

    from goat_jax.reproduce import paper, runner  # pylint: disable=g-import-not-at-top

    up, got = tmp_path / "up", tmp_path / "got_sigterm"
    child = (f"import signal, sys, time; signal.signal(signal.SIGTERM, lambda *a: (open({str(got)!r}, 'w').close(), "
             f"sys.exit(0))); open({str(up)!r}, 'w').close(); time.sleep(60)")
    monkeypatch.setattr(paper, "paper_commands", lambda *a, **k: [f"{sys.executable} -c \"{child}\""])

    def stop_once_up():
        deadline = time.time() + 60
        while not up.exists() and time.time() < deadline:
            time.sleep(0.02)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=stop_once_up, daemon=True).start()
    started = time.time()
    rc = runner.reproduce("paper", command="test", workdir=str(tmp_path / "runs"), out=str(tmp_path / "out"))
    assert rc == 143 and got.exists() and time.time() - started < 30, capsys.readouterr().out
