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
    cmds = capsys.readouterr().out.strip().splitlines()
    trains = [c for c in cmds if " experiments.train " in c]
    # 2 LMs (C4 125M, FineWeb 1.23B) + 2 retrieval tasks, each for the 6 encodings.
    assert len(trains) == 4 * len(reproduce.ENCODINGS)
    for enc in reproduce.ENCODINGS:
        assert f"--config configs/lm_c4_125m.py:{enc} --workdir /cluster/runs/c4_125m/{enc}" in cmds[
            [i for i, c in enumerate(cmds) if f"lm_c4_125m.py:{enc} " in c][0]]
        assert any(f"configs/lm_fineweb_1b.py:{enc} " in c for c in trains)
        assert any(f"configs/retrieval_tiny.py:passkey,{enc},paper " in c for c in trains)
    evals = [c for c in cmds if " experiments.evaluate " in c]
    assert len(evals) == 4  # c4, fineweb, passkey, niah: encodings side by side
    assert all(c.count("--workdir") == len(reproduce.ENCODINGS) for c in evals)
    assert any("--evals extrapolation,passkey,sinks --multipliers 1,2,4,8,16" in c for c in evals)
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
    assert len(lines) == 3 * len(reproduce.ENCODINGS) + 1  # LM, passkey, NIAH per encoding + toy
