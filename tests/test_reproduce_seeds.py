"""Seeds and intervals in the report harness (goat_jax/reproduce/stats.py, --seeds, --jobs):
the interval against a float64 reference, verdicts on paired differences, aggregation of
per-seed results, and the language family end to end with 2 seeds (reuse, per-seed values in
results.json, a failed job under --jobs 2 reported without losing the others)."""

import dataclasses
import json
import math
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from experiments import reproduce
from goat_jax.eval import plots
from goat_jax.reproduce import dna_family, lm_family, stats, suites, vit_family

T_975_DF2 = 4.30265273  # Student t, two-sided 95%, 2 degrees of freedom (printed tables, 9 digits)


def test_estimate_is_mean_with_a_t_interval_and_pairs_by_seed():
    vals = [1.0, 2.5, 4.0]
    e = stats.Estimate(vals)
    ref = np.asarray(vals, np.float64)
    assert float(e) == pytest.approx(ref.mean(), abs=1e-15)
    assert e.half_width == pytest.approx(T_975_DF2 * ref.std(ddof=1) / math.sqrt(3), rel=1e-8)
    assert stats.t_quantile(2) == pytest.approx(T_975_DF2, rel=1e-8)
    assert format(e, ".2f") == f"2.50 ± {e.half_width:.2f}"
    # Arithmetic is per seed: the paired difference's interval, not the difference of means'.
    f = stats.Estimate([0.9, 2.4, 3.95])
    d = e - f
    assert d.values == pytest.approx((0.1, 0.1, 0.05))
    assert d.half_width < 0.1 < e.half_width  # pairing removes the shared seed-to-seed spread
    assert (100 * e).values == pytest.approx((100.0, 250.0, 400.0))
    assert (e / f).values == pytest.approx(tuple(a / b for a, b in zip(vals, [0.9, 2.4, 3.95])))
    assert (1 - e).values == pytest.approx((0.0, -1.5, -3.0))
    assert stats.per_seed_max([e, f, 2.0]).values == pytest.approx((2.0, 2.5, 4.0))
    # Pairing is by seed offset: seeds 0 and 2 of one row pair with seeds 0 and 2 of another,
    # never seed 2 with seed 1 (a row whose seed 1 failed or has not finished).
    gap = stats.Estimate([1.5, 3.0], seeds=[0, 2])
    assert (e - gap).seeds == (0, 2) and (e - gap).values == pytest.approx((-0.5, 1.0))
    assert (gap - e).values == pytest.approx((0.5, -1.0)) and (2 * gap).seeds == (0, 2)
    assert stats.per_seed_max([e, gap]).values == pytest.approx((1.5, 4.0))
    assert stats.common_seeds([e, gap, f]) == (0, 2)
    with pytest.raises(ValueError, match=r"no seed in common to pair \(\[0\] vs \[1, 2\]\)"):
        _ = stats.Estimate([1.0]) - stats.Estimate([1.0, 2.0], seeds=[1, 2])
    with pytest.raises(ValueError, match="must be 2 distinct offsets in increasing order"):
        stats.Estimate([1.0, 2.0], seeds=[1, 1])
    import pickle  # an estimate keeps its seeds through a pickle (subprocess results, copies)
    assert pickle.loads(pickle.dumps(gap)).seeds == (0, 2)
    # One seed: no interval is invented.
    one = stats.Estimate([0.7])
    assert one.half_width is None and one.interval is None and format(one, ".3f") == "0.700"
    assert json.loads(json.dumps({"x": e})) == {"x": pytest.approx(2.5)}  # json keeps the mean
    # The plots' error bars (goat_jax.eval.plots, below this package) read the same half-width;
    # one seed and a plain number draw none.
    assert plots.error_bars([e, one, 0.5]) == [pytest.approx(e.half_width), 0.0, 0.0]


@pytest.mark.parametrize("values,sign,word", [
    ([-0.03, -0.02, -0.025], -1, stats.SUPPORTED), ([-0.03, -0.02, -0.025], +1, stats.CONTRADICTED),
    ([-0.03, 0.02, 0.001], -1, stats.INCONCLUSIVE), ([-0.5], -1, stats.ONE_SEED)])
def test_verdict_follows_the_interval_of_the_difference(values, sign, word):
    assert stats.verdict(stats.Estimate(values), sign) == word


def test_verdict_of_a_deterministic_number_and_bad_sign():
    assert stats.verdict(-1.0, -1) == stats.SUPPORTED and stats.verdict(0.5, -1) == stats.CONTRADICTED
    with pytest.raises(ValueError, match="claimed_sign: 0; give \\+1"):
        stats.verdict(1.0, 0)


