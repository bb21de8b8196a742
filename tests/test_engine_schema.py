"""The engine's config fields are declared once (goat_jax/train/validation.py, ``ENGINE``): a
config file states only what its experiment decides; every other engine field takes its
declared default, can still be set from the command line, and is written out in the resolved
config.json; the few without a default are named when missing."""

import json

import ml_collections
import pytest

from goat_jax.config.fields import Int, Section
from goat_jax.config.files import apply_overrides, load_config
from goat_jax.train import run as run_lib
from goat_jax.train import tasks, trainer, validation, wandb_logger


def _minimal_lm_config():
    """A language-model config with the engine fields that have no default and nothing else."""
    full = load_config("configs/lm_tiny.py:goat,smoke")
    c = ml_collections.ConfigDict()
    c.task = "lm"
    c.num_train_steps = 2
    c.global_batch_size = 4
    c.seq_len = 16
    c.optimizer = ml_collections.ConfigDict({"learning_rate": 1e-3})
    c.model = full.model
    c.data = full.data
    c.model.training_seq_len = 16
    return c


def test_a_config_with_only_the_required_fields_trains_and_writes_every_default(tmp_path):
    config = _minimal_lm_config()
    config.progress_bar = False  # any default may still be stated
    summary = trainer.train_and_evaluate(config, str(tmp_path))
    assert summary["step"] == 2
    written = run_lib.read_config(str(tmp_path)).to_dict()
    for dotted, default in validation.engine_defaults().items():
        section, _, name = dotted.rpartition(".")
        value = (written[section] if section else written)[name]
        expected = {"progress_bar": False, "global_batch_size": 4}.get(dotted, default)  # stated ones
        assert json.dumps(value, default=str) == json.dumps(expected, default=str), dotted
    assert "engine" not in written and written["mesh"] == {"data": -1, "fsdp": 1, "context": 1, "tensor": 1}


def test_required_engine_fields_are_named_when_missing_and_typos_refused():
    assert set(validation.ENGINE_REQUIRED) == {"task", "num_train_steps", "optimizer.learning_rate"}
    config = _minimal_lm_config()
    del config.optimizer["learning_rate"]
    with pytest.raises(ValueError, match=r"missing field\(s\) \['optimizer.learning_rate'\], which have no default"):
        trainer.validate_config(config, 1)
    config = _minimal_lm_config()
    del config["num_train_steps"]
    with pytest.raises(ValueError, match=r"missing field\(s\) \['num_train_steps'\]"):
        trainer.validate_config(config, 1)
    config = _minimal_lm_config()
    config.optimizer.warmup_step = 10
    with pytest.raises(ValueError, match=r"Unknown config field optimizer.warmup_step. Did you mean optimizer.warmup_steps\?"):
        trainer.validate_config(config, 1)
    config = _minimal_lm_config()
    config.mesh = ml_collections.ConfigDict({"data": 0})  # a stated default is still checked
    with pytest.raises(ValueError, match=r"mesh.data=0 is out of range"):
        trainer.validate_config(config, 1)


def test_an_engine_field_the_file_leaves_out_is_settable_from_the_command_line():
    config = load_config("configs/lm_tiny.py:goat,smoke")  # the file states no b1, mesh or wandb
    assert config.optimizer.eps == validation.ENGINE["optimizer"].default_values()["eps"]
    config = apply_overrides(config, {"optimizer.eps": 1e-6, "mesh.fsdp": 2, "wandb.mode": "offline",
                                      "per_device_batch_size": None}, "configs/lm_tiny.py:goat,smoke")
    assert (config.optimizer.eps, config.mesh.fsdp, config.wandb.mode) == (1e-6, 2, "offline")


def test_the_defaults_are_the_checkpoints_no_change():
    """A checkpoint of a config that wrote an engine field at its default resumes under one that
    leaves it out: the engine's defaults are among the task's field defaults."""
    defaults = tasks.field_defaults(tasks.get_task("lm"))
    assert defaults["optimizer.decay_grouping"] == "default" and defaults["grad_accum_steps"] == 1
    assert defaults["model.position_encoding"] == "goat"


def test_a_section_declares_required_fields_without_a_default():
    from goat_jax.config.fields import REQUIRED
    s = Section(a=(REQUIRED, Int(min=1)), b=(2, Int(min=1)))
    assert s.required == ("a",) and s.default_values() == {"b": 2} and dict(s.defaults()) == {"b": 2}
    with pytest.raises(ValueError, match="Section field 'c': the default 0"):
        Section(c=(0, Int(min=1)))


def test_a_sections_default_is_read_from_its_declaration():
    from goat_jax.config.fields import REQUIRED
    s = Section(a=(REQUIRED, Int(min=1)), b=(2, Int(min=1)), c=(None, Int(min=1, optional=True)))
    assert s.default("b") == 2 and s.default("c") is None
    assert s.value({"b": 5}, "b") == 5 and s.value({}, "b") == 2 and s.value(None, "b") == 2
    assert s.value(ml_collections.ConfigDict({"b": 7}), "b") == 7
    with pytest.raises(KeyError, match="REQUIRED"):
        s.default("a")
    with pytest.raises(KeyError, match="declares no field 'd'"):
        s.value({}, "d")
    assert validation.ENGINE["wandb"] is wandb_logger.FIELDS  # declared beside the code reading it
    assert not wandb_logger.enabled(ml_collections.ConfigDict({"project": "p"}))  # mode: its default
    assert run_lib.DEFAULT_DECAY_GROUPING == validation.ENGINE["optimizer"].default("decay_grouping")


def _engine_field_names():
    names = set(validation.ENGINE_SECTIONS)
    for section in validation.ENGINE.values():
        names |= set(section.specs)
    return names


def test_no_engine_default_is_restated_where_a_config_is_read():
    """The engine and the tasks read an engine field of a config as the field (the trainer fills
    in the schema's defaults first) or through its Section (``Section.value``), never as
    ``config.get(field, <the default again>)``, a second statement that could drift from the
    schema (goat_jax/train/validation.py)."""
    import ast
    import glob
    import os

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    fields = _engine_field_names()
    found = []
    for path in sorted(glob.glob(os.path.join(root, "goat_jax", "train", "*.py"))
                       + glob.glob(os.path.join(root, "goat_jax", "tasks", "*.py"))):
        with open(path) as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
                    and len(node.args) == 2 and isinstance(node.args[0], ast.Constant)
                    and node.args[0].value in fields and "config" in ast.unparse(node.func.value)):
                found.append(f"{os.path.relpath(path, root)}:{node.lineno}: {ast.unparse(node)}")
    assert not found, found
