"""The command lines report config and input errors in one line (the traceback only with
GOAT_DEBUG=1), exit non-zero and leave no workdir behind; list fields are set from the command
line by repeating the flag. Subprocesses of the real entry points (~5 s each)."""

import json
import os
import subprocess
import sys
import time

import pytest

from goat_jax.data import text

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(module, *args, debug=False, env=None):
    env = dict(os.environ, JAX_PLATFORMS="cpu", **(env or {}))
    env.pop("GOAT_DEBUG", None)
    if debug:
        env["GOAT_DEBUG"] = "1"
    return subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env=env)


def _train(workdir, *overrides, config="configs/lm_tiny.py:goat,smoke", debug=False, env=None):
    return _run("experiments.train", "--config", config, "--workdir", str(workdir),
                "--config.progress_bar=False", *overrides, debug=debug, env=env)


def _one_line_error(proc):
    """The single ``error:`` line of a failed command (absl's INFO lines may precede it)."""
    assert proc.returncode == 1, (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, proc.stderr[-2000:]
    return errors[0]


@pytest.mark.parametrize("overrides,config,expected", [
    (["--config.optimizer.learning_rate=-1"], "configs/lm_tiny.py:goat,smoke",
     "error: optimizer.learning_rate=-1.0 is out of range: allowed is a number finite in float32 > 0"),
    (["--config.data.lag=-1"], "configs/toy_copy_mixture.py:smoke", "error: data.lag=-1 is out of range"),
    ([], "configs/lm_tiny.py:goat,smok", "unknown config argument token 'smok'. accepted tokens"),
    # Refused by the data pipeline after validation: the workdir the trainer made is removed again.
    (["--config.data.paths=/nonexistent/corpus.txt"], "configs/lm_tiny.py:goat,smoke",
     "/nonexistent/corpus.txt'] matches no files"),
    # A --config.<field> flag naming no field: one line naming the flag, with ml_collections' guess.
    (["--config.model.fox_gate_bias_int=1.0"], "configs/lm_tiny.py:fox,smoke",
     "error: --config.model.fox_gate_bias_int: the config has no field 'fox_gate_bias_int' "
     "(Did you mean \"fox_gate_bias_init\""),
    # Was "q_positions: offset 0 + 20000000 tokens reaches past MAX_POSITION" from the model's init.
    (["--config.seq_len=20000000", "--config.model.max_len=20000000"], "configs/lm_tiny.py:goat,smoke",
     "error: seq_len=20000000 is out of range: allowed is an integer >= 1 and <= 16777216 (training "
     "context; positions must stay below MAX_POSITION=16777216 (2**24), goat_jax/prior/positions.py"),
], ids=["optimizer", "toy_data", "config_token", "data_file", "field_typo", "seq_len_max_position"])
def test_train_errors_are_one_line_and_leave_no_workdir(tmp_path, overrides, config, expected):
    workdir = tmp_path / "run"
    line = _one_line_error(_train(workdir, *overrides, config=config))
    assert expected in line, line
    assert not workdir.exists()


def test_debug_flag_shows_the_traceback(tmp_path):
    proc = _train(tmp_path / "run", "--config.optimizer.b2=1.5", debug=True)
    assert proc.returncode != 0 and "Traceback" in proc.stderr
    assert "optimizer.b2=1.5 is out of range" in proc.stderr
    assert not (tmp_path / "run").exists()


def test_evaluate_errors_are_one_line(tmp_path):
    line = _one_line_error(_run("experiments.evaluate", "--workdir", str(tmp_path / "missing"),
                                "--out", str(tmp_path / "eval")))
    assert "is not a run of experiments.train" in line or "not found" in line, line
    assert not (tmp_path / "eval").exists()


@pytest.mark.slow(reason="trains through the command line")
def test_list_fields_are_set_by_repeating_the_flag(tmp_path):
    """``--config.data.paths`` given twice trains on both files; eval_paths from one flag."""
    extra = tmp_path / "extra.txt"
    extra.write_text("\n\n".join(f"Entry {i}: some held-out words about hackers." for i in range(200)))
    workdir = tmp_path / "run"
    proc = _train(workdir, f"--config.data.paths={text.JARGON_FILE}", f"--config.data.paths={extra}",
                  f"--config.data.eval_paths={extra}", "--config.data.doc_split=paragraphs",
                  "--config.num_train_steps=2", "--config.checkpoint_every_steps=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    saved = json.loads((workdir / "config.json").read_text())["data"]
    assert saved["paths"] == [text.JARGON_FILE, str(extra)] and saved["eval_paths"] == [str(extra)]


def test_truncated_fasta_gz_is_one_line_and_leaves_no_workdir(tmp_path):
    """The file named, the fix given, and the workdir the trainer made removed again."""
    import gzip  # pylint: disable=g-import-not-at-top
    import numpy as np  # pylint: disable=g-import-not-at-top

    seq = "".join(np.random.default_rng(0).choice(list("ACGT"), 100_000))
    data = gzip.compress((">r1\n" + seq + "\n").encode())
    path = tmp_path / "cut.fa.gz"
    path.write_bytes(data[:len(data) // 2])
    workdir = tmp_path / "run"
    line = _one_line_error(_train(workdir, f"--config.data.paths={path}", config="configs/dna_tiny.py:goat,smoke"))
    assert f"{path}: the compressed FASTA is truncated or corrupt (EOFError" in line, line
    assert not workdir.exists()


def test_data_paths_naming_a_directory_is_one_line(tmp_path):
    """A directory in data.paths is named with the fix, not a raw IsADirectoryError."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("some words\n")
    workdir = tmp_path / "run"
    line = _one_line_error(_train(workdir, f"--config.data.paths={corpus}"))
    assert f"data.paths names the directory ['{corpus}'], not files" in line, line
    assert "IsADirectoryError" not in line
    assert not workdir.exists()


def test_toy_prior_refuses_a_bad_seq_len_before_training(tmp_path):
    """``--seq_len 0`` is refused before the toy trains: no workdir, no checkpoint."""
    workdir = tmp_path / "toy"
    line = _one_line_error(_run("experiments.toy_prior", "--seq_len", "0", "--workdir", str(workdir)))
    assert "--seq_len=0 is out of range" in line, line
    assert not workdir.exists()


def _no_wandb_login(tmp_path, **extra):
    """An environment where wandb finds no credentials of this machine's user."""
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    env = {"HOME": str(home), "WANDB_CONFIG_DIR": str(home / ".config" / "wandb"),
           "NETRC": str(home / ".netrc"), "WANDB_SILENT": "true", **extra}
    for name in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_DIR"):
        env.setdefault(name, "")  # empty: unset for wandb (the caller's own key is not used)
    return env


@pytest.mark.parametrize("env,expected", [
    ({}, "error: config.wandb.mode='online' needs W&B credentials for http://127.0.0.1:9 and none "
         "were found: set WANDB_API_KEY or run `wandb login`"),
    # A key (a fake one) but no W&B server to answer: refused in seconds, not after wandb's 90 s.
    ({"WANDB_API_KEY": "0123456789abcdef0123456789abcdef01234567"},
     "error: config.wandb.mode='online' cannot reach the W&B server http://127.0.0.1:9 within 5 s"),
], ids=["no_api_key", "unreachable"])
def test_wandb_online_without_login_or_network_is_one_line_and_leaves_no_workdir(
        tmp_path, env, expected):
    """Was wandb's UsageError / CommError traceback (after ~9 s / ~109 s) with config.json,
    checkpoints/, wandb_run_id and .lock left in the workdir."""
    workdir = tmp_path / "run"
    start = time.monotonic()
    line = _one_line_error(_train(workdir, "--config.wandb.mode=online", env=_no_wandb_login(
        tmp_path, WANDB_BASE_URL="http://127.0.0.1:9", **env)))  # port 9: nothing listens
    assert expected in line, line
    assert "--config.wandb.mode=offline" in line and "wandb sync WORKDIR/wandb/offline-run-*" in line
    assert time.monotonic() - start < 60
    assert not workdir.exists()


@pytest.mark.parametrize("overrides", [
    ["--config.per_device_batch_size=3"],  # replaces the file's global_batch_size (logged)
    ["--config.global_batch_size=None", "--config.per_device_batch_size=3"],  # None parses
], ids=["per_device_replaces_global", "global_none"])
def test_per_device_batch_size_is_reachable_from_the_command_line(tmp_path, overrides):
    """Was "Set exactly one of ..." (every config sets global_batch_size) and "invalid literal
    for int()" for None. A grad_accum_steps of 2 that 3 rows do not divide shows which batch
    size the trainer resolved, before any work."""
    workdir = tmp_path / "run"
    proc = _train(workdir, *overrides, "--config.grad_accum_steps=2")
    line = _one_line_error(proc)
    assert "error: per_device_batch_size=3 gives a global batch of 3, which must be divisible" in line, line
    replaced = "--config.per_device_batch_size=3 replaces the config file's global_batch_size=8"
    assert (replaced in proc.stderr) == (len(overrides) == 1), proc.stderr[-2000:]
    assert not workdir.exists()


def test_none_for_a_field_that_cannot_be_none_is_one_line(tmp_path):
    line = _one_line_error(_train(tmp_path / "run", "--config.progress_bar=None"))
    assert "error: --config.progress_bar=None: progress_bar is a bool field, which cannot be None" in line
    line = _one_line_error(_train(tmp_path / "run", "--config.num_train_steps=None"))
    assert "error: num_train_steps=None is not set: allowed is an integer >= 1" in line, line
    assert not (tmp_path / "run").exists()


def test_a_single_document_held_out_entirely_is_one_line(tmp_path):
    """Was "the training split has 0 documents for process_count=1 hosts" without why: eval
    takes at least one document, and there is only one."""
    corpus = tmp_path / "one.txt"
    corpus.write_text("A single paragraph of text, the whole corpus.\n")
    workdir = tmp_path / "run"
    line = _one_line_error(_train(workdir, f"--config.data.paths={corpus}"))
    assert ("error: data.paths: the data has only 1 document, and the held-out eval split "
            "(data.eval_fraction=0.02) takes 1 (at least one), leaving none to train on") in line, line
    assert "data.eval_paths" in line and "data.doc_split='paragraphs'" in line
    assert not workdir.exists()


def _checkpointed_run(workdir, step, **overrides):
    """A workdir holding a checkpoint at ``step`` of ``configs/lm_tiny.py:goat,smoke`` as the
    command line resolves it (the fingerprint the trainer compares; the state is a stand-in)."""
    import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
    from goat_jax.config import files as config_files  # pylint: disable=g-import-not-at-top
    from goat_jax.train import checkpoint, run, tasks, trainer  # pylint: disable=g-import-not-at-top

    config = config_files.load_config("configs/lm_tiny.py:goat,smoke",
                                      {"progress_bar": False, **overrides})
    global_batch = trainer.validate_config(config, 1).global_batch
    task = tasks.get_task(config.task)
    fields = trainer._fingerprinted(tasks.with_field_defaults(config, task), global_batch)  # pylint: disable=protected-access
    ckpt = checkpoint.Checkpointer(run.checkpoint_dir(str(workdir)), fields,
                                   resume_safe_fields=task.resume_safe_fields,
                                   field_defaults=tasks.field_defaults(task))
    ckpt.save(step, {"step": jnp.array(step, jnp.int32)}, {"i": step}, wait=True)
    ckpt.close()


def test_resume_with_changes_below_the_current_step_is_refused(tmp_path):
    """Was accepted silently: nothing trained, and config.json / config_changes.jsonl recorded
    the run as num_train_steps=2 although it is at step 4."""
    workdir = tmp_path / "run"
    _checkpointed_run(workdir, 4, num_train_steps=6)
    before = set(os.listdir(workdir))
    line = _one_line_error(_train(workdir, "--resume_with_changes", "--config.num_train_steps=2"))
    assert ("error: num_train_steps=2 is below the run's current step 4 (the newest checkpoint in "
            f"{workdir}/checkpoints); a resumed run cannot go back: give "
            "--config.num_train_steps=4 or more") in line, line
    assert set(os.listdir(workdir)) == before | {".lock"}  # nothing written but the lock
    assert os.listdir(workdir / "checkpoints") == ["4"]


def test_a_refused_run_removes_what_it_created_and_only_that(tmp_path):
    """A run refused after the trainer started writing (here: no data file) left config.json,
    .lock, an empty checkpoints/, metrics.jsonl and an event file in an existing folder (the
    leftover config.json then made `evaluate --out` refuse it), and the parents it created for
    a new nested workdir."""
    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "notes.txt").write_text("the user's")
    (existing / "tensorboard").mkdir()  # an entry that was there stays, even if the run uses it
    nested = tmp_path / "new" / "deeper" / "run"
    for workdir in (existing, nested):
        line = _one_line_error(_train(workdir, "--config.data.paths=/nonexistent/corpus.txt"))
        assert "matches no files" in line
    assert sorted(os.listdir(existing)) == [".lock", "notes.txt", "tensorboard"]  # the lock stays (lock.py)
    assert sorted(os.listdir(tmp_path)) == ["existing"]