def test_a_difference_equal_in_every_seed_says_its_interval_has_zero_width():
    """RoPE's passkey at 0% in every seed: the t rule calls it by its sign, and the printed
    difference says the interval is degenerate; a spread or one seed prints no such note."""
    floor = stats.judged("RoPE passkey <= 50%", True, "0%", stats.Estimate([0.0, 0.0, 0.0]) - 50, -1, "acc - 50")
    assert floor.verdict == stats.SUPPORTED and floor.seeds == 3
    assert floor.difference == "acc - 50 = -50.000 ± 0.000 (all 3 seeds equal: the interval has zero width)"
    spread = stats.judged("x", True, "", stats.Estimate([-1.0, -2.0, -3.0]), -1, "d")
    one = stats.judged("x", True, "", stats.Estimate([-1.0]), -1, "d")
    assert "seeds equal" not in spread.difference and "seeds equal" not in one.difference


def test_equal_seeds_are_constant_even_where_the_mean_rounds_away_from_them():
    """fsum([0.1] * 3) / 3 is 0.10000000000000002, not 0.1: the spread of equal seeds is still
    exactly zero, and the zero-width note and the plain printing both follow from it."""
    tenth = stats.Estimate([0.1, 0.1, 0.1])
    assert float(tenth) != 0.1 and tenth.constant and tenth.half_width == 0.0
    assert "seeds equal" in stats.judged("x", True, "", tenth, +1, "d").difference
    assert stats.seed_invariant(tenth) == 0.1
    assert stats.Estimate([0.5]).constant and not stats.Estimate([0.1, 0.2]).constant


def test_a_number_equal_in_every_seed_prints_without_an_interval():
    """A no-model reference computed on the same windows in every seed is printed as the plain
    number; one that varies keeps its interval; plain numbers pass through."""
    same, varies = stats.Estimate([0.585, 0.585, 0.585]), stats.Estimate([0.3, 0.4, 0.5])
    assert format(stats.seed_invariant(same), ".3f") == "0.585"
    assert stats.seed_invariant(varies) is varies and "±" in format(stats.seed_invariant(varies), ".3f")
    assert stats.seed_invariant(1.5) == 1.5


def test_aggregate_carries_the_seed_offsets_it_is_given():
    agg = stats.aggregate([{"x": 1.0}, {"x": 3.0}], seeds=[0, 2])
    assert agg["x"].seeds == (0, 2) and stats.aggregate([{"x": 1.0}])["x"].seeds == (0,)


def test_aggregate_keeps_structure_ints_and_strings():
    per_seed = [{"step": 4, "train_len": 32, "label": "goat", "by": {"32": {"ppl": 2.0}}, "l": [1.0, 2.0],
                 "only_in_first": 1},
                {"step": 4, "train_len": 32, "label": "goat", "by": {"32": {"ppl": 4.0}}, "l": [3.0, 4.0]}]
    agg = stats.aggregate(per_seed)
    assert agg["step"] == 4 and type(agg["step"]) is int and agg["label"] == "goat"
    assert agg["by"]["32"]["ppl"].values == (2.0, 4.0) and float(agg["by"]["32"]["ppl"]) == 3.0
    assert [x.values for x in agg["l"]] == [(1.0, 3.0), (2.0, 4.0)]
    assert "only_in_first" not in agg


def _vit(top1_1x, top1_2x):
    return {"step": 2, "train_resolution": 28, "eval_images": 16,
            "resolution": {"28": {"top1": top1_1x, "loss": 1.0}, "56": {"top1": top1_2x, "loss": 2.0}}}


def _dna(bits):
    by_length = {"64": {"bits_per_base": bits, "ppl": 2 ** bits, "accuracy": 0.3}}
    return {"train_len": 64, "heldout": {"by_length": by_length, "gc": {}}, "genomes": {}}


def test_family_checks_judge_paired_differences_over_seeds(tmp_path):
    """Made-up per-seed results, aggregated as the runner does: a difference that holds in
    every seed is supported (or contradicted), one that flips sign is inconclusive."""
    jobs = suites.plan(suites.SUITES["smoke"], str(tmp_path), families=["vit", "dna"])
    seeds = {"vit/vit/goat": [_vit(0.90, 0.80), _vit(0.91, 0.82), _vit(0.89, 0.79)],  # drops 10, 9, 10
             "vit/vit/ape": [_vit(0.90, 0.70), _vit(0.92, 0.70), _vit(0.90, 0.71)],  # drops 20, 22, 19
             "dna/dna/goat": [_dna(1.90), _dna(1.95), _dna(1.91)],
             "dna/dna/rope": [_dna(1.92), _dna(1.93), _dna(1.92)]}  # GOAT - RoPE: -0.02, +0.02, -0.01
    results = {k: stats.aggregate(v) for k, v in seeds.items()}
    checks = {c.claim.split(" (")[0]: c for c in vit_family.vision_checks(jobs, results)
              + dna_family.dna_checks(jobs, results, [])}
    drop = checks["ViT: GOAT loses less top-1 than ape at 2x the training resolution"]
    assert drop.verdict == stats.SUPPORTED and drop.ok is True
    diff = stats.Estimate([-10.0, -13.0, -9.0])
    assert drop.difference == f"GOAT drop - ape drop (points) = {diff:.2f}"
    assert "±" in drop.numbers
    nll = checks["DNA: GOAT held-out NLL < RoPE's at the training length"]
    assert nll.verdict == stats.INCONCLUSIVE
    assert re.search(r"= -0\.0033 ± 0\.\d{4}$", nll.difference)
    one = {k: stats.aggregate(v[:1]) for k, v in seeds.items()}  # one seed: never an interval
    assert {c.verdict for c in vit_family.vision_checks(jobs, one)} == {stats.ONE_SEED}


