"""``python -m experiments.sample`` on real checkpoints of the trainer: a tiny language run (two
steps of configs/lm_tiny.py:goat,smoke) and a tiny genome run (configs/dna_tiny.py:goat,smoke), each
also with the KV cache split over 4 fake CPU devices (``--mesh_context 4``).
Greedy continuations equal an independent reference (the model's full forward pass re-run on
the growing sequence, argmax, no KV cache); every refusal is one line, before any weights are
read."""

import io
import json
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import sample as sample_cli
from goat_jax.data import fasta
from goat_jax.data import tokenizers
from goat_jax.eval import lm_run, samples
from tests.config_helpers import lm_smoke_config, set_fields

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def lm_workdir(tmp_path_factory):
    """Two trainer steps of the smoke LM, checkpoints at steps 1 and 2."""
    from goat_jax.train import trainer

    workdir = str(tmp_path_factory.mktemp("sample") / "lm")
    trainer.train_and_evaluate(lm_smoke_config(num_train_steps=2, checkpoint_every_steps=1, eval_every_steps=0,
                                               **{"optimizer.warmup_steps": 1}), workdir)
    return workdir


@pytest.fixture(scope="module")
def dna_workdir(tmp_path_factory):
    """Two trainer steps of the smoke genome LM."""
    from configs import dna_tiny
    from goat_jax.train import trainer

    workdir = str(tmp_path_factory.mktemp("sample") / "dna")
    config = set_fields(dna_tiny.get_config("goat,smoke"), num_train_steps=2, checkpoint_every_steps=2,
                        eval_every_steps=0, progress_bar=False)
    trainer.train_and_evaluate(config, workdir)
    return workdir


def reference_greedy(workdir: str, ids, n: int, step=None) -> list:
    """``n`` greedy tokens after ``ids`` by re-running the whole sequence each step (no cache,
    no generate), argmax in float64."""
    run = lm_run.load_lm_run(workdir, step)
    apply = jax.jit(lambda p, t: run.model.apply({"params": p}, t))
    seq = list(ids)
    for _ in range(n):
        logits = np.asarray(apply(run.params, jnp.asarray([seq], jnp.int32))[0, -1], np.float64)
        seq.append(int(np.argmax(logits)))
    return seq[len(ids):]


