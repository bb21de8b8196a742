"""experiments.export: a run trained by the project's trainer leaves JAX (the Hugging Face
folder that ``transformers`` loads, equal logits and greedy tokens), comes back bit-equal, and
every refusal is one line that writes nothing. The encodings x blocks matrix, DNA and lm-eval:
tests/test_export_matrix.py. Everything here is float32 unless a test says otherwise."""

import json
import os

import numpy as np
import pytest

from experiments import export as export_cli
from tests import export_helpers as H
from tests.config_helpers import lm_smoke_config

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """``(run, folder)``: the GOAT smoke config (llama block, GQA 4/2) trained 10 steps by the
    trainer, and its export through the CLI."""
    from goat_jax.eval import lm_run
    from goat_jax.train import trainer
    base = tmp_path_factory.mktemp("export")
    workdir, folder = str(base / "run"), str(base / "run_hf")
    trainer.train_and_evaluate(lm_smoke_config(num_train_steps=10, checkpoint_every_steps=10,
                                               **{"optimizer.warmup_steps": 1}), workdir)
    export_cli.main(["--workdir", workdir, "--out", folder])
    return lm_run.load_lm_run(workdir), folder


def test_a_trained_run_loads_in_transformers_with_equal_logits_and_greedy_tokens(trained, rng):
    run, folder = trained
    errors = H.check_export_matches(run, folder, rng, vocab=259)
    print("relative logit errors", errors)


def test_the_folder_holds_what_transformers_reads(trained):
    from goat_jax.export import safetensors_io
    _, folder = trained
    names = set(os.listdir(folder))
    assert {"model.safetensors", "config.json", "configuration_goat.py", "modeling_goat.py", "tokenizer.json",
            "tokenizer_config.json", "generation_config.json", "README.md"} <= names
    with open(os.path.join(folder, "model.safetensors"), "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        assert json.loads(f.read(size))["__metadata__"] == {"format": "pt"}
    hf = json.load(open(os.path.join(folder, "config.json")))
    assert hf["auto_map"]["AutoModelForCausalLM"] == "modeling_goat.GoatForCausalLM"
    assert hf["architectures"] == ["GoatForCausalLM"] and hf["content_dim"] == 16 - 2 * 2 - 1
    modeling = open(os.path.join(folder, "modeling_goat.py")).read()
    assert "goat_jax" not in modeling.replace("goat-jax", "") and "import goat" not in modeling
    assert "| pos_rank | 2 |" in open(os.path.join(folder, "README.md")).read()
    # Sharded past --max_shard_size: an index, the same tensors.
    tensors = safetensors_io.read_weights(folder)
    shards = os.path.join(os.path.dirname(folder), "sharded")
    os.makedirs(shards)
    safetensors_io.write_weights(shards, tensors, 40_000)
    assert "model.safetensors.index.json" in os.listdir(shards)
    again = safetensors_io.read_weights(shards)
    assert sorted(again) == sorted(tensors) and all(np.array_equal(again[k], tensors[k]) for k in tensors)


def test_auto_tokenizer_gives_the_runs_token_ids(trained):
    from transformers import AutoTokenizer
    from goat_jax.data.tokenizers import ByteTokenizer
    _, folder = trained
    tok = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
    for text in ("Hello, world!", "  spaces\tand\nnewlines ", "héllo ✓ 日本", "<s> literal"):
        assert tok(text, add_special_tokens=False).input_ids == ByteTokenizer().encode(text), text
        assert tok(text).input_ids == [1] + ByteTokenizer().encode(text), text  # BOS first, as training
        assert tok.decode(tok(text).input_ids, skip_special_tokens=True) == text
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 0)


def test_import_back_is_bit_equal_in_float32(trained, tmp_path):
    import jax
    from goat_jax.eval import lm_run
    run, folder = trained
    new = str(tmp_path / "again")
    export_cli.main(["--from_hf", folder, "--workdir", new])
    back = lm_run.load_lm_run(new)
    assert back.step == run.step
    assert jax.tree.structure(back.params) == jax.tree.structure(run.params)
    for a, b in zip(jax.tree.leaves(back.params), jax.tree.leaves(run.params)):
        assert a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError, match="--workdir .* not an empty directory"):
        export_cli.main(["--from_hf", folder, "--workdir", new])