def test_evaluated_with_rows_are_planned_on_their_trained_run():
    suite = dataclasses.replace(suites.SUITES["smoke"], lm_variants=(LINEAR_AT_EVAL,))
    jobs = suites.plan(suite, "/r", families=["lm"], seeds=2)
    rows = [j for j in jobs if j.label == "goat@linear_sink"]
    # On the LM and on every retrieval task's model of its trained row, per seed, training nothing.
    assert [j.workdir for j in rows] == ["/r/jargon/goat", "/r/passkey/goat", "/r/niah/goat", "/r/jargon/goat_seed1",
                                         "/r/passkey/goat_seed1", "/r/niah/goat_seed1"] and not any(j.trains for j in rows)
    assert {j.name for j in rows} == {"lm/jargon/goat@linear_sink", "passkey/passkey/goat@linear_sink",
                                      "niah/niah/goat@linear_sink"}
    # A variant of model overrides trains its own retrieval models; one with its own LM config has none.
    trained = suites.LMVariant("goat+freq", "goat", {"model.learn_frequencies": True})
    own_config = suites.LMVariant("goat+ls", "goat", spec="configs/lm_tiny.py:{enc},linear_sink")
    names = {j.name: j for j in suites.plan(dataclasses.replace(suite, lm_variants=(trained, own_config)), "/r",
                                            families=["lm"])}
    assert names["passkey/passkey/goat+freq"].trains and names["niah/niah/goat+freq"].workdir == "/r/niah/goat+freq"
    assert names["niah/niah/goat+freq"].overrides["model.learn_frequencies"] is True
    assert "lm/jargon/goat+ls" in names and not any(n.endswith("/goat+ls") and not n.startswith("lm/") for n in names)
    assert [j.label for j in suites.plan(suite, "/r", ["rope"], families=["lm"]) if j.kind == "lm"] == ["rope"]
    bad = dataclasses.replace(suite, lm_variants=(dataclasses.replace(LINEAR_AT_EVAL, trained_as="gaot"),))
    with pytest.raises(ValueError, match="trained_as='gaot' is not a trained row of suite 'smoke'; choose from goat"):
        suites.plan(bad, "/r", families=["lm"])


def _lm_only_suite():
    """The smoke suite's language models alone (no retrieval, no toy), GOAT only: the
    fastest run of the seed machinery end to end."""
    return dataclasses.replace(suites.SUITES["smoke"], name="smoke_lm", tasks=(), toy="", encodings=("goat",),
                               lm_variants=(LINEAR_AT_EVAL,), retrieval_variants=(), multipliers=(1, 2),
                               standard_trials=1, sink_examples=1)


# An evaluated-with row: GOAT's trained run, evaluated with the sink MLP continued linearly past
# the training length (the same function up to it: docs/extrapolation.md).
LINEAR_AT_EVAL = suites.LMVariant("goat@linear_sink", "goat", trained_as="goat",
                                  eval_overrides={"model.sink_extrapolation": "linear"})


