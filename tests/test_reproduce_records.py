"""Run records (goat_jax/reproduce/records.py) through the real CLI on a smoke-sized suite: every
evaluated run is recorded beside the report as soon as it exists; a suite whose workdirs are gone
(a machine that kept only the repository) is rebuilt from its records, training nothing, into
the same report; a record made with other settings is not reused; an evaluated-with row whose
own record is missing retrains the run it reads; and an evaluated-with row is evaluated as soon
as its run is trained, with ``--jobs 2`` too.
"""

import dataclasses
import json
import os
import shutil

import pytest

from experiments import reproduce
from goat_jax.reproduce import jobs as jobs_lib
from goat_jax.reproduce import records, suites
from goat_jax.train import tasks as tasks_lib


def _suite():
    """GOAT's smoke LM and the same run evaluated with the linear sink (an evaluated-with row)."""
    return dataclasses.replace(
        suites.SUITES["smoke"], name="smoke_records", tasks=(), toy="", encodings=("goat",),
        retrieval_variants=(), multipliers=(1, 2), standard_trials=1, sink_examples=1,
        lm_variants=(suites.LMVariant("goat+linear_sink", "goat", trained_as="goat",
                                      eval_overrides={"model.sink_extrapolation": "linear"}),))


def _results(out):
    """results.json without the wall-clock and process-memory fields (which differ between
    sittings), at any depth."""
    def strip(value):
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items() if "seconds" not in k and k != "peak_rss_mib"}
        return [strip(v) for v in value] if isinstance(value, list) else value
    return strip(json.loads((out / "results.json").read_text()))


