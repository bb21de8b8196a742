"""The engine's family-independence: a non-LM task trained through the public contract, the
per-step PRNG key (dropout differs across steps, repeats exactly after resume), eval aux sums
against a float64 numpy reference, and no language/image/DNA name inside goat_jax/train/.

The classifier task below is defined here, outside goat_jax, and loaded by the unchanged engine
from ``config.task = 'tests.test_engine:CLASSIFIER'``.
"""

import dataclasses
import io
import json
import os
import re
import shutil
import tokenize

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from goat_jax.config.fields import Float, Int
from goat_jax.train import run as run_lib
from goat_jax.train import sharding, tasks, trainer
from tests.config_helpers import set_fields
from goat_jax.kernels.plan import AttentionPlan

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# ----------------------------------------------------------------------------------------------
# A classifier on random data: x ~ N(0, I_D), label = argmax(x @ W_teacher)
# ----------------------------------------------------------------------------------------------


class MLPClassifier(nn.Module):
    """``x [B, D] -> logits [B, C]``: Dense -> GELU -> dropout -> Dense, logically named."""

    hidden: int
    num_classes: int
    dropout_rate: float

    @nn.compact
    def __call__(self, x, train: bool = False):
        h = nn.Dense(self.hidden, kernel_init=nn.with_logical_partitioning(
            nn.initializers.lecun_normal(), ("embed", "mlp")))(x)
        h = nn.with_logical_constraint(nn.gelu(h), ("batch", "mlp"))
        h = nn.Dropout(self.dropout_rate, deterministic=not train)(h)
        return nn.Dense(self.num_classes, kernel_init=nn.with_logical_partitioning(
            nn.initializers.lecun_normal(), ("mlp", "vocab")))(h)


def _teacher(config):
    return np.random.default_rng([config.seed, 99]).normal(size=(config.data.dim, config.model.num_classes))


def _examples(config, rng, n):
    x = rng.normal(size=(n, config.data.dim)).astype(np.float32)
    return x, np.argmax(x @ _teacher(config), axis=-1).astype(np.int32)


class _TrainIterator:
    """Batch ``i`` of this process is a function of (seed, process, i): resumable by ``i``."""

    def __init__(self, config, batch, process_index):
        self.config, self.batch, self.process, self.i = config, batch, process_index, 0

    def __next__(self):
        rng = np.random.default_rng([self.config.seed, self.process, self.i])
        self.i += 1
        x, y = _examples(self.config, rng, self.batch)
        return {"x": x, "label": y, "weight": np.ones(self.batch, np.float32)}

    def get_state(self):
        return {"i": self.i}

    def set_state(self, state):
        self.i = state["i"]


def eval_set(config):
    """The eval examples (the same on every call; ``num_eval_examples`` of them)."""
    return _examples(config, np.random.default_rng([config.seed, 12345]), config.data.num_eval_examples)


def _make_datasets(config, global_batch_size, process_index, process_count, *, plan):
    del plan  # no attention
    local = global_batch_size // process_count
    x, y = eval_set(config)

    def make_eval():
        # Padded to whole batches with weight-0 rows, as a real eval pipeline would.
        for start in range(0, len(x), global_batch_size):
            bx = np.zeros((global_batch_size, x.shape[1]), np.float32)
            by = np.zeros(global_batch_size, np.int32)
            bw = np.zeros(global_batch_size, np.float32)
            n = min(global_batch_size, len(x) - start)
            bx[:n], by[:n], bw[:n] = x[start:start + n], y[start:start + n], 1.0
            rows = slice(process_index * local, (process_index + 1) * local)
            yield {"x": bx[rows], "label": by[rows], "weight": bw[rows]}

    return tasks.Datasets(train=_TrainIterator(config, local, process_index), make_eval=make_eval, info={})


def _loss(apply_fn, params, batch, rng):
    train = rng is not None
    logits = apply_fn({"params": params}, batch["x"], train=train, rngs={"dropout": rng} if train else {})
    loss_sum, weight_sum = tasks.weighted_cross_entropy(logits, batch["label"], batch["weight"])
    correct = tasks.weighted_correct(logits, batch["label"], batch["weight"])
    return loss_sum, (weight_sum, {"correct": correct})