def _two_seeds(tmp_path, monkeypatch, capsys):
    """Runs the LM-only suite with 2 seeds; returns (argv, runs, out) after checking it."""
    monkeypatch.setitem(suites.SUITES, "smoke_lm", _lm_only_suite())
    runs, out = tmp_path / "runs", tmp_path / "out"
    argv = ["--suite", "smoke_lm", "--families", "lm", "--workdir", str(runs), "--out", str(out)]
    assert reproduce.main(argv + ["--seeds", "2"]) == 0
    log = capsys.readouterr().out
    assert "[2/4] lm/jargon/goat@seed1" in log  # the runs the checks read first, every seed
    # Seed 1 trains with the config's seed + 1, in the sibling workdir; seed 0 where 1 seed would.
    cfg = [json.loads((runs / "jargon" / d / "config.json").read_text()) for d in ("goat", "goat_seed1")]
    assert cfg[1]["seed"] == cfg[0]["seed"] + 1
    report = (out / "REPORT.md").read_text()
    assert "Seeds: 2" in report and stats.INTERVAL_NAME in report
    assert "trains nothing: the goat run evaluated with model.sink_extrapolation=linear" in report
    assert re.search(r"\| goat \| [\d.]+ ± [\d.]+ \| [\d.]+ ± [\d.]+ \|", report)  # perplexity by length
    saved = json.loads((out / "results.json").read_text())["lm/jargon/goat"]
    assert set(saved["seeds"]) == {"lm/jargon/goat", "lm/jargon/goat@seed1"}
    ppl = [saved["seeds"][k]["extrapolation"]["32"]["ppl"] for k in sorted(saved["seeds"])]
    assert ppl[0] != ppl[1] and saved["extrapolation"]["32"]["ppl"] == pytest.approx(np.mean(ppl))
    # The evaluated-with row shares GOAT's trained runs (no workdir of its own, its own cache),
    # evaluates them with the override (the same function up to the training length).
    assert not any(d.startswith("goat@") for d in os.listdir(runs / "jargon"))
    assert (runs / "jargon" / "goat_seed1" / "reproduce_eval_goat@linear_sink.json").exists()
    row = json.loads((out / "results.json").read_text())["lm/jargon/goat@linear_sink"]["seeds"]
    for k in ("", "@seed1"):
        plain, linear = saved["seeds"][f"lm/jargon/goat{k}"], row[f"lm/jargon/goat@linear_sink{k}"]
        assert linear["extrapolation"]["32"]["ppl"] == pytest.approx(plain["extrapolation"]["32"]["ppl"], rel=1e-6)
        assert linear["eval_settings"]["eval_overrides"] == {"model.sink_extrapolation": "linear"}
    job = next(j for j in suites.plan(_lm_only_suite(), str(runs), families=["lm"]) if not j.trains)
    run = lm_family.load_for_evaluation(job)
    assert run.model.config.sink_extrapolation == "linear" and run.config.model.sink_extrapolation == "linear"
    with pytest.raises(ValueError, match="change the model's parameters"):
        lm_family.load_for_evaluation(dataclasses.replace(job, eval_overrides={"model.num_layers": 3}))
    return argv, runs, out


@pytest.mark.slow(reason="the seeds harness end to end; its statistics are unit-tested in the default suite")
def test_two_seeds_end_to_end(tmp_path, monkeypatch, capsys):
    argv, runs, _ = _two_seeds(tmp_path, monkeypatch, capsys)
    assert not (runs / "jargon" / "goat.log").exists()  # --jobs 1: in this process, no worker logs
    # --status on the real workdirs: every run (trained + evaluated-with) is done, nothing to go.
    assert reproduce.main(argv + ["--seeds", "2", "--status"]) == 0
    text = capsys.readouterr().out
    assert "4 of 4 runs done" in text and "~0.0 h" in text and "not counted" not in text, text

    # --report_only with a third seed planned: the report of what finished, training nothing;
    # seed 2 is listed as left out, every row is over its 2 seeds and a check says so.
    def one_check(results, encodings, multiplier=16, dataset="jargon"):
        ppl = results["lm/jargon/goat"]["extrapolation"]["32"]["ppl"]
        return [stats.judged("GOAT perplexity above 1", True, f"{ppl:.2f}", ppl - 1, +1, "ppl - 1")]

    monkeypatch.setattr(lm_family, "lm_checks", one_check)
    assert reproduce.main(argv + ["--seeds", "3", "--report_only"]) == 0
    assert not (runs / "jargon" / "goat_seed2").exists()
    report = (tmp_path / "out" / "REPORT.md").read_text()
    assert "**Partial report** (`--report_only`" in report and "Seeds: 3" in report
    assert "left out: seed +2: `lm/jargon`: goat, goat@linear_sink." in report
    assert "**Rows with fewer than 3 seeds**" in report and "2 seeds: `lm/jargon`: goat, goat@linear_sink." in report
    assert re.search(r"\| GOAT perplexity above 1 \| \*\*supported\*\* \(2 of 3 seeds\) \|", report), report
    with pytest.raises(ValueError, match="--report_only: none of the 2 planned runs under .*none has finished"):
        reproduce.main(["--suite", "smoke_lm", "--families", "lm", "--workdir", str(tmp_path / "none"),
                        "--out", str(tmp_path / "out2"), "--report_only"])