def test_a_suite_whose_runs_are_gone_is_rebuilt_from_its_records(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(suites.SUITES, "smoke_records", _suite())
    runs, out = tmp_path / "runs", tmp_path / "out"
    argv = ["--suite", "smoke_records", "--families", "lm", "--workdir", str(runs), "--out", str(out)]
    assert reproduce.main(argv + ["--jobs", "2"]) == 0  # the pool: the reader queued once goat is trained
    log = capsys.readouterr().out
    assert log.index("lm/jargon/goat done") < log.index("queued lm/jargon/goat+linear_sink"), log
    assert (runs / "jargon" / "goat@goat+linear_sink.log").exists()  # the reader's own worker log
    rec_dir = out / "runs" / "jargon" / "goat"
    rec = json.loads((rec_dir / "record.json").read_text())
    reader = json.loads((rec_dir / "record_goat+linear_sink.json").read_text())
    assert rec["run_name"] == "lm/jargon/goat" and rec["train_seconds"] > 0 and len(rec["commit"]) >= 7
    assert rec["config"]["model"]["sink_extrapolation"] != "linear"
    assert reader["result"]["eval_settings"]["eval_overrides"] == {"model.sink_extrapolation": "linear"}
    assert (rec_dir / "config.json").exists()  # the Setup section's source, kept
    first, first_md = _results(out), (out / "REPORT.md").read_text()

    # The machine kept only the repository: every run is read from its record, nothing trains.
    shutil.rmtree(runs)
    real = jobs_lib.train_and_evaluate
    monkeypatch.setattr(jobs_lib, "train_and_evaluate", lambda *a, **k: pytest.fail("a job ran"))
    assert reproduce.main(argv + ["--out", str(tmp_path / "again"), "--records", str(out / "runs")]) == 0
    assert "reused 2 finished and evaluated run(s) (2 from their records); 0 to go" in capsys.readouterr().out
    assert _results(tmp_path / "again") == first
    setup = [line for line in first_md.splitlines() if line.startswith("* **lm**") or "(extra row)" in line]
    assert setup and all(line in (tmp_path / "again" / "REPORT.md").read_text() for line in setup)
    assert reproduce.main(argv + ["--status"]) == 0
    assert "2 of 2 runs done" in capsys.readouterr().out

    # A record made with other evaluation settings is not reused: the run trains again.
    monkeypatch.setattr(jobs_lib, "train_and_evaluate", real)
    monkeypatch.setitem(suites.SUITES, "smoke_records", dataclasses.replace(_suite(), multipliers=(1,)))
    job = next(j for j in records.attach(suites.plan(suites.SUITES["smoke_records"], str(runs), families=["lm"]),
                                         str(runs), str(out / "runs")) if j.trains)
    assert jobs_lib.recorded(job, suites.SUITES["smoke_records"]) is None
    monkeypatch.setitem(suites.SUITES, "smoke_records", _suite())
    assert jobs_lib.recorded(job, suites.SUITES["smoke_records"]) is not None

    # The reader's record is lost but its run's is there without weights: the run trains again
    # (deterministic: the same numbers), then the reader is evaluated on it.
    os.remove(rec_dir / "record_goat+linear_sink.json")
    assert reproduce.main(argv) == 0
    log = capsys.readouterr().out
    assert "lm/jargon/goat: recorded, but its weights are not in" in log and "training it again" in log
    assert _results(out) == first
    assert (rec_dir / "record_goat+linear_sink.json").exists()


def test_a_torn_or_foreign_record_is_not_reused(tmp_path):
    """A record is read only when it was made by the job's config and settings; one that does not
    parse raises, naming the file."""
    suite = _suite()
    job = next(j for j in records.attach(suites.plan(suite, str(tmp_path / "runs"), families=["lm"]),
                                         str(tmp_path / "runs"), str(tmp_path / "rec")) if j.trains)
    config = jobs_lib.job_config(job).to_dict()
    settings = jobs_lib.eval_settings(job, suite)
    entry = {"train_seconds": 3.0, "result": {"eval_settings": settings, "eval_seconds": 1.0, "x": (1, 2)}}
    assert records.write(job, config, entry) and not records.write(job, config, entry)  # once only
    got = records.read(job, config, settings)
    assert got["result"]["x"] == [1, 2] and got["train_seconds"] == 3.0 and got["from_record"]
    assert records.read(job, {**config, "seed": config["seed"] + 1}, settings) is None
    # The checkpoint's rules: a cadence may change, and a field the record's config lacks (one
    # added since it was written) is no change at its default; at another value it is one.
    task = tasks_lib.get_task(config["task"])
    safe, defaults = task.resume_safe_fields, tasks_lib.field_defaults(task)
    assert records.read(job, {**config, "log_every_steps": 7}, settings, safe, defaults) is not None
    assert defaults["model.name"] == "lm" and "name" not in config["model"]
    newer = {**config, "model": {**config["model"], "name": "lm"}}  # the field written out at its default
    assert records.read(job, newer, settings) is None  # without the defaults: a change
    assert records.read(job, newer, settings, safe, defaults) is not None
    assert records.read(job, {**config, "model": {**config["model"], "name": "vit"}}, settings, safe, defaults) is None
    with open(records.record_path(job), "w") as f:
        f.write('{"config": ')  # torn: named, never taken for "no record" (issue #67)
    with pytest.raises(records.UnreadableRecord, match=r"record.json is unreadable \(JSONDecodeError"):
        records.read(job, config, settings)
    with pytest.raises(ValueError, match="not under the runs root"):
        records.attach([job], str(tmp_path / "elsewhere"), str(tmp_path / "rec"))


def test_an_unreadable_record_is_named_never_reused_nor_trained_over(tmp_path, monkeypatch, capsys):
    """A torn ``record.json`` counted as "no record": ``--status`` said "Not started" and the
    harness trained the run again and overwrote the file (issue #67). Now ``--status`` and the
    run name the file; the job is reported FAILED, nothing trains, the file is left as it was."""
    suite = dataclasses.replace(suites.SUITES["smoke"], name="smoke_torn", tasks=(), toy="", encodings=("goat",),
                                lm_variants=(), retrieval_variants=(), multipliers=(1,), standard_trials=1,
                                sink_examples=1)
    monkeypatch.setitem(suites.SUITES, "smoke_torn", suite)
    runs, out = tmp_path / "runs", tmp_path / "out"
    torn = out / "runs" / "jargon" / "goat" / "record.json"
    torn.parent.mkdir(parents=True)
    torn.write_text('{"run_name": "lm/jargon/goat", "config": {"mod')  # killed mid-write
    argv = ["--suite", "smoke_torn", "--families", "lm", "--workdir", str(runs), "--out", str(out)]
    assert reproduce.main(argv + ["--status"]) == 0
    status = capsys.readouterr().out
    assert f"lm/jargon/goat: run record {torn} is unreadable (JSONDecodeError" in status, status
    monkeypatch.setattr(jobs_lib, "train_and_evaluate", lambda *a, **k: pytest.fail("a job ran"))
    assert reproduce.main(argv) == 1
    log = capsys.readouterr().out
    assert f"lm/jargon/goat: not run: run record {torn} is unreadable" in log, log
    assert "move it aside to train and evaluate the run again" in log
    assert torn.read_text() == '{"run_name": "lm/jargon/goat", "config": {"mod'
    with pytest.raises(records.UnreadableRecord, match="a JSON list, not an object"):
        torn.write_text("[]")
        records.check_readable(next(j for j in records.attach(
            suites.plan(suite, str(runs), families=["lm"]), str(runs), str(out / "runs"))))
