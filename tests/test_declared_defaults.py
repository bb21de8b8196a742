"""Each default is stated once, where the field is declared: code that reads a field of a config
that may leave it out (an old run's config.json) asks the declaration
(:meth:`goat_jax.config.fields.Section.value`, :func:`goat_jax.config.fields.value_of`) instead of
restating the default in ``.get(field, default)``; and whether a run is synthetic is decided by
one function (:func:`goat_jax.data.synthetic.is_synthetic`)."""

import ast
import dataclasses
import os

import ml_collections
import pytest

from goat_jax.config.fields import value_of
from goat_jax.data import synthetic, text
from goat_jax.eval import checks, lm_run, runs  # noqa: F401  # the readers this file checks
from goat_jax.models.lm import LMConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DECLARED = (set(text.DATA.default_values()) | set(synthetic.SYNTHETIC.default_values())
            | {f.name for f in dataclasses.fields(LMConfig)})


def _python_files(*folders):
    for folder in folders:
        for dirpath, _, names in os.walk(os.path.join(ROOT, folder)):
            for name in sorted(names):
                if name.endswith(".py"):
                    path = os.path.join(dirpath, name)
                    with open(path) as f:
                        yield os.path.relpath(path, ROOT), ast.parse(f.read())


def test_no_reader_restates_a_declared_default():
    """``x.get('<declared field>', <default>)`` in the evaluations and the tasks: seven such
    reads in eval/lm_run.py, eval/runs.py and eval/checks.py restated the data and model
    sections' defaults (8, 5, 6, False, 'goat' twice, 8)."""
    restated = []
    for rel, tree in _python_files("goat_jax/eval", "goat_jax/tasks", "experiments"):
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
                    and len(node.args) == 2 and isinstance(node.args[0], ast.Constant)
                    and node.args[0].value in DECLARED and isinstance(node.args[1], ast.Constant)):
                restated.append(f"{rel}:{node.lineno} .get({node.args[0].value!r}, {node.args[1].value!r})")
    assert not restated, f"read the declared default instead (Section.value / value_of): {restated}"


def test_the_declared_defaults_are_what_an_old_config_reads():
    old = ml_collections.ConfigDict({"model": {"num_layers": 2}, "data": {"source": "synthetic"}})
    assert value_of(LMConfig, old.model, "position_encoding") == LMConfig.position_encoding == "goat"
    assert value_of(LMConfig, old.model, "rope_scaling_factor") is None
    assert synthetic.SYNTHETIC.value(old.data, "key_len") == synthetic.default_synthetic_config().key_len
    assert text.DATA.value(old.data, "bos_windows") is text.default_data_config().bos_windows
    assert value_of(LMConfig, {"position_encoding": "rope"}, "position_encoding") == "rope"
    with pytest.raises(KeyError, match="declares no field 'no_such_field'"):
        value_of(LMConfig, old.model, "no_such_field")
    # The passkey check reads the declared key length of a config that leaves it out.
    config = ml_collections.ConfigDict({"task": "lm", "seq_len": 16, "data": {"source": "synthetic"}})
    key_len = synthetic.SYNTHETIC.default("key_len")
    shortest = 1 + len(synthetic.PASSKEY_NEEDLE) + len(synthetic.PASSKEY_QUERY) + 2 * key_len
    assert checks.passkey_lengths(config, [1, 100]) == ("synthetic", [1600], [16], shortest)


@pytest.mark.parametrize("config,expected", [
    ({"data": {"source": "synthetic", "kind": "passkey"}}, True),
    ({"data": {"source": "text_files"}}, False),
    ({"data": {}}, False), ({}, False), (None, False),
])
def test_one_function_says_whether_a_run_is_synthetic(config, expected):
    assert synthetic.is_synthetic(config) is expected
    if config is not None:
        assert synthetic.is_synthetic(ml_collections.ConfigDict(config)) is expected


def test_nothing_else_decides_whether_a_run_is_synthetic():
    """It was decided in five places (tasks/lm.py, eval/lm_run.py, eval/harness.py,
    eval/context.py, eval/checks.py), each comparing data.source with 'synthetic' itself."""
    others = []
    for rel, tree in _python_files("goat_jax", "experiments"):
        if rel == "goat_jax/data/synthetic.py":
            continue
        for node in ast.walk(tree):
            if (isinstance(node, ast.Compare) and any(isinstance(c, ast.Constant) and c.value == "synthetic"
                                                      for c in node.comparators)
                    and "source" in ast.unparse(node.left)):
                others.append(f"{rel}:{node.lineno} {ast.unparse(node)}")
    assert not others, f"ask goat_jax.data.synthetic.is_synthetic instead: {others}"