@pytest.mark.slow(reason="starts a worker process per job (a fresh JAX each)")
def test_jobs_in_subprocesses_reuse_runs_and_report_a_failed_job(tmp_path, monkeypatch, capsys):
    argv, runs, out = _two_seeds(tmp_path, monkeypatch, capsys)
    # Again with --jobs 2 and a row whose config does not exist: the finished runs are reused
    # (nothing retrained or re-evaluated), the broken row is reported, exit code 1.
    broken = suites.LMVariant("broken", "goat", spec="configs/no_such_config.py:{enc}")
    monkeypatch.setitem(suites.SUITES, "smoke_lm", dataclasses.replace(_lm_only_suite(), lm_variants=(broken,)))
    assert reproduce.main(argv + ["--seeds", "1", "--jobs", "2"]) == 1
    log = capsys.readouterr().out
    assert "lm/jargon/broken FAILED" in log and "reused 1 finished and evaluated run(s); 1 to go" in log
    assert not (runs / "jargon" / "goat.log").exists()  # read in the parent: no worker, no job slot
    report = (out / "REPORT.md").read_text()
    assert "**Failed runs**" in report and "no_such_config" in report and "Seeds: 1" in report
    assert re.search(r"\| goat \| [\d.]+ \| [\d.]+ \|", report)  # one seed: plain numbers
    assert stats.ONE_SEED in report


@pytest.mark.slow(reason="trains the smoke language family at two seeds")
def test_issue_command_smoke_two_seeds_language(tmp_path):
    """The command of issue 19, as a user runs it (slow: every language stage twice)."""
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": suites.ROOT}
    subprocess.run([sys.executable, "-m", "experiments.reproduce", "--suite", "smoke", "--seeds", "2",
                    "--families", "lm", "--workdir", str(tmp_path / "runs"), "--out", str(out)],
                   check=True, cwd=suites.ROOT, env=env, capture_output=True, timeout=1800)
    report = (out / "REPORT.md").read_text()
    head = report.split("### Headline checks", 1)[1].split("\n### ", 1)[0]
    rows = [l for l in head.splitlines() if l.startswith("| GOAT") or l.startswith("| RoPE")]
    measured = [l for l in rows if "not measured" not in l]
    assert measured and all(re.search(r"\| \*{0,2}(supported|contradicted|inconclusive)\*{0,2} \|", l)
                            for l in measured)
    assert "±" in head
    assert re.search(r"Compute per seed .*seed \+0 [\d.]+ min over \d+ runs \(training [\d.]+\), seed \+1 [\d.]+ min", report)
    saved = json.loads((out / "results.json").read_text())
    assert set(saved["passkey/passkey/rope"]["seeds"]) == {"passkey/passkey/rope", "passkey/passkey/rope@seed1"}
    assert (out / "perplexity_jargon.png").stat().st_size > 1000


def test_results_json_drops_rows_of_a_rewritten_family_that_have_no_result_now():
    """A DNA row of an older protocol (no run of the current plan finished for it) leaves
    results.json when the DNA section is written again; the other families' rows stay; a row
    with seeds keeps each seed's values."""
    from goat_jax.reproduce import report

    old = {"dna/dna/alibi": {"bits": 1.9}, "dna/dna/goat": {"bits": 2.0}, "vit/vit/goat": {"top1": 0.8},
           "passkey/passkey/goat": {"acc": 1.0}}
    results = {"dna/dna/goat": {"bits": 1.94}}
    per_seed = {"dna/dna/goat": {"bits": 1.942}, "dna/dna/goat@seed1": {"bits": 1.944}}
    merged = report.merge_results(old, results, per_seed, {"dna"})
    assert set(merged) == {"dna/dna/goat", "vit/vit/goat", "passkey/passkey/goat"}
    assert merged["dna/dna/goat"] == {"bits": 1.94, "seeds": per_seed}
    assert report.merge_results(old, {}, None, {"lm"}) == {k: v for k, v in old.items() if k != "passkey/passkey/goat"}


def test_compute_per_seed_counts_reused_runs_by_their_own_stage_times():
    """A reused run has ~0 wall clock in this invocation but keeps the train/eval seconds it took
    when made; rows of another family are left out."""
    from goat_jax.reproduce import report

    timings = {"train vit/vit/goat": 600.0, "eval vit/vit/goat": 60.0, "wall vit/vit/goat": 0.1,
               "train vit/vit/goat@seed1": 500.0, "eval vit/vit/goat@seed1": 50.0,
               "wall vit/vit/goat@seed1": 560.0, "train vit/vit/ape@seed1": 100.0,
               "eval vit/vit/ape@seed1": 10.0, "wall vit/vit/ape@seed1": 111.0,
               "train dna/dna/goat": 900.0, "eval dna/dna/goat": 90.0, "wall dna/dna/goat": 990.0}
    got = report.compute_by_seed(timings, {"vit/vit/goat", "vit/vit/ape"})
    assert got == {0: {"stages": 660.0, "train": 600.0, "wall": 0.1, "runs": 1},
                   1: {"stages": 660.0, "train": 600.0, "wall": 671.0, "runs": 2}}


