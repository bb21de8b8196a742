"""experiments.evaluate refuses, before any work, evaluations that do not fit a run's task and
an --out that cannot take the results (an existing file, a place inside a run workdir, not
writable). The runs here are bare config.json files: a check that read more (a checkpoint)
would fail differently."""

import json
import os
import types

import ml_collections
import numpy as np
import pytest

from experiments import evaluate
from goat_jax.eval import checks, runs
from goat_jax.kernels.plan import AttentionPlan
from goat_jax.train import run as run_lib


def _run_dir(path, task):
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"task": task, "model": {"position_encoding": "goat"}}))
    return str(path)


@pytest.mark.parametrize("task,evals,fits", [
    ("dna", "passkey", "dna"), ("dna", "niah", "dna"), ("dna", "extrapolation,sinks", "dna"),
    ("lm", "dna", "extrapolation, passkey, niah, sinks, diagnostics"),
    ("vit", "sinks", "resolution"), ("lm", "resolution", "extrapolation")])
def test_an_evaluation_that_does_not_fit_the_run_is_refused_listing_those_that_do(tmp_path, task, evals, fits):
    workdir = _run_dir(tmp_path / "run", task)
    extra = ["--resolutions", "28"] if evals == "resolution" else []
    with pytest.raises(ValueError, match=rf"--evals {evals} does not apply to {workdir}, a run of "
                                         rf"config.task='{task}'; the evaluations for it are: {fits}"):
        evaluate.main(["--workdir", workdir, "--evals", evals, "--out", str(tmp_path / "o"), *extra])
    assert not (tmp_path / "o").exists()


def test_the_table_names_every_evaluation_and_the_library_checks_it_too(tmp_path):
    assert set(runs.EVALS) | {"resolution"} == set(checks.EVAL_TASKS)
    assert checks.evals_for_task("dna") == ["dna"]
    fake = types.SimpleNamespace(workdir="W", config=ml_collections.ConfigDict({"task": "dna"}))
    with pytest.raises(ValueError, match=r"\['passkey'\] do not apply to W, a run of config.task='dna'"):
        runs.evaluate_run(fake, ["passkey"], [1])


def test_out_is_checked_before_any_evaluation(tmp_path):
    workdir = _run_dir(tmp_path / "run", "lm")
    (tmp_path / "run" / "checkpoints" / "5").mkdir(parents=True)
    file_out = tmp_path / "results.txt"
    file_out.write_text("keep me")
    cases = [
        (str(file_out), "exists and is not a directory"),
        (os.path.join(workdir, "eval"), f"is inside the run workdir {workdir}"),
        (os.path.join(workdir, "checkpoints", "5", "x"), f"is inside the run workdir {workdir}"),
        (workdir, f"is inside the run workdir {workdir}"),
    ]
    # A folder nobody can create files in, root included (permission bits would not stop root).
    cases.append(("/proc/goat-jax-no-such/out", "--out /proc/goat-jax-no-such/out: cannot write in /proc"))
    for out, match in cases:
        with pytest.raises(ValueError, match=match):
            evaluate.main(["--workdir", workdir, "--evals", "sinks", "--out", out])
    assert file_out.read_text() == "keep me"
    assert sorted(os.listdir(workdir)) == ["checkpoints", "config.json"]
    run_lib.check_output_dir(str(tmp_path / "new" / "deeper"), "evaluation", "_eval")  # a fresh place is fine
    run_lib.check_output_dir(str(tmp_path), "evaluation", "_eval")  # and so is the folder that holds runs


def test_a_stray_config_json_is_not_a_run(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"editor": "vim"}))
    run_lib.check_output_dir(str(tmp_path / "eval"), "evaluation", "_eval")


@pytest.mark.parametrize("value", ["0", "-2", "1.5", "1,x", ","])
def test_bad_multipliers_are_refused_naming_the_flag_before_any_work(tmp_path, value):
    workdir = _run_dir(tmp_path / "run", "lm")
    with pytest.raises(ValueError, match=r"^--multipliers .*(is not a positive integer|names no length); give"):
        evaluate.main(["--workdir", workdir, "--evals", "extrapolation", "--multipliers", value,
                       "--out", str(tmp_path / "o")])
    assert not (tmp_path / "o").exists()
    assert evaluate.parse_multipliers("1, 2,4") == [1, 2, 4]


def _earlier_out(tmp_path, figure):
    """``tmp_path/o`` holding an earlier evaluation's results (with ``figure``) and a file of
    the user's."""
    out = tmp_path / "o"
    out.mkdir()
    for name in ("results.json", "results.md", figure):
        (out / name).write_text("first evaluation")
    (out / "notes.txt").write_text("the user's")
    return out


