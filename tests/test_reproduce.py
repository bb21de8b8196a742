"""The reproduction harness: the smoke suite end to end into a tmp dir (every stage: training,
extrapolation, standard and synthetic passkey, NIAH, sinks, the toy figure, REPORT.md), and the
paper suite's dry run (commands built from configs that validate, nothing run)."""

import os
import re
import shlex

import pytest

from experiments import reproduce
from goat_jax.train import trainer


def test_smoke_suite_writes_report_with_every_table(tmp_path, capsys):
    runs, out = tmp_path / "runs", tmp_path / "report"
    rc = reproduce.main(["--suite", "smoke", "--encodings", "goat", "--workdir", str(runs),
                         "--out", str(out)])
    assert rc == 0
    report = (out / "REPORT.md").read_text()
    for heading in ("## Setup", "## Headline checks", "## Perplexity by evaluation length",
                    "## Synthetic passkey", "## Standard passkey prompt", "## Needle in a haystack",
                    "## Attention sinks", "## Toy copy mixture", "## Run times"):
        assert heading in report, heading
    # Tables have a row per encoding and one column per evaluated length (1x and 16x).
    assert re.search(r"\| goat \| [\d.]+ \| [\d.]+ \|", report)
    assert "| encoding | 32 (1x) | 512 (16x) |" in report
    assert "Command: `python -m experiments.reproduce --suite smoke" in report
    for png in ("perplexity_jargon.png", "passkey_synthetic.png", "niah_goat.png", "toy_prior.png",
                "toy_prior_all_heads.png"):
        assert (out / png).stat().st_size > 1000, png
    log = capsys.readouterr().out
    assert "[1/4] lm/jargon/goat" in log and "at step 4 after" in log and "evaluated in" in log
    # A second run finds every run trained and evaluated (cached) and only rewrites the report.
    assert reproduce.main(["--suite", "smoke", "--encodings", "goat", "--workdir", str(runs),
                           "--out", str(out)]) == 0
    assert "evaluated in" not in capsys.readouterr().out


