"""Linked config fields: a field whose default follows another (``model.training_seq_len``
follows ``seq_len``). A value given for either changes that field alone, in either order, on the
command line and in Python overrides; the link still gives the default when only the source is
set. (A two-way ``get_ref`` link made ``--config.model.training_seq_len=32`` set ``seq_len=32``
too, with nothing logged: a PI / log-n / linear-sink study silently ran another experiment.)

Every link of every config in configs/ is listed in :data:`LINKS` and tested both ways; a
completeness check finds the links of every config file itself, so a new link cannot go
untested."""

import glob
import os
import sys

import pytest
from absl import flags

from goat_jax.config import files as config_files

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# config spec -> [(follower, source)]: the follower's default is the source's value.
LINKS = {
    "configs/lm_tiny.py": [("model.training_seq_len", "seq_len")],
    "configs/lm_c4_125m.py": [("model.training_seq_len", "seq_len")],
    "configs/lm_fineweb_1b.py": [("model.training_seq_len", "seq_len")],
    "configs/retrieval_tiny.py": [("model.training_seq_len", "seq_len")],
    "configs/toy_copy_mixture.py": [("model.training_seq_len", "seq_len")],
    "configs/dna_tiny.py": [("model.training_seq_len", "seq_len")],
    "configs/dna_hg38.py": [("model.training_seq_len", "seq_len")],
    "configs/dna_long.py": [("model.training_seq_len", "seq_len"), ("model.max_len", "seq_len")],
    "configs/dna_1m.py": [("model.training_seq_len", "seq_len"), ("model.max_len", "seq_len")],  # dna_long's
}
CASES = [(spec, follower, source) for spec, links in LINKS.items() for follower, source in links]


def _linked_pairs(config):
    """``{frozenset({a, b})}`` of the fields linked to each other, either by one shared
    reference (``get_ref``) or by a reference computed from another field's
    (``get_oneway_ref``), whatever the direction."""
    refs = config_files._references(config)  # pylint: disable=protected-access
    pairs = set()
    for i, (path, ref) in enumerate(refs):
        for other, other_ref in refs[i + 1:]:
            if ref is other_ref:
                pairs.add(frozenset((path, other)))
    for path, ref in refs:
        parent = ref._value  # pylint: disable=protected-access  # a computed reference's input
        for other, other_ref in refs:
            if parent is other_ref and other != path:
                pairs.add(frozenset((path, other)))
    return pairs


def _parse(monkeypatch, spec, *overrides):
    """The config of ``spec`` with ``--config.<field>=<value>`` overrides, parsed by the loader
    and flag of the commands (goat_jax/config/files.py)."""
    values = flags.FlagValues()
    holder = config_files.define_config_flag("config", None, "test", flag_values=values)
    argv = ["prog", f"--config={spec}", *overrides]
    monkeypatch.setattr(sys, "argv", argv)  # ml_collections finds the overrides there
    values(argv)
    return holder.value


def _get(config, dotted):
    node = config
    for part in dotted.split("."):
        node = node[part]
    return node


@pytest.mark.parametrize("spec,follower,source", CASES)
def test_a_linked_field_given_alone_changes_that_field_alone_on_the_command_line(monkeypatch, spec, follower, source):
    default = _get(config_files.load_config(spec), source)
    config = _parse(monkeypatch, spec, f"--config.{follower}=48")
    assert (_get(config, follower), _get(config, source)) == (48, default)
    config = _parse(monkeypatch, spec, f"--config.{source}=96")  # the link gives the default
    assert (_get(config, follower), _get(config, source)) == (96, 96)
    for order in ([f"--config.{follower}=48", f"--config.{source}=96"],
                  [f"--config.{source}=96", f"--config.{follower}=48"]):
        config = _parse(monkeypatch, spec, *order)
        assert (_get(config, follower), _get(config, source)) == (48, 96), order


@pytest.mark.parametrize("spec,follower,source", CASES)
def test_a_linked_field_given_alone_changes_that_field_alone_in_python_overrides(spec, follower, source):
    default = _get(config_files.load_config(spec), source)
    config = config_files.load_config(spec, {follower: 48})
    assert (_get(config, follower), _get(config, source)) == (48, default)
    config = config_files.load_config(spec, {source: 96})
    assert (_get(config, follower), _get(config, source)) == (96, 96)
    for order in ({follower: 48, source: 96}, {source: 96, follower: 48}):
        config = config_files.load_config(spec, order)
        assert (_get(config, follower), _get(config, source)) == (48, 96), order
    # Set on the loaded config (as dna_bench and the benchmarks do): the same.
    config = config_files.load_config(spec)
    config_files.apply_overrides(config, {follower: 48})
    assert _get(config, source) == default


def test_every_link_of_every_config_is_listed():
    found = {}
    for path in sorted(glob.glob(os.path.join(ROOT, "configs", "*.py"))):
        spec = os.path.relpath(path, ROOT)
        pairs = _linked_pairs(config_files.load_config(spec))
        if pairs:
            found[spec] = pairs
        with open(path) as f:
            text = f.read()
        if any(word in text for word in ("get_ref", "get_oneway_ref", "FieldReference")):
            assert spec in LINKS, f"{spec} links fields; list them in LINKS"
    assert found == {spec: {frozenset(p) for p in links} for spec, links in LINKS.items()}


def test_a_two_way_link_is_refused_naming_the_fields_and_the_fix(tmp_path):
    """A config file of the user's with ``get_ref``: one shared reference, which any value would
    set for both fields; the loader says so instead of running another experiment."""
    path = tmp_path / "mine.py"
    path.write_text("import ml_collections\n\ndef get_config():\n"
                    "    c = ml_collections.ConfigDict()\n    c.seq_len = 64\n"
                    "    c.model = ml_collections.ConfigDict()\n"
                    "    c.model.training_seq_len = c.get_ref('seq_len')\n    return c\n")
    with pytest.raises(ValueError, match=r"mine.py: seq_len and model.training_seq_len are one FieldReference "
                                         r".*get_oneway_ref\('seq_len'\)"):
        config_files.load_config(str(path))