CLASSIFIER = tasks.Task(
    name="classifier",
    batch_keys=("x", "label", "weight"),
    build_model=lambda c, plan: MLPClassifier(c.model.hidden, c.model.num_classes, c.model.dropout_rate),
    make_datasets=_make_datasets,
    loss=_loss,
    dummy_batch=lambda c, b: {"x": np.zeros((b, c.data.dim), np.float32),
                              "label": np.zeros(b, np.int32), "weight": np.ones(b, np.float32)},
    model_inputs=lambda batch: (batch["x"],),
    tokens_per_example=lambda c: 1,
    flops_per_token=lambda c: None,
    # The task's fields, declared once: its schema and the types checked before any work.
    fields=tasks.TaskFields(
        model={"hidden": Int(min=1), "num_classes": Int(min=2), "dropout_rate": Float(min=0.0, max=1.0)},
        data={"": {"dim": Int(min=1), "num_eval_examples": Int(min=1)}}),
    eval_metrics=lambda t: {"accuracy": t["correct"] / t["weight"], "examples": t["weight"]},
    no_decay_names=frozenset({"bias"}),
)


def classifier_config(**overrides):
    """Engine fields as in configs/lm_tiny.py, plus the classifier's model and data."""
    c = ml_collections.ConfigDict()
    c.task = "tests.test_engine:CLASSIFIER"
    c.seed = 0
    c.num_train_steps = 30
    c.global_batch_size = 32
    c.per_device_batch_size = None
    c.grad_accum_steps = 2
    c.log_every_steps = 1
    c.eval_every_steps = 30
    c.checkpoint_every_steps = 10
    c.keep_checkpoints = 3
    c.progress_bar = False
    c.peak_flops_per_device = 0.0
    c.distributed = False
    c.mesh = ml_collections.ConfigDict({"data": -1, "fsdp": 1, "tensor": 1})
    c.sharding_rules = sharding.DEFAULT_RULES
    c.optimizer = ml_collections.ConfigDict(dict(
        learning_rate=1e-2, warmup_steps=3, min_lr_ratio=0.1, b1=0.9, b2=0.99, eps=1e-8,
        weight_decay=0.01, grad_clip=1.0))
    c.model = ml_collections.ConfigDict({"hidden": 64, "num_classes": 4, "dropout_rate": 0.3})
    c.data = ml_collections.ConfigDict({"dim": 8, "num_eval_examples": 100})  # 100: last batch padded
    return set_fields(c, **overrides)


def _rows(workdir):
    with open(run_lib.metrics_path(workdir)) as f:
        return [json.loads(line) for line in f]


# ----------------------------------------------------------------------------------------------
# Tests
# ----------------------------------------------------------------------------------------------


def test_classifier_trains_and_eval_aux_sums_match_numpy(tmp_path):
    """The unchanged engine trains a task defined in this file; its eval accuracy and loss (aux
    sums over 4 batches, the last one padded, 2 microbatches each) equal a float64 numpy
    recomputation from the saved params."""
    config = classifier_config()
    summary = trainer.train_and_evaluate(config, str(tmp_path))
    assert summary["step"] == 30
    ev = [r for r in _rows(tmp_path) if "eval_loss" in r]
    assert len(ev) == 1 and set(ev[0]) == {"step", "eval_loss", "eval_accuracy", "eval_examples", "elapsed_s"}
    ev = ev[0]
    assert ev["eval_examples"] == 100  # padding rows carry no weight

    run = run_lib.load_run(str(tmp_path))
    assert run.step == 30 and run.task is CLASSIFIER
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), run.params)
    x, y = eval_set(config)
    h = x.astype(np.float64) @ p["Dense_0"]["kernel"] + p["Dense_0"]["bias"]
    h = 0.5 * h * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (h + 0.044715 * h ** 3)))  # flax gelu (tanh)
    logits = h @ p["Dense_1"]["kernel"] + p["Dense_1"]["bias"]
    logz = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    nll = np.mean(logz - logits[np.arange(len(y)), y])
    accuracy = np.mean(np.argmax(logits, -1) == y)
    assert ev["eval_accuracy"] == pytest.approx(accuracy, abs=1e-9)
    assert ev["eval_loss"] == pytest.approx(nll, rel=1e-5)
    assert accuracy > 0.5  # learned: chance is 0.25
    tb = os.listdir(tmp_path / run_lib.TENSORBOARD_DIR)
    assert any(f.startswith("events.out.tfevents") for f in tb)