def test_status_counts_states_and_estimates_what_is_left(tmp_path, capsys):
    """--status on the smoke suite: nothing run yet is 'missing', a workdir without a checkpoint
    'started'; the estimate comes from finished runs of the same kind and names the kinds it
    cannot estimate."""
    from goat_jax.reproduce import status

    jobs = suites.plan(suites.SUITES["smoke"], str(tmp_path), seeds=2)
    lm_goat = next(j for j in jobs if j.name == "lm/jargon/goat" and j.seed_offset == 0)
    os.makedirs(lm_goat.workdir)
    states = [status.run_state(j, suites.SUITES["smoke"]) for j in jobs]
    by_name = {s.job.run_name: s.state for s in states}
    assert by_name["lm/jargon/goat"] == "started" and by_name["lm/jargon/rope"] == "missing"
    assert by_name["dna/dna/goat@seed1"] == "missing" and set(by_name.values()) <= {"started", "missing"}

    # The estimate, from made-up finished runs: one finished lm/jargon run (600 s + 60 s) ...
    done = status.RunState(lm_goat, "done", 4, 4, train_seconds=600.0, eval_seconds=60.0)
    rope = next(j for j in jobs if j.name == "lm/jargon/rope" and j.seed_offset == 0)
    half = status.RunState(rope, "partial", 2, 4)
    fresh = status.RunState(dataclasses.replace(rope, seed_offset=1), "missing", 0, 4)
    trained = status.RunState(dataclasses.replace(rope, seed_offset=2), "trained", 4, 4)
    vit = next(j for j in jobs if j.kind == "vit")
    left, unknown = status.remaining_seconds([done, half, fresh, trained, status.RunState(vit, "missing", 0, 2)])
    assert left == pytest.approx((300 + 60) + (600 + 60) + 60)  # half the training left, all, evaluation only
    assert unknown == ["vit/vit"]
    text = status.render([done, half, fresh, trained], suites.SUITES["smoke"], str(tmp_path), 3, jobs=2)
    assert "| lm | +0 | 1 | 0 | 1 | 0 | 0 | 0 |" in text and "| lm | +2 | 0 | 1 | 0 | 0 | 0 | 0 |" in text
    assert "lm/jargon/rope: partial (step 2/4)" in text and "~0.3 h of one job slot, ~0.1 h with 2 jobs" in text

    # Medians, and a row's own seeds first: a row slowed once by other work (fire) does not
    # inflate the others' estimate, and its own next seed is estimated from it.
    fire, nope = (dataclasses.replace(lm_goat, encoding=e) for e in ("fire", "nope"))  # rows of the tiny suite
    runs = [done, status.RunState(fire, "done", 4, 4, train_seconds=6000.0, eval_seconds=600.0),
            status.RunState(nope, "done", 4, 4, train_seconds=700.0, eval_seconds=70.0)]
    assert status.remaining_seconds(runs + [fresh])[0] == pytest.approx(700 + 70)  # the group's median
    fire1 = status.RunState(dataclasses.replace(fire, seed_offset=1), "missing", 0, 4)
    assert status.remaining_seconds(runs + [fire1])[0] == pytest.approx(6000 + 600)  # fire's own seed

    # Through the command line: prints, trains and writes nothing.
    assert reproduce.main(["--suite", "smoke", "--status", "--workdir", str(tmp_path / "none")]) == 0
    assert "runs (1 seed(s))" in capsys.readouterr().out and not (tmp_path / "none").exists()


def test_a_torn_evaluation_cache_is_evaluated_again_and_rewritten_whole(tmp_path, monkeypatch):
    """A suite killed while writing a run's evaluation cache left half a JSON file; the next
    invocation evaluates that run again (instead of failing it) and the cache is written to a
    temporary file and renamed, so it is whole or absent."""
    from goat_jax.reproduce import jobs as jobs_lib

    suite = suites.SUITES["smoke"]
    job = next(j for j in suites.plan(suite, str(tmp_path)) if j.name == "lm/jargon/goat")
    os.makedirs(job.workdir)
    with open(jobs_lib.cache_path(job), "w") as f:
        f.write('{"extrapolation": {"32": {"ppl"')
    calls = []
    monkeypatch.setitem(jobs_lib._EVALUATORS, "lm", lambda j, s, p: calls.append(j.name) or {"value": 1.5})
    # A finished run (only finished runs are evaluated), its newest checkpoint at step 20.
    monkeypatch.setattr(jobs_lib.trainer, "is_finished", lambda config, workdir: True)
    monkeypatch.setattr(jobs_lib.run_lib, "checkpoint_steps", lambda workdir: (20,))
    out = jobs_lib.evaluate(job, suite)
    assert calls == ["lm/jargon/goat"] and out["value"] == 1.5
    with open(jobs_lib.cache_path(job)) as f:
        assert json.load(f)["value"] == 1.5
    assert os.listdir(job.workdir) == [os.path.basename(jobs_lib.cache_path(job))]  # no temporary left
    assert jobs_lib.evaluate(job, suite)["value"] == 1.5 and calls == ["lm/jargon/goat"]  # cached now


