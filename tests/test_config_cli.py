"""Every list-like field of every config can be set from the command line, through the same
absl config-file flag that ``experiments.train`` defines (a list-valued field cannot: absl
refuses ``--config.data.paths=FILE`` on a list, so the configs use tuples)."""

import ast
import glob
import os

import pytest
from absl import flags
from ml_collections import config_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The variant arguments that change which list-like fields a config has (every config file must
# be listed: a new one fails test_every_config_file_is_covered until it is).
VARIANTS = {
    "dna_1m": ["goat", "rope"],
    "dna_hg38": ["goat", "rope,fasta"],
    "dna_long": ["goat", "rope"],
    "dna_tiny": ["goat", "rope,smoke"],
    "lm_c4_125m": ["goat", "goat,llama"],
    "lm_fineweb_1b": ["goat"],
    "lm_tiny": ["goat", "rope,smoke"],
    "retrieval_tiny": ["passkey", "niah,rope,smoke,official"],
    "toy_copy_mixture": ["", "smoke"],
    "vit_s16_imagenet": ["goat"],
    "vit_tiny": ["goat", "rope2d,smoke"],  # a ViT encoding ("rope" is the LM's, refused)
}


def _parse(spec, *overrides):
    """The config of ``spec`` with ``overrides`` applied, parsed as experiments.train does."""
    argv = ["train", f"--config={spec}", *overrides]
    values = flags.FlagValues()
    # sys_argv: the flag reads the overrides to define from it (else from sys.argv).
    config_flags.DEFINE_config_file("config", None, "config file", flag_values=values,
                                    lock_config=True, sys_argv=argv)
    values(argv)
    return values.config


def _sequence_fields(config, prefix=""):
    """``{dotted name: value}`` of every list or tuple field, nested sections included."""
    out = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if hasattr(value, "items"):
            out.update(_sequence_fields(value, name + "."))
        elif isinstance(value, (list, tuple)):
            out[name] = value
    return out


def _flags(name, value):
    """Command-line flags that set ``name`` to ``value``: one flag per element for a flat
    sequence of scalars, a Python literal for nested or empty ones."""
    if value and all(isinstance(v, (str, int, float)) and not isinstance(v, bool) for v in value):
        # absl reads each element as a Python literal where it is one: a string such as '22' (a
        # chromosome) must be quoted to stay a string.
        return [f"--config.{name}={v!r}" if isinstance(v, str) and _is_literal(v) else
                f"--config.{name}={v}" for v in value]
    return [f"--config.{name}={tuple(tuple(v) if isinstance(v, list) else v for v in value)!r}"]


def _is_literal(text):
    try:
        ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return False
    return True


def test_every_config_file_is_covered():
    names = {os.path.basename(p)[:-3] for p in glob.glob(os.path.join(ROOT, "configs", "*.py"))}
    assert names - {"__init__"} == set(VARIANTS)


@pytest.mark.parametrize("spec", [f"configs/{name}.py:{arg}" if arg else f"configs/{name}.py"
                                  for name, args in sorted(VARIANTS.items()) for arg in args])
def test_every_sequence_field_is_settable_from_the_command_line(spec, monkeypatch):
    monkeypatch.chdir(ROOT)
    fields = _sequence_fields(_parse(spec))
    lists = sorted(n for n, v in fields.items() if isinstance(v, list))
    assert not lists, f"{spec}: list-valued fields {lists} cannot be set from the command line; use tuples"
    overrides = [f for name, value in fields.items() for f in _flags(name, value)]
    parsed = _parse(spec, *overrides)
    for name, value in fields.items():
        got = parsed
        for part in name.split("."):
            got = got[part]
        assert tuple(got) == tuple(tuple(v) if isinstance(v, list) else v for v in value), name
    # And a new single value for each flat string field (what a user types: one FILE).
    strings = [n for n, v in fields.items() if all(isinstance(x, str) for x in v)]
    parsed = _parse(spec, *[f"--config.{n}=user_value" for n in strings])
    for name in strings:
        got = parsed
        for part in name.split("."):
            got = got[part]
        assert got == ("user_value",), name


def test_a_record_name_read_as_a_number_is_refused_with_the_quoting_fix(monkeypatch):
    """``--config.data.test_records=22`` (chromosome 22) reaches the config as the int 22; the
    field check refuses it before any work and says how to keep it a string."""
    from goat_jax.config.fields import check_section
    from goat_jax.data.dna import DATA

    monkeypatch.chdir(ROOT)
    config = _parse("configs/dna_hg38.py:goat", "--config.data.test_records=22")
    assert tuple(config.data.test_records) == (22,)
    with pytest.raises(ValueError, match=r"data\.test_records=\(22,\) has the wrong type.*reads 22 as a "
                                         r"number.*--config\.data\.test_records=\"'22'\""):
        check_section(config.data, DATA.specs, "data")
    quoted = _parse("configs/dna_hg38.py:goat", "--config.data.test_records='22'")
    assert tuple(quoted.data.test_records) == ("22",)
    check_section(quoted.data, DATA.specs, "data")
