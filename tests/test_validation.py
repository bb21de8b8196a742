"""Every config field's type and range is checked before any work, and every config argument
token is known: walks each numeric field of each shipped config (configs/*.py, every variant)
with out-of-range values in process; a few through the command line (see test_cli_errors.py)."""

import dataclasses
import glob
import importlib
import math
import os

import ml_collections
import pytest

from goat_jax.config.args import REQUIRED, parse_config_arg
from goat_jax.data import synthetic, text
from goat_jax.models import lm
from goat_jax.train import tasks
from goat_jax.train import trainer
from goat_jax.train import validation

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Each config file with each of its variants (the argument's size/task tokens; encodings change
# no field, test_configs.py covers them).
VARIANTS = {
    "lm_tiny": ["", "smoke", "rope,smoke"],
    "retrieval_tiny": ["passkey", "niah", "passkey,smoke", "niah,smoke", "passkey,paper", "niah,paper",
                       "passkey,official", "niah,smoke,official", "passkey,paper,official"],
    "toy_copy_mixture": ["", "smoke"],
    "lm_c4_125m": ["goat"],
    "lm_fineweb_1b": ["rope"],
}
# Fields where a huge negative number is meaningful (documented in the config's comment).
NEGATIVE_OK = {"data.depth",  # < 0: a uniformly random needle depth
               "data.num_eval_batches@text"}  # <= 0: the whole held-out split


def _config(name, arg):
    module = importlib.import_module(f"configs.{name}")
    config = module.get_config(arg) if arg is not None else module.get_config()
    return validation.add_engine_defaults(config)  # the engine fields the file leaves out, as a run has them


def _numeric_fields(config):
    """``[(dotted name, value)]`` of every int / float leaf (bools excluded)."""
    out = []
    for key, value in config.items():
        if isinstance(value, ml_collections.ConfigDict):
            out += [(f"{key}.{k}", v) for k, v in _numeric_fields(value)]
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out.append((key, value))
    return out


def _with(config, dotted, value):
    """A copy of ``config`` with ``dotted`` set to ``value`` (bypassing ConfigDict's type lock,
    as a hand-edited config file could)."""
    tree = config.to_dict()
    node = tree
    *parents, leaf = dotted.split(".")
    for p in parents:
        node = node[p]
    node[leaf] = value
    return ml_collections.ConfigDict(tree)


def _assert_refused(config, dotted, value):
    with pytest.raises(ValueError) as info:
        trainer.validate_config(config, num_devices=8)
    message = str(info.value)
    assert "\n" not in message, message
    assert message.startswith(f"{dotted}={value!r} "), (dotted, value, message)
    assert f"--config.{dotted}" in message, message  # the fix names the flag


def _specs(config):
    specs = dict(validation.ENGINE_FIELDS)
    for section, spec in tasks.get_task(config.task).fields.specs(config).items():
        specs[section] = {**specs.get(section, {}), **spec}
    return specs


def _spec_of(specs, dotted):
    section, _, name = dotted.rpartition(".")
    return specs.get(section, {}).get(name)


def _outside(spec):
    """Values just outside the spec's range (independent of the config's own value)."""
    step = 1 if spec.kind == "int" else 1e-3
    values = []
    if spec.min is not None:
        values.append(spec.min if not spec.min_inclusive else spec.min - step)
    if spec.max is not None and spec.max < 1e30:
        values.append(spec.max if not spec.max_inclusive else spec.max + step)
    values = [int(v) if spec.kind == "int" else float(v) for v in values]
    return [v for v in values if v not in spec.also]


# A config file added later (another family) is walked with its default argument.
_LISTED = sorted(os.path.basename(p)[:-3] for p in glob.glob(os.path.join(ROOT, "configs", "*.py"))
                 if not os.path.basename(p).startswith("_"))
CASES = [(name, arg) for name in _LISTED for arg in VARIANTS.get(name, [None])]


@pytest.mark.parametrize("name,arg", CASES, ids=[f"{n}:{a}" for n, a in CASES])
def test_every_numeric_field_refuses_out_of_range_values(name, arg):
    config = _config(name, arg)
    trainer.validate_config(config, num_devices=8)  # the shipped values pass
    specs = _specs(config)
    source = "text" if config.data.get("source") != "synthetic" else "synthetic"
    fields = _numeric_fields(config)
    assert len(fields) > 25
    for dotted, value in fields:
        spec = _spec_of(specs, dotted)
        assert spec is not None and spec.kind in ("int", "float"), f"{name}:{arg} {dotted} has no numeric spec"
        bad = list(_outside(spec))
        # Values wrong for any numeric field, chosen without looking at the spec.
        if dotted not in NEGATIVE_OK and f"{dotted}@{source}" not in NEGATIVE_OK:
            bad.append(-10**9 if isinstance(value, int) else -1e9)
        if isinstance(value, float):
            bad += [math.nan, math.inf, -math.inf, 1e39]  # 1e39 is inf in float32
        else:
            bad += [1.5, True]  # a float or a bool where an int is meant
        bad.append("1")  # a string where a number is meant
        for b in bad:
            _assert_refused(_with(config, dotted, b), dotted, b)


def test_every_model_and_data_field_has_a_spec():
    assert {f.name for f in dataclasses.fields(lm.LMConfig)} == set(lm.FIELD_SPECS)
    assert set(text.default_data_config()) == set(text.FIELD_SPECS)
    assert set(synthetic.default_synthetic_config()) | {"source"} == set(synthetic.FIELD_SPECS)


def test_issue_examples_are_refused_with_the_allowed_range():
    """The optimizer values that used to train silently (gradient ascent, inf, ...)."""
    config = _config("lm_tiny", "smoke")
    for dotted, value, allowed in [
            ("optimizer.learning_rate", -1.0, "> 0"), ("optimizer.learning_rate", math.inf, "> 0"),
            ("optimizer.warmup_steps", -1, ">= 0"), ("optimizer.b2", 1.5, ">= 0 and < 1"),
            ("optimizer.b1", 1.0, "< 1"), ("optimizer.b2", 1.0, "< 1"), ("optimizer.eps", 0.0, "> 0"),
            ("optimizer.min_lr_ratio", 2.0, "<= 1"), ("optimizer.grad_clip", -1.0, ">= 0"),
            ("mesh.data", 0, ">= 1 or -1"), ("model.dtype", "float8", "one of"),
            ("model.position_encoding", "rope2", "one of"), ("data.paths", ("",), "non-empty"),
            ("data.paths", "a.txt", "tuple of"), ("model.implementation", "flashy", "one of")]:
        with pytest.raises(ValueError, match=allowed) as info:
            trainer.validate_config(_with(config, dotted, value), num_devices=1)
        assert str(info.value).startswith(f"{dotted}={value!r} ")


def test_spec_boundaries_are_allowed():
    """The bounds themselves pass when inclusive: the checks do not refuse valid values."""
    config = _config("lm_tiny", "smoke")
    for dotted, value in [("optimizer.warmup_steps", 0), ("optimizer.b1", 0.0), ("optimizer.min_lr_ratio", 1.0),
                          ("optimizer.grad_clip", 0.0), ("optimizer.weight_decay", 0.0),
                          ("eval_every_steps", 0), ("mesh.data", -1), ("model.kv_num_heads", None),
                          ("optimizer.learning_rate", 5), ("data.eval_paths", ())]:
        trainer.validate_config(_with(config, dotted, value), num_devices=1)


# ----------------------------------------------------------------------------------------------
# Config arguments: one parser, unknown and conflicting tokens refused in every config
# ----------------------------------------------------------------------------------------------

BAD_ARGS = {
    "lm_tiny": ["goat,smok", "goat,smoke,rope", "smoke,smoke"],
    "retrieval_tiny": ["passkey,smok", "passkey,niah", "niah,goat,rope", "passkey,smoke,paper", "rope"],
    "toy_copy_mixture": ["smok", "smoke,smoke", "goat"],
    "lm_c4_125m": ["rop", "goat,rope"],
    "lm_fineweb_1b": ["rope,smoke", "alibi,nope"],
    "dna_tiny": ["goat,rope,smoke", "smok", "goat,long,long"],
    "dna_hg38": ["goat,rope", "fast", "fasta,fasta"],
    "dna_long": ["goat,rope", "smoke"],
    "dna_1m": ["goat,rope", "fasta"],
    "vit_tiny": ["rope2d,ape,smoke", "smok", "canvas,canvas"],
    "vit_s16_imagenet": ["goat,smoke", "ape,nope", "rope"],
}


def test_every_config_file_is_checked_for_bad_tokens():
    """The sweep below covers every config in configs/: one that parsed its argument by hand
    (dna_tiny, dna_hg38 and vit_tiny did) accepted conflicting tokens and misreported unknown ones."""
    folder = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
    assert set(BAD_ARGS) == {n[:-3] for n in os.listdir(folder) if n.endswith(".py") and n != "__init__.py"}


@pytest.mark.parametrize("name", sorted(BAD_ARGS))
def test_unknown_or_conflicting_config_tokens_are_refused(name):
    for arg in BAD_ARGS[name]:
        with pytest.raises(ValueError, match=r"accepted tokens.*: ") as info:
            _config(name, arg)
        message = str(info.value)
        assert "\n" not in message and f"configs/{name}.py" in message
        assert "unknown" in message or "conflict" in message or "twice" in message or "needs" in message


def test_parser_returns_tokens_in_any_order_and_defaults():
    groups = dict(encoding=(("goat", "rope"), "goat"), size=(("smoke",), None), task=(("a", "b"), REQUIRED))
    assert parse_config_arg("smoke,b,rope", "f.py", **groups) == {"encoding": "rope", "size": "smoke", "task": "b"}
    assert parse_config_arg("a", "f.py", **groups) == {"encoding": "goat", "size": None, "task": "a"}
    with pytest.raises(ValueError, match=r"needs a task token"):
        parse_config_arg("rope", "f.py", **groups)
    assert _config("lm_tiny", "smoke,rope").model.position_encoding == "rope"