def test_a_finished_evaluated_run_is_reused_without_a_trainer_and_a_changed_one_is_not(tmp_path, monkeypatch):
    """jobs.reused: a run trained to its last step with the job's config and evaluated with the
    suite's settings is read back (train seconds from its metrics, the cached evaluation) without
    starting a trainer; a job whose config differs from the checkpoint's, that wants more steps,
    or whose cache was made with other settings is left to run as usual."""
    from goat_jax.reproduce import jobs as jobs_lib

    suite = suites.SUITES["smoke"]
    job = next(j for j in suites.plan(suite, str(tmp_path)) if j.name == "lm/jargon/goat")
    assert jobs_lib.reused(job, suite) is None  # nothing trained yet
    monkeypatch.setitem(jobs_lib._EVALUATORS, "lm", lambda j, s, p: {"value": 1.5})
    first = jobs_lib.train_and_evaluate(job, suite)
    again = jobs_lib.reused(job, suite)
    assert again is not None and again["wall_seconds"] == 0.0
    assert again["train_seconds"] == first["train_seconds"] > 0
    assert again["result"] == first["result"] and again["result"]["value"] == 1.5

    def trainer_started(*args, **kwargs):
        raise AssertionError("a reused run must not start a trainer")

    monkeypatch.setattr(jobs_lib.trainer, "train_and_evaluate", trainer_started)
    assert jobs_lib.reused(job, suite)["result"]["value"] == 1.5
    changed = dataclasses.replace(job, overrides={**job.overrides, "model.num_layers": 3})
    longer = dataclasses.replace(job, overrides={**job.overrides, "num_train_steps": 2 * int(jobs_lib.job_config(job).num_train_steps)})
    other_settings = dataclasses.replace(suite, multipliers=(1,))
    assert jobs_lib.reused(changed, suite) is None and jobs_lib.reused(longer, suite) is None
    assert jobs_lib.reused(job, other_settings) is None
    # --status makes the same test: done as reused, 'changed' when the config is not the run's.
    from goat_jax.reproduce import status

    assert status.run_state(job, suite).state == "done" and status.run_state(changed, suite).state == "changed"
    assert status.run_state(longer, suite).state == "partial"
    assert status.run_state(job, other_settings).state == "trained"
    text = status.render([status.run_state(changed, suite)], suite, str(tmp_path), 1)
    assert "trained by another config than the job's" in text
    text = status.render([status.run_state(job, suite), status.run_state(changed, suite)], suite, str(tmp_path), 1)
    assert "Runs the headline checks read (trained first): lm 1 of 2 done" in text


def _made_up_results(jobs):
    """A result of the right shape for every job of a plan; the rows no headline check may read
    (LM variants, ALiBi/NoPE genomes, other retrieval tasks and variants) get values that would
    change the checks if they leaked in (a variant's perplexity below every baseline's)."""
    rng = np.random.default_rng(0)
    results = {}
    for j in jobs:
        low = bool(j.variant) or j.dataset != j.kind and j.kind != "lm"
        if j.kind == "lm":
            base = 1.0 if low else 6.0 + rng.random()
            results[j.name] = {"extrapolation": {str(n): {"ppl": base * (1 + 0.1 * i)}
                                                 for i, n in enumerate((64, 128, 512, 1024))}}
        elif j.kind in ("passkey", "niah"):
            acc = 0.3 if low else rng.random()
            results[j.name] = {"passkey": {"synthetic": {"64": 1.0, "512": acc}}}
        elif j.kind == "dna":
            results[j.name] = _dna(1.0 if j.encoding in ("alibi", "nope") else 1.9 + 0.1 * rng.random())
        elif j.kind == "vit":
            results[j.name] = _vit(0.8 + 0.1 * rng.random(), 0.5)
    return results