@pytest.mark.parametrize("mesh_context", [1, 4])
def test_the_command_continues_a_text_prompt_greedily_as_the_reference(lm_workdir, tmp_path, mesh_context):
    """The end-to-end test of the default suite: the real command, a few greedy tokens, on one
    device and with the KV cache split over 4 (fake CPU) devices."""
    out = tmp_path / "samples.jsonl"
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={max(mesh_context, 1)}")
    proc = subprocess.run([sys.executable, "-m", "experiments.sample", "--workdir", lm_workdir, "--prompt",
                           "The hacker", "--max_new_tokens", "6", "--temperature", "0", "--out", str(out),
                           "--mesh_context", str(mesh_context)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0] == "=== prompt 1/1 (--prompt) 'The hacker', sample 1/1 ==="
    # One device streams and times the decoding alone; split, the wall clock times it all.
    assert lines[-1].startswith("tokens/s: ") and ("5 tokens after each batch's first" in lines[-1]
                                                   if mesh_context == 1 else "6 tokens in" in lines[-1]), lines[-1]
    assert "loading" in proc.stderr and "(step 2)" in proc.stderr  # progress on stderr, the last checkpoint
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    tok = tokenizers.ByteTokenizer()
    want = reference_greedy(lm_workdir, [tok.bos_id] + tok.encode("The hacker"), 6)
    assert row["tokens"] == want and row["prompt_tokens"] == 11 and row["step"] == 2
    eos = want.index(tok.eos_id) if tok.eos_id in want else None
    assert row["eos_at"] == eos and row["continuation"] == tok.decode(want[:eos])
    assert row["continuation"] in proc.stdout


def test_a_prompt_file_batches_samples_reproducibly_at_the_step_asked(lm_workdir, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("The cat\nA prompt of another length\n")
    argv = ["--workdir", lm_workdir, "--prompt_file", str(prompts), "--num_samples", "2", "--max_new_tokens", "5",
            "--temperature", "0.9", "--top_k", "40", "--seed", "3", "--step", "1"]
    first = sample_cli.main(argv)
    printed = capsys.readouterr().out
    assert [(r["prompt_index"], r["sample_index"]) for r in first] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert {r["step"] for r in first} == {1} and all(len(r["tokens"]) == 5 for r in first)
    assert [r["prompt_source"] for r in first[::2]] == [f"{prompts} line 1", f"{prompts} line 2"]
    assert "=== prompt 2/2" in printed and "sample 2/2 ===" in printed
    assert printed.splitlines()[-1].startswith("tokens/s")
    assert sample_cli.main(argv) == first  # the same command, the same samples
    again = sample_cli.main([a if a != "3" else "4" for a in argv])  # --seed 4
    assert [r["tokens"] for r in again] != [r["tokens"] for r in first]


@pytest.mark.slow(reason="trains a second run, a genome one (~16 s on 2 cores); the text run's tests run by default")
def test_a_genome_run_continues_bases_greedily_as_the_reference(dna_workdir, tmp_path):
    out = tmp_path / "dna.jsonl"
    rows = sample_cli.main(["--workdir", dna_workdir, "--prompt", "acgtTGCAR", "--max_new_tokens", "8",
                            "--temperature", "0", "--out", str(out)])
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert row == rows[0]
    ids = fasta.encode("ACGTTGCAN")[0].tolist()  # R (IUPAC) is read as N; no BOS for genomes
    assert row["tokens"] == reference_greedy(dna_workdir, ids, 8)
    assert row["continuation"] == fasta.decode(row["tokens"]) and row["eos_at"] is None


def test_a_genome_run_continues_bases_with_the_cache_split_over_context_4(dna_workdir, tmp_path):
    """The command on a genome run with ``--mesh_context 4`` (4 fake CPU devices): the KV cache's
    slots split over them (goat_jax/kernels/decode_merge.py), the bases of the full-forward
    reference."""
    out = tmp_path / "dna4.jsonl"
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=4")
    proc = subprocess.run([sys.executable, "-m", "experiments.sample", "--workdir", dna_workdir, "--prompt",
                           "acgtTGCAR", "--max_new_tokens", "8", "--temperature", "0", "--out", str(out),
                           "--mesh_context", "4"], cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines()[-1].startswith("tokens/s: ") and "8 tokens in" in proc.stdout.splitlines()[-1]
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    ids = fasta.encode("ACGTTGCAN")[0].tolist()
    assert row["tokens"] == reference_greedy(dna_workdir, ids, 8)
    assert row["continuation"] == fasta.decode(row["tokens"]) and row["continuation"] in proc.stdout


def _copy_run(workdir, tmp_path, **config_changes):
    """``workdir`` copied with fields of its config.json changed (dotted keys)."""
    dest = tmp_path / "changed"
    shutil.copytree(workdir, dest)
    path = dest / "config.json"
    config = json.loads(path.read_text())
    for key, value in config_changes.items():
        node = config
        *parents, leaf = key.split(".")
        for p in parents:
            node = node[p]
        node[leaf] = value
    path.write_text(json.dumps(config))
    return str(dest)


@pytest.mark.parametrize("argv, changes, match", [
    (["--workdir", "{tmp}/missing", "--prompt", "x"], None, "--workdir .*missing: no such directory"),
    (["--prompt", ""], {}, "--prompt is empty"),
    (["--prompt_file", "{tmp}/blank.txt"], {}, "line\\(s\\) 2 are empty"),
    (["--prompt", "x", "--prompt_file", "{tmp}/blank.txt"], {}, "give one of --prompt TEXT or --prompt_file"),
    (["--prompt", "x", "--temperature", "nan"], {}, "--temperature must be a finite number >= 0"),
    (["--prompt", "x", "--temperature", "inf"], {}, "--temperature must be a finite number >= 0"),
    (["--prompt", "x", "--temperature", "0", "--top_k", "5"], {}, "--top_k applies to sampling"),
    (["--prompt", "x", "--temperature", "0", "--num_samples", "3"], {}, "identical copies"),
    (["--prompt", "x", "--top_k", "300"], {}, "--top_k 300 exceeds the run's vocabulary of 259"),
    (["--prompt", "x", "--max_new_tokens", "0"], {}, "--max_new_tokens must be an integer >= 1"),
    (["--prompt", "x", "--mesh_context", "64"], {}, "--mesh_context 64: the KV cache would be split over 64 "
                                                  "devices, but this process sees"),
    (["--prompt", "x", "--step", "7"], {}, "--step 7: .* holds checkpoints at step\\(s\\) 1, 2"),
    (["--prompt", "x"], {"task": "vit"}, "is a vision run of config.task='vit'"),
    (["--prompt", "x"], {"data.source": "synthetic"}, "synthetic task"),
    (["--prompt", "y" * 20], {"model.position_encoding": "learned", "model.max_len": 16},
     "the prompt is 21 tokens, longer than the 16 positions"),
    (["--prompt", "y" * 8, "--max_new_tokens", "10"], {"model.position_encoding": "learned", "model.max_len": 16},
     "need 19 positions, but the model holds 16; lower --max_new_tokens to <= 7"),
    (["--prompt", "x", "--out", "{run}/x.jsonl"], {}, "is inside the run workdir"),
    (["--prompt", "x", "--out", "{tmp}/exists.jsonl"], {}, "exists; give another file, or add --overwrite"),
], ids=["missing_workdir", "empty_prompt", "blank_line", "both_prompts", "nan_temperature", "inf_temperature",
        "greedy_top_k", "greedy_samples", "top_k_vocab", "no_tokens", "mesh_context", "missing_step", "vit",
        "synthetic", "prompt_too_long", "prompt_and_tokens_too_long", "out_in_run", "out_exists"])
def test_each_refusal_names_the_flag_before_any_weights_are_read(lm_workdir, tmp_path, monkeypatch, argv,
                                                                changes, match):
    (tmp_path / "blank.txt").write_text("one\n\nthree\n")
    (tmp_path / "exists.jsonl").write_text("")
    run = _copy_run(lm_workdir, tmp_path, **changes) if changes else lm_workdir
    argv = [a.format(tmp=tmp_path, run=run) for a in argv]
    if changes is not None:
        argv = ["--workdir", run] + argv

    def no_weights(*args, **kwargs):
        raise AssertionError("weights were read before the request was refused")
    monkeypatch.setattr(lm_run, "load_lm_run", no_weights)
    with pytest.raises(ValueError, match=match) as info:
        sample_cli.main(argv)
    assert "\n" not in str(info.value)


@pytest.mark.slow(reason="trains a second run, a genome one (~16 s on 2 cores); the text run's tests run by default")
def test_a_dna_prompt_with_a_non_base_is_refused_naming_its_position(dna_workdir, monkeypatch):
    monkeypatch.setattr(lm_run, "load_lm_run", lambda *a, **k: pytest.fail("weights read"))
    match = "--prompt: a genome prompt holds bases only .* but has 'x' at position 4 \\(1 such"
    with pytest.raises(ValueError, match=match):
        sample_cli.main(["--workdir", dna_workdir, "--prompt", "ACGTx"])


def test_a_refusal_is_one_error_line_from_the_command(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("GOAT_DEBUG", None)
    proc = subprocess.run([sys.executable, "-m", "experiments.sample", "--workdir", str(tmp_path / "none"),
                           "--prompt", "x"], cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "no such directory" in errors[0], proc.stderr


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def _byte_request(**kwargs):
    tok = tokenizers.ByteTokenizer()
    fields = dict(workdir="w", step=1, task="lm", tokenizer=tok, prompts=(("--prompt", "p"),),
                  prompt_ids=(np.asarray([tok.bos_id] + tok.encode("p"), np.int32),), max_new_tokens=6,
                  temperature=1.0, top_k=None, seed=0, num_samples=1)
    return samples.Request(**{**fields, **kwargs})


def test_one_continuation_streams_whole_characters_and_stops_at_eos():
    """On a terminal the one continuation appears token by token; a character of several UTF-8
    bytes (several byte tokens) appears once whole, and nothing after an EOS."""
    request = _byte_request()
    tok = request.tokenizer
    new = tok.encode("aé") + [tok.eos_id] + tok.encode("zz")  # 'é' is two bytes
    out, err = _Terminal(), _Terminal()
    printer = sample_cli.Printer(request, live=True, out=out, err=err)
    printer.on_batch([(0, 0)], 2)
    shown = []
    for step, t in enumerate(new):
        printer.on_token(step, np.asarray([t]))
        shown.append(out.getvalue())
    assert shown[1] == shown[0] and shown[2].endswith("aé")  # the first byte of 'é' waits for the second
    text, eos_at = samples.decode_continuation(request, new)
    assert (text, eos_at) == ("aé", 3)
    printer.finish([samples.Row(0, 0, "--prompt", "p", 2, new, eos_at, text)])
    body = out.getvalue().splitlines()
    assert body[1] == "aé" and body[2].startswith("[EOS at token 4 of 6") and "zz" not in out.getvalue()
    assert err.getvalue() == ""


def test_several_continuations_show_a_counter_on_a_terminal_and_nothing_elsewhere():
    request = _byte_request(num_samples=2, max_new_tokens=2)
    out, err = _Terminal(), _Terminal()
    printer = sample_cli.Printer(request, live=True, out=out, err=err)
    for step in range(2):
        printer.on_token(step, np.asarray([70, 71]))
    assert err.getvalue() == "\r  token 1/2\r  token 2/2\n" and out.getvalue() == ""
    quiet_out, quiet_err = io.StringIO(), io.StringIO()
    quiet = sample_cli.Printer(request, live=False, out=quiet_out, err=quiet_err)
    quiet.on_token(0, np.asarray([70, 71]))
    assert quiet_out.getvalue() == quiet_err.getvalue() == ""