def test_a_second_evaluation_into_the_same_out_is_refused_unless_overwrite(tmp_path):
    workdir, out = _run_dir(tmp_path / "run", "lm"), _earlier_out(tmp_path, "perplexity.png")
    argv = ["--workdir", workdir, "--evals", "sinks", "--out", str(out)]
    with pytest.raises(ValueError, match=r"--out .* already holds an evaluation's results; .*--overwrite"):
        evaluate.main(argv)
    assert (out / "results.json").read_text() == "first evaluation"  # untouched
    with pytest.raises(Exception):  # the bare run has no checkpoint: the evaluation itself fails
        evaluate.main(argv + ["--overwrite"])
    # Nothing new was written, so the first evaluation's results stay whole; no sibling is left.
    assert sorted(os.listdir(out)) == ["notes.txt", "perplexity.png", "results.json", "results.md"]
    assert (out / "results.json").read_text() == "first evaluation"
    assert sorted(os.listdir(tmp_path)) == ["o", "run"]


class _FakeRun:
    step, train_len = 3, 32
    config = ml_collections.ConfigDict({"context_strategy": "all_gather"})
    plan = AttentionPlan.from_config(config)  # what load_run builds from it


@pytest.mark.parametrize("interrupt", [False, True])
def test_overwrite_keeps_the_old_results_until_the_new_ones_exist(tmp_path, monkeypatch, interrupt):
    """--overwrite: while the new evaluation runs (and if it is interrupted), --out still holds
    the previous results; once it finishes they are replaced, the user's other files stay, and
    no temporary folder is left beside --out."""
    workdir, out = _run_dir(tmp_path / "run", "lm"), _earlier_out(tmp_path, "old_figure.png")
    seen = []

    def evaluate_run(run, evals, mults, into, **kwargs):
        seen.append(sorted(os.listdir(out)))
        if interrupt:
            raise KeyboardInterrupt
        into["sinks"] = {"mass": 0.5}

    def write_outputs(results, folder, train_lens, setups=None):
        os.makedirs(folder, exist_ok=True)
        (open(os.path.join(folder, "results.json"), "w")).write(json.dumps(results))
        (open(os.path.join(folder, "results.md"), "w")).write("second evaluation")
        return "second evaluation"

    monkeypatch.setattr(evaluate.lm_run, "check_request", lambda *a, **k: None)
    monkeypatch.setattr(evaluate.context, "check_request", lambda *a, **k: None)
    monkeypatch.setattr(evaluate.lm_run, "load_lm_run", lambda w: _FakeRun())
    monkeypatch.setattr(evaluate.runs, "evaluate_run", evaluate_run)
    monkeypatch.setattr(evaluate.runs, "write_outputs", write_outputs)
    argv = ["--workdir", workdir, "--evals", "sinks", "--out", str(out), "--overwrite"]
    if interrupt:
        with pytest.raises(KeyboardInterrupt):
            evaluate.main(argv)
    else:
        evaluate.main(argv)
    assert seen == [["notes.txt", "old_figure.png", "results.json", "results.md"]]
    if interrupt:
        assert (out / "results.json").read_text() == "first evaluation"
        assert sorted(os.listdir(out)) == ["notes.txt", "old_figure.png", "results.json", "results.md"]
    else:
        assert json.loads((out / "results.json").read_text()) == {"goat": {"sinks": {"mass": 0.5}}}
        assert sorted(os.listdir(out)) == ["notes.txt", "results.json", "results.md"]
    assert sorted(os.listdir(tmp_path)) == ["o", "run"]


def _rope_run(path, **model):
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"task": "lm", "seq_len": 32, "model": {
        "position_encoding": "rope", "rope_scaling_factor": None, **model}}))
    return str(path)


def test_documents_past_1x_with_a_dynamic_factor_is_refused_before_any_evaluation(tmp_path):
    """YaRN / NTK's dynamic factor follows the packed window, not each document: the whole
    request is checked on config.json before extrapolation runs, naming --rope_scaling_factor."""
    workdir = _rope_run(tmp_path / "run")
    out = tmp_path / "o"
    for encoding in ("yarn", "ntk"):
        with pytest.raises(ValueError, match=r"--evals documents on .* as '%s' with the dynamic factor.*"
                                             r"--rope_scaling_factor 4 \(the longest multiplier\)" % encoding):
            evaluate.main(["--workdir", workdir, "--position_encoding", encoding, "--evals",
                           "extrapolation,documents", "--multipliers", "1,4", "--out", str(out)])
    assert not out.exists()
    # The same for a run trained as YaRN (no swap flag), and a factor in its config is enough.
    yarn = _rope_run(tmp_path / "yarn", position_encoding="yarn")
    with pytest.raises(ValueError, match="--rope_scaling_factor 2"):
        evaluate.main(["--workdir", yarn, "--evals", "documents", "--multipliers", "1,2", "--out", str(out)])
    fixed = _rope_run(tmp_path / "fixed", position_encoding="yarn", rope_scaling_factor=2.0)
    from goat_jax.eval import lm_run
    from goat_jax.train import run as run_lib
    lm_run.check_request(run_lib.read_config(fixed), fixed, ["documents"], [1, 2])  # no error
    lm_run.check_request(run_lib.read_config(yarn), yarn, ["documents"], [1])  # 1x only: one window per document