def test_paper_dry_run_prints_commands_for_every_run(capsys):
    assert reproduce.main(["--suite", "paper", "--dry_run", "--workdir", "/cluster/runs",
                           "--out", "/cluster/report"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    cmds = [c for c in lines if not c.startswith("#")]
    # First the size / budget / official-recipe table (experiments/paper_table.py), as comments.
    rows = [c for c in lines if c.startswith("# | ") and "/" in c.split("|")[1]]
    assert len(rows) == 4 * len(reproduce.ENCODINGS) + 1  # + the toy
    assert all(c.endswith("| none |") for c in rows if "c4_125m" in c or "retrieval_tiny" in c)
    trains = [c for c in cmds if " experiments.train " in c]
    # 2 LMs (C4 125M, FineWeb 1.23B) + 2 retrieval tasks, each for the 6 encodings.
    assert len(trains) == 4 * len(reproduce.ENCODINGS)
    for enc in reproduce.ENCODINGS:
        assert f"--config configs/lm_c4_125m.py:{enc} --workdir /cluster/runs/c4_125m/{enc}" in cmds[
            [i for i, c in enumerate(cmds) if f"lm_c4_125m.py:{enc} " in c][0]]
        assert any(f"configs/lm_fineweb_1b.py:{enc} " in c for c in trains)
        assert any(f"configs/retrieval_tiny.py:passkey,{enc},paper,official " in c for c in trains)
    evals = [c for c in cmds if " experiments.evaluate " in c]
    assert len(evals) == 4  # c4, fineweb, passkey, niah: encodings side by side
    assert all(c.count("--workdir") == len(reproduce.ENCODINGS) for c in evals)
    assert any("--evals extrapolation,passkey,sinks,diagnostics --chunk_size 512 --multipliers 1,2,4,8,16"
               in c for c in evals)
    assert cmds[-1].startswith("python -m experiments.toy_prior")


@pytest.mark.parametrize("suite", ["paper", "tiny"])
def test_every_planned_config_validates(suite):
    """Each run the suite would launch has a config that passes the engine's checks (paper
    runs on 8 devices), so a cluster job does not fail on a typo hours in."""
    s = reproduce.SUITES[suite]
    for job in reproduce.plan(s, "/runs", reproduce.ENCODINGS):
        config = reproduce.load_config(job.spec, job.overrides)
        trainer.validate_config(config, num_devices=8 if suite == "paper" else 1)
        if job.kind != "toy":
            assert config.model.position_encoding == job.encoding


def test_paper_commands_parse_as_shell():
    cmds = reproduce.paper_commands(reproduce.SUITES["paper"], "/r", ["goat"], "/o")
    for cmd in cmds:
        argv = shlex.split(cmd)
        assert argv[:2] == ["python", "-m"]
        for flag in argv:
            if flag.startswith("--config") and "=" in flag:
                assert flag.split("=")[0].count(".") >= 1
    for cmd in cmds:
        if "--config " in cmd:
            path = cmd.split("--config ")[1].split()[0].split(":")[0]
            assert os.path.exists(os.path.join(reproduce.ROOT, path)), path
    assert "--out /o/c4_125m" in " ".join(cmds) and "--out /o/passkey" in " ".join(cmds)


def test_dry_run_of_cpu_suite_lists_the_plan(capsys):
    assert reproduce.main(["--suite", "tiny", "--dry_run"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    # LM, passkey, NIAH per encoding, the official-synthetic passkey and NIAH per encoding, the toy,
    # and the extra LM rows
    assert len(lines) == 5 * len(reproduce.ENCODINGS) + 1 + len(reproduce.SUITES["tiny"].lm_variants)
    assert sum("retrieval_tiny.py:niah,rope,official" in line for line in lines) == 1
    assert sum("lm_tiny.py:goat,linear_sink" in line for line in lines) == 1


def test_variants_are_one_line_entries_planned_and_rendered(tmp_path):
    """An LM variant adds a row to the LM tables and a retrieval variant its own tables, each
    from one Suite entry (rendered here from made-up results: no training)."""
    import dataclasses

    from experiments import report_lm

    suite = dataclasses.replace(
        reproduce.SUITES["smoke"],
        lm_variants=(reproduce.LMVariant("goat+opt", "goat", {"model.rope_base": 500.0}),),
        retrieval_variants=(reproduce.RetrievalVariant("official", "configs/retrieval_tiny.py:{task},{enc},smoke"),))
    jobs = reproduce.plan(suite, "/runs")
    names = [j.name for j in jobs]
    assert names[:3] == ["lm/jargon/goat", "lm/jargon/rope", "lm/jargon/goat+opt"]
    variant = jobs[2]
    assert variant.workdir == "/runs/jargon/goat+opt" and variant.encoding == "goat"
    assert variant.overrides == {**suite.lm_overrides, "model.rope_base": 500.0}
    assert "passkey_official/rope" in " ".join(names) and "niah_official/goat" in " ".join(names)
    assert [j.workdir for j in jobs if j.dataset == "passkey_official"] == [
        "/runs/passkey_official/goat", "/runs/passkey_official/rope"]
    for job in jobs:  # every planned config builds, with the overrides applied
        config = reproduce.load_config(job.spec, job.overrides)
        assert config.model.position_encoding == job.encoding
    # The paper commands name every run when a group holds a variant (two runs share 'goat').
    cmds = reproduce.paper_commands(suite, "/r", ["goat", "rope"], "/o")
    lm_eval = next(c for c in cmds if "experiments.evaluate" in c and "/jargon/" in c)
    assert "--workdir /r/jargon/goat+opt --label goat+opt" in lm_eval and "--label rope" in lm_eval

    rng = iter(range(1, 1000))
    results = {}
    for j in jobs:
        if j.kind == "lm":
            results[j.name] = {"train_len": 32, "extrapolation": {32: {"ppl": 2.0 + next(rng)}, 512: {"ppl": 9.0}}}
        elif j.kind == "passkey":
            results[j.name] = {"train_len": 32, "passkey": {"synthetic": {32: 1.0, 512: next(rng) / 100}}}
        elif j.kind == "niah":
            results[j.name] = {"train_len": 32, "niah": {"lengths": [32, 512], "depths": [0.5],
                                                         "token_accuracy": [[1.0], [0.5]],
                                                         "exact_match": [[1.0], [0.0]]}}
    md = "\n".join(report_lm.lm_sections(suite, jobs, results, str(tmp_path)))
    assert re.search(r"\| goat\+opt \| 5\.000 \| 9\.000 \|", md)  # the variant's own numbers
    assert "## Synthetic passkey, official variant" in md
    assert "## Needle in a haystack, official variant" in md
    assert md.index("## Synthetic passkey (") < md.index("## Synthetic passkey, official")
    for png in ("passkey_synthetic.png", "passkey_synthetic_official.png", "niah_official_goat.png"):
        assert (tmp_path / png).stat().st_size > 1000, png
    # The headline checks judge the plain encodings only.
    checks = report_lm.lm_checks(results, ["goat", "rope"])
    assert any("GOAT in-distribution" in c[0] and "rope" in c[2] for c in checks)