def test_bfloat16_weights_load_and_stay_within_bf16_tolerance(trained, tmp_path, rng):
    import torch
    run, _ = trained
    folder = str(tmp_path / "bf16")
    export_cli.main(["--workdir", run.workdir, "--out", folder, "--dtype", "bfloat16"])
    tokens = rng.integers(3, 259, (2, 40))
    want = H.goat_logits(run, tokens)
    for dtype in (None, torch.bfloat16):  # bf16 weights computed in float32, and in bfloat16
        model = H.load_hf(folder, dtype)
        assert model.model.layers[0].self_attn.prior.lambda_sym.dtype == torch.float32  # the prior stays f32
        assert H.rel_err(H.hf_logits(model, tokens), want) < 3e-2


def test_an_existing_out_is_refused_unless_overwrite(trained, tmp_path):
    run, _ = trained
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(ValueError, match="exists and is not empty.*--overwrite"):
        export_cli.main(["--workdir", run.workdir, "--out", str(out)])
    assert os.listdir(out) == ["keep.txt"]
    export_cli.main(["--workdir", run.workdir, "--out", str(out), "--overwrite"])
    assert "keep.txt" not in os.listdir(out) and "model.safetensors" in os.listdir(out)


def _config_only(tmp_path, name, config):
    """A workdir holding only config.json: every refusal below happens before the checkpoint is read."""
    workdir = tmp_path / name
    workdir.mkdir()
    (workdir / "config.json").write_text(json.dumps(config.to_dict(), default=str))
    return str(workdir)


@pytest.mark.parametrize("setup, message", [
    ({"model.position_encoding": "fire"}, "model.position_encoding='fire' has no closed form .* the export takes: goat, rope"),
    ({"model.position_encoding": "ntk"}, "dynamic factor .* fixed model.rope_scaling_factor"),
    ({"model.position_encoding": "rope_pi"}, "'rope_pi' has no closed form"),
    ({"model.training_seq_len": None}, "model.training_seq_len=None"),
    ({"data.tokenizer": "sentencepiece"}, "data.tokenizer='sentencepiece'.*--tokenizer none"),
    ({"argv": ["--dtype", "float16"]}, "--dtype 'float16'"),
    ({"argv": ["--max_shard_size", "big"]}, "--max_shard_size 'big'"),
    ({"argv": ["--tokenizer", "spm"]}, "--tokenizer 'spm'"),
])
def test_refusals_are_one_line_and_write_nothing(tmp_path, capsys, setup, message):
    setup = dict(setup)
    argv = setup.pop("argv", [])
    workdir = _config_only(tmp_path, "run", lm_smoke_config(**setup))
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=message) as e:
        export_cli.main(["--workdir", workdir, "--out", str(out)] + argv)
    assert "\n" not in str(e.value)
    assert sorted(os.listdir(tmp_path)) == ["run"] and os.listdir(workdir) == ["config.json"]
    # Through the CLI wrapper: one line on stderr, status 1.
    import sys
    from goat_jax import cli
    sys.argv = ["export", "--workdir", workdir, "--out", str(out)] + argv
    with pytest.raises(SystemExit):
        cli.run(export_cli.main)
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err


def test_import_refuses_a_folder_not_written_by_the_export(tmp_path):
    folder = tmp_path / "other"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match="not a goat-jax export"):
        export_cli.main(["--from_hf", str(folder), "--workdir", str(tmp_path / "new")])
    with pytest.raises(ValueError, match="--dtype belong"):
        export_cli.main(["--from_hf", str(folder), "--workdir", str(tmp_path / "new"), "--dtype", "bfloat16"])
    assert not (tmp_path / "new").exists()


def test_lm_eval_hf_model_on_the_folder_matches_our_adapter(trained):
    """lm-evaluation-harness's ``hf`` model (``pretrained=DIR,trust_remote_code=True``, BOS first as
    the run trained) gives our adapter's log-likelihoods (goat_jax/eval/harness.py) within 1e-4."""
    pytest.importorskip("lm_eval")
    pytest.importorskip("accelerate", reason="lm-eval's hf model needs accelerate (the test extra installs it)")
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM
    from goat_jax.eval import harness
    run, folder = trained
    requests = [Instance("loglikelihood", {}, (context, continuation), i) for i, (context, continuation) in enumerate([
        ("The cat sat on the", " mat"), ("Hacker slang, as the Jargon File records it,", " begins"),
        ("A context much longer than the window of the tiny model, " * 2, "so"), ("", "Hello")])]
    ours = harness.GoatLM(run, batch_size=4).loglikelihood(requests)
    hf = HFLM(pretrained=folder, trust_remote_code=True, add_bos_token=True, max_length=int(run.config.seq_len),
              batch_size=2, device="cpu", dtype="float32")
    theirs = hf.loglikelihood(requests)
    for (a, greedy_a), (b, greedy_b) in zip(ours, theirs):
        assert abs(a - b) <= 1e-4 * max(1.0, abs(a)), (a, b)
        assert greedy_a == greedy_b