@pytest.mark.slow(reason="an uninterrupted and a resumed training run")
def test_step_key_dropout_differs_across_steps_and_resume_is_exact(tmp_path):
    """Dropout masks come from fold_in(key(seed), step): the same state and batch give
    different losses at different step counts and equal ones at the same count; a run resumed
    from its step-10 checkpoint repeats the uninterrupted run's losses exactly."""
    config = classifier_config(eval_every_steps=0)
    task = tasks.get_task(config.task)
    mesh = sharding.make_mesh(config.mesh)
    batch_sh = {k: sharding.batch_sharding(mesh, np.ndim(v)) for k, v in task.dummy_batch(config, 1).items()}
    steps = trainer.make_sharded_steps(task, config, mesh, sharding.rules_from_config(config.sharding_rules), batch_sh, plan=AttentionPlan())
    batch = next(task.make_datasets(config, 32, 0, 1, plan=None).train)

    def loss_at(step, cfg_steps=steps):
        state = cfg_steps.init(jax.random.PRNGKey(0))
        return float(cfg_steps.train_step(state.replace(step=jnp.asarray(step, jnp.int32)), batch)[1]["train_loss"])

    assert loss_at(3) != loss_at(4)
    assert loss_at(3) == loss_at(3)
    no_dropout = trainer.make_sharded_steps(task, classifier_config(**{"model.dropout_rate": 0.0}), mesh,
                                            sharding.rules_from_config(config.sharding_rules), batch_sh, plan=AttentionPlan())
    assert loss_at(3, no_dropout) == loss_at(4, no_dropout)  # only dropout used the key

    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    trainer.train_and_evaluate(config, str(whole))
    trainer.train_and_evaluate(config, str(resumed))
    shutil.rmtree(resumed / "checkpoints" / "30")
    shutil.rmtree(resumed / "checkpoints" / "20")
    assert trainer.train_and_evaluate(config, str(resumed))["step"] == 30  # from step 10
    losses = [[r["train_loss"] for r in _rows(w) if "train_loss" in r] for w in (whole, resumed)]
    assert len(losses[0]) == 30 and losses[0] == losses[1]


def test_task_lookup_by_name_and_errors():
    assert tasks.get_task("lm") is tasks.get_task("goat_jax.tasks.lm:TASK")
    assert tasks.get_task("tests.test_engine:CLASSIFIER") is CLASSIFIER
    assert "lm" in tasks.builtin_tasks()
    with pytest.raises(ValueError, match=r"config\.task='vit9': no module 'goat_jax\.tasks\.vit9'"):
        tasks.get_task("vit9")
    with pytest.raises(ValueError, match="not a goat_jax.train.tasks.Task"):
        tasks.get_task("tests.test_engine:classifier_config")
    with pytest.raises(ValueError, match="must name a task"):
        tasks.get_task(None)


def test_aux_named_loss_is_refused():
    bad = dataclasses.replace(CLASSIFIER, loss=lambda *a: (_loss(*a)[0], (_loss(*a)[1][0], {"loss": 0.0})))
    step = trainer.make_eval_step(bad, CLASSIFIER.build_model(classifier_config(), None), 1)
    config = classifier_config()
    params = nn.unbox(CLASSIFIER.build_model(config, AttentionPlan.from_config(config)).init(jax.random.PRNGKey(0), np.zeros((2, 8), np.float32)))["params"]
    with pytest.raises(ValueError, match="may not be named 'loss' or 'weight'"):
        step(params, CLASSIFIER.dummy_batch(config, 2))


# Language, image and DNA names that must not appear in the engine's code (config fields,
# parameter names, metrics, imports); docstrings and comments may mention them as examples.
FAMILY_NAMES = {
    "seq_len", "vocab_size", "position_encoding", "tokenizer", "read_threads", "num_eval_batches",
    "remat", "implementation", "lambda_sym", "lambda_asym", "sink_gain", "sink_bump", "key_bias",
    "prior", "ppl", "perplexity", "image_size", "patch_size", "num_classes", "mixup", "cutmix",
    "dna", "nucleotide", "bases", "TransformerLM", "models", "lm", "vit",
}


def _code_words(path):
    """Identifiers and the words of string literals of a Python file, docstrings excluded (a
    string statement: its previous significant token ends a line or opens a block)."""
    words, prev = set(), None
    strings = {tokenize.STRING} | {getattr(tokenize, "FSTRING_MIDDLE", tokenize.STRING)}
    with open(path) as f:
        for tok in tokenize.generate_tokens(io.StringIO(f.read()).readline):
            if tok.type == tokenize.NAME:
                words.add(tok.string)
            elif tok.type in strings and prev not in (tokenize.INDENT, tokenize.NEWLINE, None):
                words.update(re.split(r"\W+", tok.string))
            if tok.type not in (tokenize.COMMENT, tokenize.NL):
                prev = tok.type
    return words


def test_no_family_names_in_the_engine():
    engine = os.path.join(ROOT, "goat_jax", "train")
    found = {}
    for name in sorted(os.listdir(engine)):
        if name.endswith(".py"):
            hits = _code_words(os.path.join(engine, name)) & FAMILY_NAMES
            if hits:
                found[name] = sorted(hits)
    assert not found, f"family-specific names in goat_jax/train/: {found}"
    # The check itself sees such names where they are.
    assert {"seq_len", "lm", "models"} <= _code_words(os.path.join(ROOT, "goat_jax", "tasks", "lm.py"))
