"""Document-aware packing through the LM and the engine: TransformerLM on a packed row equals
each document alone (GOAT and the sinusoidal absolute embeddings, which read the per-document
positions); ``python -m experiments.train ... --config.data.packing=documents`` trains,
resumes exactly from a mid-run checkpoint (the grain packer's state included) and
``python -m experiments.evaluate --evals documents`` scores it."""

import json
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from goat_jax.data.packing import PAD_SEGMENT_ID
from goat_jax.models.lm import LMConfig, TransformerLM
from goat_jax.kernels.plan import AttentionPlan
from goat_jax.tasks import lm as lm_task
from tests import config_helpers
from tests.config_helpers import lm_smoke_config
from tests.marks import SLOW_CASE

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("encoding", ["goat", pytest.param("sinusoidal", marks=SLOW_CASE)])
def test_lm_on_packed_documents_equals_documents_alone(encoding, rng):
    """Logits of 3 packed documents (+ padding) against each document alone (float32; the
    layers' float64 references are in tests/test_segment_layers.py)."""
    lengths, pad = (6, 6, 6), 2
    t = sum(lengths) + pad
    cfg = LMConfig(vocab_size=32, embed_dim=16, num_layers=2, num_heads=2, mlp_dim=32, pos_rank=2,
                   abs_rank=2, training_seq_len=8, position_encoding=encoding)
    tokens = rng.integers(0, 32, size=(1, t)).astype(np.int32)
    ids = np.concatenate([np.full(n, i + 1) for i, n in enumerate(lengths)] + [np.full(pad, PAD_SEGMENT_ID)])
    ids = ids.astype(np.int32)[None]
    model = TransformerLM(cfg, plan=AttentionPlan(implementation="xla"))
    params = jax.jit(model.init)(jax.random.key(0), jnp.asarray(tokens))
    params = jax.tree.map(lambda a: jnp.asarray(rng.normal(0, 0.3, a.shape), jnp.float32), params)
    apply = jax.jit(lambda p, x, s: model.apply(p, x, segment_ids=s))
    packed = np.asarray(apply(params, jnp.asarray(tokens), jnp.asarray(ids)))
    n = lengths[0]
    alone = np.asarray(jax.jit(model.apply)(params, jnp.asarray(tokens[0, :3 * n].reshape(3, n))))
    scale = np.abs(alone).max()
    np.testing.assert_allclose(packed[0, :3 * n].reshape(3, n, -1) / scale, alone / scale, atol=1e-5)


def test_dummy_batch_has_the_document_fields():
    config = lm_smoke_config()
    assert "segment_ids" not in lm_task.dummy_batch(config, 2)
    config.data.packing = "documents"
    batch = lm_task.dummy_batch(config, 2)
    assert batch["segment_ids"].shape == batch["positions"].shape == (2, config.seq_len)
    np.testing.assert_array_equal(batch["positions"][1], np.arange(config.seq_len))


def _env():
    return dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=config_helpers.xla_flags(1),
                PYTHONPATH=ROOT)


def _train(workdir):
    cmd = [sys.executable, "-m", "experiments.train", "--config", "configs/lm_tiny.py:goat,smoke",
           "--config.data.packing=documents", "--config.num_train_steps=8",
           "--config.checkpoint_every_steps=4", "--config.progress_bar=False", "--workdir", str(workdir)]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return proc, {r["step"]: r["train_loss"] for r in rows if "train_loss" in r}


def test_documents_packing_trains_and_evaluates_in_process(tmp_path):
    """The default suite's sibling of the CLI test below: the trainer on packed documents (4
    steps), then the documents evaluation of the run it wrote. Resuming the packer exactly is
    tested at the pipeline level (tests/test_packing.py) and through the CLI (slow, below)."""
    from goat_jax.config.files import load_config
    from goat_jax.eval import documents as doc_eval
    from goat_jax.eval import lm_run
    from goat_jax.train import trainer

    config = load_config("configs/lm_tiny.py:goat,smoke", {
        "data.packing": "documents", "num_train_steps": 4, "checkpoint_every_steps": 4,
        "progress_bar": False})
    summary = trainer.train_and_evaluate(config, str(tmp_path))
    assert summary["step"] == 4 and np.isfinite(summary["train_loss"])
    run = lm_run.load_lm_run(str(tmp_path))
    result = doc_eval.eval_documents(run, (1,), max_windows=4)
    assert np.isfinite(result["ppl"][run.train_len]["ppl"]) and result["ppl"][run.train_len]["tokens"] > 0
    assert len(result["first_mass"]) == config.model.num_layers
    assert all(0 < m < 1 for m in result["first_mass"])


