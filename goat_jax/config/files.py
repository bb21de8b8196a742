"""Reading a config file: the one loader behind every command and the report harness.

A config is code: ``configs/<name>.py`` defines ``get_config(arg)``, and a *spec*
``'configs/lm_tiny.py:rope,smoke'`` names the file and its argument (parsed by
:mod:`goat_jax.config.args`). :func:`load_config` builds the config of a spec and applies dotted
overrides (``{'model.pos_rank': 8}``); :func:`define_config_flag` is the absl flag
``--config FILE[:ARG] [--config.x=y ...]`` of ``experiments.train`` and ``experiments.toy_prior``,
the same loader with ml_collections' ``--config.<field>=<value>`` overrides (typed, repeatable
for tuples) on top. Two additions to ml_collections' overrides, applied by the command lines
(goat_jax/cli.py) through :func:`take_none_overrides` and :func:`finish_overrides`:
``--config.<field>=None`` sets a number field to None (ml_collections' int parser refuses
``None``), and a field of :data:`ALTERNATIVES` given on the command line replaces the file's
alternative (``--config.per_device_batch_size=4`` sets the file's ``global_batch_size`` to None,
with a log line saying so).

A relative path is looked up in the working directory first and then in the repository root,
so ``python -m experiments.reproduce`` and the tests find ``configs/`` from anywhere.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from goat_jax import _extras
with _extras.imports(__name__):  # optional packages: one-line error naming the extra
    import ml_collections
    from absl import flags
    from ml_collections import config_dict
    from ml_collections import config_flags
    from ml_collections.config_flags import config_path

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # goat_jax/config/files.py
# Command-line values that set a field to None (``--config.global_batch_size=None``).
NONE_VALUES = ("None", "none")
# Pairs of fields of which a config sets exactly one (the other None): the one given on the
# command line replaces the config file's.
ALTERNATIVES = (("global_batch_size", "per_device_batch_size"),)
# The names of the config flags :func:`define_config_flag` made ('config').
_CONFIG_FLAGS: set = set()


def resolve_path(path: str) -> str:
    """The config file ``path`` names: as given if absolute or present in the working
    directory, else under :data:`REPO_ROOT`; FileNotFoundError naming both places if neither."""
    if not path:
        raise FileNotFoundError("config: the path of the config file is empty; give e.g. "
                                "--config configs/lm_tiny.py.")
    if os.path.isabs(path) or os.path.exists(path):
        if not os.path.exists(path):
            raise FileNotFoundError(f"config file {path} not found.")
        return path
    in_repo = os.path.join(REPO_ROOT, path)
    if os.path.exists(in_repo):
        return in_repo
    here = os.getcwd()
    places = REPO_ROOT if os.path.realpath(here) == os.path.realpath(REPO_ROOT) else f"{here} and {REPO_ROOT}"
    raise FileNotFoundError(f"config file {path} not found (looked in {places}).")


def apply_overrides(config: ml_collections.ConfigDict, overrides: Optional[Mapping[str, Any]],
                    spec: str = "the config") -> ml_collections.ConfigDict:
    """Sets each dotted ``overrides`` field of ``config`` in place (``{'data.lag': 2}``) and
    returns it; ValueError naming the field when ``spec`` has no such field (a typo must not
    silently add one)."""
    for key, value in (overrides or {}).items():
        node = config
        *parents, leaf = key.split(".")
        for part in parents:
            if part not in node:
                raise ValueError(f"override {key}: {spec} has no such field.")
            node = node[part]
        if leaf not in node:
            raise ValueError(f"override {key}: {spec} has no such field.")
        node[leaf] = value
    return config


def _references(config: ml_collections.ConfigDict, prefix: str = "") -> List[Tuple[str, Any]]:
    """``[(dotted path, FieldReference)]`` of every field of ``config`` stored as a reference."""
    out = []
    for key, value in config.items(preserve_field_references=True):
        if isinstance(value, ml_collections.ConfigDict):
            out += _references(value, f"{prefix}{key}.")
        elif isinstance(value, config_dict.FieldReference):
            out.append((f"{prefix}{key}", value))
    return out


def check_links(config: ml_collections.ConfigDict, path: str) -> None:
    """Refuses two fields that hold one ``FieldReference`` (``c.b = c.get_ref('a')``): a value
    given for either, on the command line or in an override, would set both, and the run would
    silently differ from the one asked for. A field that defaults to another's value is linked
    one way, ``c.b = c.get_oneway_ref('a')``: setting ``b`` leaves ``a`` alone, setting only
    ``a`` still moves ``b`` (configs/lm_tiny.py's ``model.training_seq_len``)."""
    seen: Dict[int, str] = {}
    for name, ref in _references(config):
        first = seen.setdefault(id(ref), name)
        if first != name:
            # Which field follows which is not recorded; the shallower one reads as the source.
            source, follower = sorted((first, name), key=lambda n: n.count("."))
            raise ValueError(
                f"config file {path}: {source} and {follower} are one FieldReference (get_ref), so "
                f"a value given for either would set both; link the field that follows the other "
                f"one way, e.g. c.{follower} = c.get_oneway_ref({source.rsplit('.', 1)[-1]!r}) "
                "(docs/training.md, 'Configs').")


def load_config(spec: str, overrides: Optional[Mapping[str, Any]] = None) -> ml_collections.ConfigDict:
    """``get_config(arg)`` of ``'path/file.py[:arg]'`` (``get_config()`` without an argument),
    completed with every engine field it leaves out at its declared default
    (:func:`goat_jax.train.validation.add_engine_defaults`) and every model field of its task
    at the field's default (:func:`goat_jax.train.tasks.add_model_defaults`), so any field can be
    set with ``--config.<field>=...``, with dotted ``overrides`` applied (:func:`apply_overrides`)."""
    path, _, arg = spec.partition(":")
    path = resolve_path(path)
    module_spec = importlib.util.spec_from_file_location(
        os.path.splitext(os.path.basename(path))[0], path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    if not hasattr(module, "get_config"):
        raise ValueError(f"config file {path} defines no get_config(arg); every configs/*.py does.")
    config = module.get_config(arg) if arg else module.get_config()
    check_links(config, path)
    # Every engine and model field is settable, not only those the file lists.
    from goat_jax.train import tasks as tasks_lib  # pylint: disable=g-import-not-at-top  # imports the task's model
    from goat_jax.train import validation  # pylint: disable=g-import-not-at-top

    validation.add_engine_defaults(config)
    tasks_lib.add_model_defaults(config)
    return apply_overrides(config, overrides, spec)


class _SpecParser(flags.ArgumentParser):
    """The ``--config`` value parser: a spec -> the locked config of :func:`load_config`. A
    missing file or a bad argument is a ValueError here, which absl reports as a bad
    ``--config`` value (one line, see goat_jax/cli.py) instead of deferring it to the first
    field access as ml_collections' own parser does."""

    def parse(self, argument: str) -> ml_collections.ConfigDict:
        try:
            config = load_config(argument)
        except OSError as e:
            raise ValueError(str(e)) from e
        config.lock()  # --config.<field> may set fields, never add one (a typo is an error)
        return config

    def flag_type(self) -> str:
        return "config object"


def take_none_overrides(argv: Sequence[str]) -> Tuple[List[str], Dict[str, List[str]]]:
    """``argv`` without its ``--<config>.<field>=None`` flags, and ``{config flag: [field]}`` of
    them for :func:`finish_overrides` (absl would hand ``None`` to the field's int parser)."""
    rest, nones = [], {}
    for arg in argv:
        match = re.fullmatch(r"--?([\w-]+)\.([\w.]+)=(\w+)", arg)
        if match and match.group(1) in _CONFIG_FLAGS and match.group(3) in NONE_VALUES:
            nones.setdefault(match.group(1), []).append(match.group(2))
        else:
            rest.append(arg)
    return rest, nones


def _given(flag_values: flags.FlagValues, name: str, field: str,
           nones: Mapping[str, Sequence[str]]) -> bool:
    flag = f"{name}.{field}"
    return field in nones.get(name, ()) or (flag in flag_values and bool(flag_values[flag].present))


def finish_overrides(flag_values: flags.FlagValues, nones: Mapping[str, Sequence[str]]) -> None:
    """After absl parsed the rest of the command line: sets the fields of
    :func:`take_none_overrides` to None (numbers; a string field gets the text, as before), then
    lets a field of :data:`ALTERNATIVES` given on the command line replace the file's other one.
    Raises ``flags.Error`` (one line) for ``=None`` on a field that cannot be None or that the
    config does not have."""
    for name in sorted(_CONFIG_FLAGS):
        if name not in flag_values or flag_values[name].value is None:
            continue
        config = flag_values[name].value
        for field in nones.get(name, ()):
            try:
                kind = config_path.get_type(field, config)
            except (AttributeError, KeyError):
                raise flags.Error(f"--{name}.{field}: the config has no field {field!r}; the fields "
                                  "are the config file's, plus every model field of its task "
                                  "(docs/training.md, 'Configs').") from None
            if kind not in (int, float, str):
                raise flags.Error(f"--{name}.{field}=None: {field} is a {kind.__name__} field, "
                                  "which cannot be None; give a value.")
            config_path.set_value(field, config, "None" if kind is str else None)
        for first, second in ALTERNATIVES:
            if first not in config or second not in config:
                continue
            for given, other in ((first, second), (second, first)):
                if (_given(flag_values, name, given, nones)
                        and not _given(flag_values, name, other, nones)
                        and config[given] is not None and config[other] is not None):
                    logging.warning("--%s.%s=%s replaces the config file's %s=%s (set to None: a "
                                    "config sets one of the two)", name, given, config[given],
                                    other, config[other])
                    config[other] = None


def define_config_flag(name: str, default: Optional[str], help_string: str,
                       flag_values: flags.FlagValues = flags.FLAGS) -> flags.FlagHolder:
    """An absl flag ``--<name> FILE[:ARG]`` whose value is the loaded, locked config, with
    ``--<name>.<field>=<value>`` overrides (ml_collections' ``DEFINE_config_file``, read through
    :func:`load_config`)."""
    # The flag object is ml_collections' (it owns the --name.field overrides); only the file
    # loading is swapped, so every command reads config files the same way. Defined without a
    # default first: a default is parsed when set, and it must be parsed by the swapped loader.
    holder = config_flags.DEFINE_config_file(name, None, help_string, flag_values=flag_values,
                                             lock_config=True)
    _CONFIG_FLAGS.add(name)
    flag_values[name].parser = _SpecParser()
    if default is not None:
        flag_values.set_default(name, default)
    return holder
