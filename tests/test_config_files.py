"""goat_jax/config/files.py, the one config loader: specs with and without an argument,
dotted overrides, relative paths from anywhere, and the absl ``--config`` flag on top of it
(overrides typed by ml_collections, a bad file or argument refused at parse time)."""

import os

import ml_collections
import pytest
from absl import flags

from configs import lm_tiny, toy_copy_mixture
from goat_jax.config import files as config_files
from goat_jax.models import lm
from goat_jax.train import tasks, validation


def _write_config(path, body="c.x = 1\n    c.sub = ml_collections.ConfigDict({'y': 2.0})"):
    path.write_text("import ml_collections\n\ndef get_config(arg=None):\n    c = ml_collections.ConfigDict()\n"
                    f"    c.arg = arg\n    {body}\n    return c\n")
    return path


def test_load_config_equals_the_config_function(tmp_path, monkeypatch):
    """The same config as calling ``get_config`` directly (plus the engine and model fields the
    file leaves out, at their defaults), from the repository root or from any other working directory
    (relative specs fall back to the repository root)."""
    for cwd in (config_files.REPO_ROOT, str(tmp_path)):
        monkeypatch.chdir(cwd)
        for spec, raw in (("configs/lm_tiny.py:rope,smoke", lm_tiny.get_config("rope,smoke")),
                          ("configs/toy_copy_mixture.py", toy_copy_mixture.get_config())):
            raw, loaded = raw.to_dict(), config_files.load_config(spec).to_dict()
            # The engine fields the file leaves out, at their declared defaults.
            engine = validation.with_engine_defaults(ml_collections.ConfigDict(raw)).to_dict()
            assert {**loaded, "model": None} == {**engine, "model": None}
            assert {k: v for k, v in loaded["model"].items() if k in raw["model"]} == raw["model"]
            added = {k: v for k, v in loaded["model"].items() if k not in raw["model"]}
            defaults = {**{f"{k}": v for k, v in tasks.PLAN_FIELDS.default_values().items()},
                        **{k: getattr(lm.LMConfig, k) for k in added if hasattr(lm.LMConfig, k)}}
            assert added and all(v == defaults[k] for k, v in added.items()), added


def test_overrides_apply_and_unknown_fields_are_refused(tmp_path):
    path = _write_config(tmp_path / "cfg.py")
    config = config_files.load_config(f"{path}:a", {"x": 5, "sub.y": 0.5})
    assert (config.arg, config.x, config.sub.y) == ("a", 5, 0.5)
    assert config_files.load_config(str(path)).arg is None  # no ':' -> get_config()
    for bad in ("z", "sub.z", "nosuch.y"):
        with pytest.raises(ValueError, match=f"override {bad}: .* has no such field"):
            config_files.load_config(str(path), {bad: 1})


def test_a_relative_path_prefers_the_working_directory(tmp_path, monkeypatch):
    """A config next to the user wins over the repository's of the same name."""
    os.makedirs(tmp_path / "configs")
    _write_config(tmp_path / "configs" / "lm_tiny.py", body="c.mine = True")
    monkeypatch.chdir(tmp_path)
    assert config_files.load_config("configs/lm_tiny.py").mine is True
    with pytest.raises(FileNotFoundError, match="configs/nope.py not found .looked in"):
        config_files.load_config("configs/nope.py")
    (tmp_path / "empty.py").write_text("x = 1\n")
    with pytest.raises(ValueError, match="defines no get_config"):
        config_files.load_config("empty.py")


def test_config_flag_loads_through_the_loader_with_typed_overrides(tmp_path, monkeypatch):
    path = _write_config(tmp_path / "cfg.py")
    values = flags.FlagValues()
    holder = config_files.define_config_flag("config", None, "test", flag_values=values)
    argv = ["prog", f"--config={path}:b", "--config.x=7", "--config.sub.y=3"]
    monkeypatch.setattr("sys.argv", argv)  # ml_collections finds the --config.* overrides there
    values(argv)
    config = holder.value
    assert isinstance(config, ml_collections.ConfigDict)
    assert (config.arg, config.x, config.sub.y) == ("b", 7, 3.0)
    assert isinstance(config.sub.y, float)  # typed by the field's default
    with pytest.raises(AttributeError):
        config.new_field = 1  # locked: an override can set a field, never add one

    with_default = flags.FlagValues()
    monkeypatch.setattr("sys.argv", ["prog"])
    holder = config_files.define_config_flag("config", str(path), "test", flag_values=with_default)
    with_default(["prog"])
    assert holder.value.x == 1 and holder.value.arg is None

    missing = flags.FlagValues()
    config_files.define_config_flag("config", None, "test", flag_values=missing)
    with pytest.raises(flags.IllegalFlagValueError, match="not found"):
        missing(["prog", f"--config={tmp_path / 'absent.py'}"])


def test_a_missing_config_names_each_folder_it_looked_in_once(tmp_path, monkeypatch):
    """From the repository root the working directory is the repository: the message named the
    same folder twice ("looked in X and X")."""
    monkeypatch.chdir(config_files.REPO_ROOT)
    with pytest.raises(FileNotFoundError) as info:
        config_files.load_config("configs/nope.py")
    assert str(info.value) == f"config file configs/nope.py not found (looked in {config_files.REPO_ROOT})."
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match=rf"\(looked in {tmp_path} and {config_files.REPO_ROOT}\)"):
        config_files.load_config("configs/nope.py")