def test_the_runs_a_headline_check_reads_are_the_ones_trained_first():
    """feeds_checks of each family names exactly the runs its checks read: the checks are the
    same with only those runs' results; and queue_order trains them first, family by family in
    the --families order, seed by seed, then the rest."""
    from goat_jax.reproduce import jobs as jobs_lib
    from goat_jax.reproduce import runner

    jobs = suites.plan(suites.SUITES["tiny"], "/r", seeds=3)
    results = _made_up_results(jobs)
    feeding = {j.name for j in jobs if jobs_lib.FEEDS_CHECKS[j.family](j, suites.SUITES["tiny"])}
    only = {k: v for k, v in results.items() if k in feeding}
    encodings = list(suites.SUITES["tiny"].encodings)
    # 7 language checks; one DNA length (1x only) and ViT without canvas or prior: 1 + 2 checks.
    full = lm_family.lm_checks(results, encodings) + dna_family.dna_checks(jobs, results, []) \
        + vit_family.vision_checks(jobs, results)
    assert len(full) == 7 + 1 + 2 and lm_family.lm_checks(only, encodings) + dna_family.dna_checks(
        jobs, only, []) + vit_family.vision_checks(jobs, only) == full
    assert "lm/jargon/goat+logn" not in feeding and "dna/dna/alibi" not in feeding
    assert "passkey/passkey/rope" in feeding and "niah/niah/goat" not in feeding
    order = runner.queue_order(jobs, suites.SUITES["tiny"], ["lm", "dna", "vit"])
    assert sorted(map(id, order)) == sorted(map(id, jobs))  # a permutation
    # The check runs come first, with the trained runs their evaluated-with rows read
    # (niah/niah/goat for the rival check on niah/niah/goat+linear_sink), each before its reader.
    read = {j.workdir for j in jobs if j.name in feeding and not j.trains}
    first = {id(j) for j in jobs if j.name in feeding or (j.trains and j.workdir in read)}
    assert "niah/niah/goat" not in feeding and any(j.name == "niah/niah/goat" and id(j) in first for j in jobs)
    head = [(j.family, j.seed_offset) for j in order if id(j) in first]
    assert [(j.family, j.seed_offset) for j in order[:len(head)]] == head
    assert list(dict.fromkeys(head)) == [(f, k) for f in ("lm", "dna", "vit") for k in range(3)]
    rest = [j.seed_offset for j in order[len(head):]]
    assert rest == sorted(rest) and order[len(head)].name == "lm/jargon/goat+learn_frequencies"
    position = {id(j): i for i, j in enumerate(order)}
    for reader in (j for j in jobs if not j.trains):  # every evaluated-with row after the run it reads
        trained = next(j for j in jobs if j.trains and j.workdir == reader.workdir)
        assert position[id(trained)] < position[id(reader)], (reader.run_name, trained.run_name)
    # The paper suite's language checks judge its first LM dataset (C4 125M), not 'jargon', which
    # it does not have: its checks are measured, and its C4 runs are the ones trained first.
    paper = suites.SUITES["paper"]
    paper_jobs = suites.plan(paper, "/r", seeds=1)
    assert lm_family.headline_dataset(paper) == "c4_125m"
    lm_feeding = {j.name for j in paper_jobs if j.family == "lm" and jobs_lib.FEEDS_CHECKS["lm"](j, paper)}
    assert "lm/c4_125m/goat" in lm_feeding and not any("fineweb" in n for n in lm_feeding)
    paper_results = {k.replace("lm/jargon/", "lm/c4_125m/"): v for k, v in results.items()}
    assert lm_family.lm_checks(paper_results, encodings, dataset="c4_125m") == lm_family.lm_checks(results, encodings)


_CACHE_SCRIPT = """
import multiprocessing, os, sys
import jax.numpy as jnp

def compile_in_a_job():
    import jax
    jax.jit(lambda x: jnp.tanh(x @ x.T).sum()).lower(jnp.ones((8, 8))).compile()

if __name__ == "__main__":
    from goat_jax.reproduce import runner
    print(runner.use_compilation_cache(None, sys.argv[1]))
    job = multiprocessing.get_context("spawn").Process(target=compile_in_a_job)
    job.start(); job.join()
    assert job.exitcode == 0
"""


def test_jobs_share_a_compilation_cache_under_the_workdir(tmp_path, monkeypatch):
    """The harness points JAX's persistent cache at <workdir>/xla_cache and a job process it
    starts (spawn, as --jobs does) writes its compiled program there; 'none' turns it off and a
    JAX_COMPILATION_CACHE_DIR the user set is kept."""
    from goat_jax.reproduce import runner

    script = tmp_path / "cache_job.py"
    script.write_text(_CACHE_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    env.update(PYTHONPATH=suites.ROOT, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "runs")], env=env, cwd=suites.ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    folder = tmp_path / "runs" / "xla_cache"
    assert proc.stdout.strip() == str(folder) and any(folder.iterdir())

    monkeypatch.setattr(runner.jax.config, "update", lambda *a: None)  # leave this process's cache alone
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", "/users/own/cache")
    assert runner.use_compilation_cache(None, str(tmp_path)) == "/users/own/cache"
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR")
    assert runner.use_compilation_cache("none", str(tmp_path)) is None and "JAX_COMPILATION_CACHE_DIR" not in os.environ