@pytest.mark.parametrize("flags,match", [
    (["--rope_scaling_factor", "2"], r"--rope_scaling_factor fixes the factor of 'ntk' / 'yarn'; .* would be "
                                     r"evaluated as 'rope': add --position_encoding yarn"),
    (["--position_encoding", "yarn", "--rope_scaling_factor", "0.5"], r"--rope_scaling_factor 0.5: "
                                                                      r"rope_scaling_factor must be >= 1"),
    (["--position_encoding", "yarn", "--rope_scaling_factor", "inf"], r"--rope_scaling_factor inf: ")])
def test_rope_scaling_factor_flag_is_checked_before_any_work(tmp_path, flags, match):
    workdir = _rope_run(tmp_path / "run")
    with pytest.raises(ValueError, match=match):
        evaluate.main(["--workdir", workdir, "--evals", "extrapolation", "--out", str(tmp_path / "o"), *flags])
    assert not (tmp_path / "o").exists()


def test_a_passkey_request_whose_every_length_is_too_short_is_refused_before_any_work(tmp_path):
    """A text run of seq_len 64 at --multipliers 1,2,3 (64-192 tokens, all shorter than the 248
    of the standard prompt) exited 0 with an empty, malformed table and an empty figure."""
    workdir = tmp_path / "run"
    workdir.mkdir()
    (workdir / "config.json").write_text(json.dumps({"task": "lm", "seq_len": 64, "data": {"source": "text"},
                                                     "model": {"position_encoding": "goat"}}))
    out = tmp_path / "o"
    with pytest.raises(ValueError, match=rf"^--evals passkey on {workdir}: every length \(64, 128, 192 tokens: "
                                         r"--multipliers x seq_len 64\) is shorter than the 248 tokens the standard "
                                         r"passkey prompt needs .*give --multipliers of at least 4\.$"):
        evaluate.main(["--workdir", str(workdir), "--evals", "passkey", "--multipliers", "1,2,3", "--out", str(out)])
    assert not out.exists()


def test_passkey_skips_short_lengths_saying_so_and_refuses_when_nothing_is_left(tmp_path, capsys):
    """In the library: the lengths that cannot hold the prompt are logged as skipped, and
    evaluate_run refuses a request where all are (eval_passkey alone returned {'standard': {}})."""
    from configs import lm_tiny
    from tests.config_helpers import random_lm_run

    run = random_lm_run(tmp_path, lm_tiny.get_config("goat,smoke"))  # seq_len 64
    with pytest.raises(ValueError, match=r"every length \(64, 128 tokens"):
        runs.evaluate_run(run, ["passkey"], [1, 2])
    out = runs.eval_passkey(run, [2, 4], variants=("standard",), num_trials=1)
    assert list(out["standard"]) == [256]
    assert "passkey (standard): length(s) 128 skipped, shorter than the 248 tokens the prompt needs" in capsys.readouterr().out


@pytest.mark.parametrize("name", ["extrapolation", "diagnostics"])
def test_an_evaluation_whose_every_length_is_skipped_is_an_error_not_an_empty_table(tmp_path, monkeypatch, name):
    """The same class as passkey's: a held-out stream shorter than every window gave an empty
    table (the per-length 'skipped' lines aside) and exit status 0."""
    from configs import lm_tiny
    from tests.config_helpers import random_lm_run

    run = random_lm_run(tmp_path, lm_tiny.get_config("goat,smoke"))  # seq_len 64
    monkeypatch.setattr(runs, "heldout_stream", lambda *a, **k: runs.HeldoutStream(np.arange(100) % 7, None))
    with pytest.raises(ValueError, match=rf"^--evals {name} on .*: the held-out stream \(100 tokens\) holds no full "
                                         r"window of any length asked for \(128, 256 tokens"):
        runs.evaluate_run(run, [name], [2, 4])


def test_probe_extrapolation_refuses_an_out_inside_the_run_before_any_work(tmp_path, monkeypatch):
    """experiments.probe_extrapolation wrote probe.json wherever --out pointed, a run's workdir
    included, and found an --out that is a file only after the probe's work."""
    from experiments import probe_extrapolation
    workdir = _run_dir(tmp_path / "run", "lm")
    monkeypatch.setattr(probe_extrapolation.lm_run, "load_lm_run",
                        lambda w: pytest.fail("the run was loaded before --out was checked"))
    for out in (os.path.join(workdir, "probe"), workdir):
        with pytest.raises(ValueError, match=rf"--out {out} is inside the run workdir {workdir}; the probe never"):
            probe_extrapolation.main(["--workdir", workdir, "--out", out])
    (tmp_path / "file").write_text("keep me")
    with pytest.raises(ValueError, match="exists and is not a directory"):
        probe_extrapolation.main(["--workdir", workdir, "--out", str(tmp_path / "file")])
    assert sorted(os.listdir(workdir)) == ["config.json"]