@pytest.mark.slow(reason="trains, resumes and evaluates through the CLI; the in-process sibling runs in the default suite")
def test_documents_packing_trains_resumes_exactly_and_evaluates(tmp_path):
    """8 steps; then the step-8 checkpoint is removed (a run killed after saving step 4) and the
    same command resumes at step 4: steps 5-8 repeat the losses bit for bit, so the packer's
    iterator state was restored (a re-packed or shifted stream would change them)."""
    workdir = tmp_path / "run"
    _, reference = _train(workdir)
    assert sorted(reference) == list(range(1, 9)) and all(np.isfinite(list(reference.values())))
    shutil.rmtree(workdir / "checkpoints" / "8")
    proc, resumed = _train(workdir)
    assert "resumed from step 4" in proc.stderr
    assert [resumed[s] for s in range(5, 9)] == [reference[s] for s in range(5, 9)]

    out = tmp_path / "eval"
    cmd = [sys.executable, "-m", "experiments.evaluate", "--workdir", str(workdir), "--evals",
           "documents", "--multipliers", "1", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.load(open(out / "results.json"))["goat"]["documents"]
    assert np.isfinite(result["ppl"]["64"]["ppl"]) and result["ppl"]["64"]["tokens"] > 0
    assert len(result["first_mass"]) == 1 and 0 < result["first_mass"][0] < 1
    assert "Packed held-out documents" in open(out / "results.md").read()


@pytest.mark.slow(reason="trains and evaluates YaRN on packed documents (~22 s of an idle core); packed evaluation runs in the default suite (test_documents_packing_trains_and_evaluates_in_process)")
def test_yarn_on_packed_documents_takes_a_fixed_factor_and_a_failure_keeps_what_finished(tmp_path, monkeypatch):
    """A RoPE run trained on packed documents, evaluated as YaRN: with --rope_scaling_factor the
    documents evaluation past 1x runs (each document scaled by the fixed factor); when an
    evaluation fails after another finished, the finished one is in OUT/results.json."""
    from experiments import evaluate
    from goat_jax.config.files import load_config
    from goat_jax.eval import documents as doc_eval
    from goat_jax.train import trainer

    workdir = str(tmp_path / "rope")
    config = load_config("configs/lm_tiny.py:rope,smoke", {
        "data.packing": "documents", "num_train_steps": 2, "checkpoint_every_steps": 2, "progress_bar": False})
    trainer.train_and_evaluate(config, workdir)
    out = tmp_path / "eval"
    flags = ["--workdir", workdir, "--position_encoding", "yarn", "--rope_scaling_factor", "2",
             "--multipliers", "1,2", "--num_examples", "2"]
    results = evaluate.main([*flags, "--evals", "documents", "--out", str(out)])
    label = "rope as yarn (factor 2)"
    ppl = results[label]["documents"]["ppl"]
    assert sorted(ppl) == [config.seq_len, 2 * config.seq_len] and all(np.isfinite(v["ppl"]) for v in ppl.values())

    def broken(*args, **kwargs):
        raise RuntimeError("documents evaluation failed")

    monkeypatch.setattr(doc_eval, "eval_documents", broken)
    kept = tmp_path / "kept"
    with pytest.raises(RuntimeError, match="documents evaluation failed"):
        evaluate.main([*flags, "--evals", "extrapolation,documents", "--out", str(kept)])
    saved = json.load(open(kept / "results.json"))
    assert list(saved) == [label] and list(saved[label]) == ["setup", "extrapolation"]
    assert saved[label]["setup"] == {"mesh_context": 1, "context_strategy": None}
    assert "Perplexity by evaluation length" in open(kept / "results.md").read()


def _documents_config(**overrides):
    from goat_jax.config.files import load_config
    return load_config("configs/lm_tiny.py:goat,smoke", {
        "data.packing": "documents", "seq_len": 256, "model.max_documents_per_row": 2, **overrides})


def _most_documents(batches):
    return max(int(1 + np.count_nonzero(r[1:] != r[:-1])) for b in batches for r in np.asarray(b["segment_ids"]))


@pytest.mark.parametrize("platform,context,overrides,bounded", [
    ("cpu", 1, {}, False), ("tpu", 1, {}, False),  # xla / splash: no packed cuDNN layout
    ("gpu", 1, {}, False),  # float32: flash
    ("gpu", 1, {"model.dtype": "bfloat16"}, True),
    ("gpu", 2, {"model.dtype": "bfloat16"}, False),  # context parallelism (all-gather): flash
    ("gpu", 2, {"model.dtype": "bfloat16", "context_strategy": "ring"}, False),  # flash ring blocks
    # Ulysses: each device runs cuDNN's packed layout on whole rows, which the packer must bound
    ("gpu", 2, {"model.dtype": "bfloat16", "context_strategy": "ulysses"}, True),
    ("gpu", 1, {"model.dtype": "bfloat16", "context_strategy": "ulysses"}, True),
    ("gpu", 1, {"model.dtype": "bfloat16", "model.implementation": "flash"}, False),
    ("gpu", 1, {"model.dtype": "bfloat16", "model.implementation": "cudnn"}, True),
    ("gpu", 1, {"model.dtype": "bfloat16", "data.packing": "concat"}, False),  # no segment ids
])
def test_the_document_bound_applies_only_where_cudnns_packed_layout_may_run(platform, context, overrides, bounded):
    config = _documents_config(**overrides)
    assert lm_task.document_bound(config, AttentionPlan.from_config(config), platform, context) == (2 if bounded else None)


def test_the_document_bound_stops_no_run_on_cpu_and_bounds_the_evaluation_packer_on_gpus(tmp_path):
    """model.max_documents_per_row=2 on CPU: the trainer's packer used to check cuDNN's bound on
    every platform and stop the run at the first window over it (issue 53, item 1); here the
    rows are unbounded. The documents evaluation packs its windows under the bound where cuDNN's
    layout may attend them (a bfloat16 run on a GPU) and freely elsewhere."""
    import types

    from goat_jax.eval import documents as doc_eval
    config = _documents_config()
    datasets = lm_task.make_datasets(config, 8, 0, 1, plan=AttentionPlan.from_config(config))
    train = [next(datasets.train) for _ in range(4)]
    assert _most_documents(train) > 2  # not bounded on this CPU, and no error
    half = _documents_config(**{"model.dtype": "bfloat16"})
    run = types.SimpleNamespace(config=half, is_synthetic=False, train_len=256, label="goat",
                                plan=AttentionPlan.from_config(half))
    assert _most_documents(doc_eval.document_batches(run, max_windows=8, platform="cpu")) > 2
    assert _most_documents(doc_eval.document_batches(run, max_windows=8, platform="gpu")) <= 2
