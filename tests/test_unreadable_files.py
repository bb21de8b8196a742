"""Readers that used to turn an unreadable file into "absent" (or fail without naming it) name the
file now (issue #67's sweep of item 9; the run record itself: tests/test_reproduce_records.py).
Each case writes a damaged file and reads it the way the code does, in process, in milliseconds."""

import json
import logging
import os
import warnings

import ml_collections
import pytest

from goat_jax.train import metrics as metrics_lib
from goat_jax.train import run as run_lib


def test_a_torn_config_json_is_named(tmp_path):
    (tmp_path / "config.json").write_text('{"task": "lm", "mod')
    with pytest.raises(ValueError, match=rf"{tmp_path / 'config.json'} is unreadable \(JSONDecodeError"):
        run_lib.read_config(str(tmp_path))


def test_a_damaged_metrics_line_is_named_by_the_reader_and_by_the_resume_trim(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "train_loss": 2.0}\n{"step": 2, "tr\x00\n{"step": 3, "train_loss": 1.5}\n'
                    '{"step": 4, "train_lo')
    with pytest.warns(UserWarning, match=r"metrics.jsonl: line 2 of 4 is not JSON and is skipped"):
        rows = run_lib.read_metrics(str(tmp_path))
    assert [r["step"] for r in rows] == [1, 3]
    with warnings.catch_warnings():  # a torn last line alone (a live or killed run) is no news
        warnings.simplefilter("error")
        path.write_text('{"step": 1, "train_loss": 2.0}\n{"step": 2, "tr')
        assert [r["step"] for r in run_lib.read_metrics(str(tmp_path))] == [1]
    path.write_text('{"step": 1}\n{"step": 2, "tr\x00\n{"step": 3}\n')
    with caplog.at_level(logging.WARNING):
        metrics_lib.truncate_jsonl(str(path), 5)
    assert f"{path}: dropped 1 unreadable line(s) (line 2 of 3" in caplog.text
    assert [json.loads(l)["step"] for l in path.read_text().splitlines()] == [1, 3]


def test_an_empty_wandb_run_id_is_not_taken_for_a_new_run(tmp_path):
    """An empty ``wandb_run_id`` made wandb start a new W&B run (no id) for a resumed workdir."""
    pytest.importorskip("wandb")
    from goat_jax.train import wandb_logger  # pylint: disable=g-import-not-at-top

    (tmp_path / wandb_logger.RUN_ID_FILE).write_text("\n")
    config = ml_collections.ConfigDict({"mode": "offline"})
    with pytest.raises(ValueError, match=r"wandb_run_id holds no W&B run id \(''\)"):
        wandb_logger.WandbLogger(config, {}, str(tmp_path))


def test_harness_caches_that_are_not_json_objects_are_named_and_redone(tmp_path, capsys):
    from goat_jax.reproduce import progress  # pylint: disable=g-import-not-at-top

    path = tmp_path / "reproduce_eval.lengths.json"
    path.write_text("[1, 2]")
    held = progress.LengthProgress(str(path), {"k": 1}, name="lm/x", log=True)
    assert held.lengths() == []
    assert f"lm/x: the finished lengths in {path} are unreadable (a JSON list, not an object)" in capsys.readouterr().out
    assert os.path.exists(path)  # left for the next put to replace whole
