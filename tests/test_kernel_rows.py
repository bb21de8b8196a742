"""A kernel is its row, a strategy is its module (issue #63): no module compares a kernel's name
but the kernel's own and the registry's literal table (an ``ast`` scan of goat_jax/), every row
is built with keywords, the built-in rows are one literal table imported explicitly (no package
walk, no ``sys.modules`` writes), a plugin's row shows in ``IMPLEMENTATIONS`` at once, and what a
reader asks of a kernel (ring blocks, probabilities, the fallback order, the document bound) is
answered by the row's fields, whatever its name."""

import ast
import functools
import os
import sys

import jax.numpy as jnp
import pytest

from goat_jax import kernels
from goat_jax.kernels import capabilities as caps
from goat_jax.kernels import registry, strategies
from goat_jax.kernels.plan import AttentionPlan

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REGISTRY = os.path.join("goat_jax", "kernels", "registry.py")
# Files the lead's rewrite of the attention layer changes (issue #63 hands over the replacement):
# the scan fails for any other file, and xfails naming these while only they compare a name.
PENDING: dict = {}  # every site of the layers asks the row (kernels.returns_probs)
ROW_TYPES = ("Capability", "Strategy", "RingBlocks", "FastWidths")


def _strings(node):
    """The string constants of ``node``, looking inside tuple / list / set / dict literals."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        yield node.value
    elif isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        for element in node.elts:
            yield from _strings(element)
    elif isinstance(node, ast.Dict):
        for element in [*node.keys, *node.values]:
            if element is not None:
                yield from _strings(element)


def name_comparisons(source: str, names, allowed=frozenset()):
    """``[(line, name)]``: where ``source`` compares a kernel name of ``names`` (other than the
    ``allowed`` ones): a comparison (==, !=, in, not in) with the name among its operands, or a
    table of names at module or class level (e.g. ``{"gpu": "cudnn"}`` looked up later; a
    single default such as ``KERNEL = "xla"`` names a choice and is no table)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            found += [(node.lineno, s) for side in (node.left, *node.comparators) for s in _strings(side)]
        elif isinstance(node, (ast.Module, ast.ClassDef)):  # a table of names, looked up later
            found += [(stmt.lineno, s) for stmt in node.body
                      if isinstance(stmt, (ast.Assign, ast.AnnAssign))
                      and isinstance(stmt.value, (ast.Dict, ast.Tuple, ast.List, ast.Set))
                      for s in _strings(stmt.value)]
    return sorted({(line, s) for line, s in found if s in names and s not in allowed})


def _module_file(row) -> str:
    """The file of the module that declares ``row`` (its attention function's module)."""
    fn = row.attention.func if isinstance(row.attention, functools.partial) else row.attention
    return os.path.relpath(sys.modules[fn.__module__].__file__, ROOT)


def _sources(folder: str):
    for dirpath, _, files in os.walk(os.path.join(ROOT, folder)):
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(dirpath, name)
                with open(path) as f:
                    yield os.path.relpath(path, ROOT), f.read()


def test_the_scan_finds_a_name_comparison_and_a_table_of_names():
    names = {"dense", "cudnn", "splash"}
    assert name_comparisons('if implementation == "dense":\n    pass\n', names) == [(1, "dense")]
    assert name_comparisons('ok = name in ("splash", "other")\n', names) == [(1, "splash")]
    assert name_comparisons('FAST = {"gpu": "cudnn"}\n', names) == [(1, "cudnn")]
    assert name_comparisons('if implementation == "dense":\n    pass\n', names, allowed={"dense"}) == []
    # Naming a kernel is not comparing one: a call's argument, a message, a config value.
    assert name_comparisons('attend(q, implementation="dense")\nx = f"use \'dense\'"\nK = "dense"\n', names) == []


def test_no_kernel_name_is_compared_outside_its_own_module_and_the_registry():
    names = set(registry.KERNELS)
    own = {}
    for name, row in registry.KERNELS.items():
        own.setdefault(_module_file(row), set()).add(name)
    offenders = {}
    for path, source in _sources("goat_jax"):
        if path == REGISTRY:
            continue
        hits = name_comparisons(source, names, frozenset(own.get(path, ())))
        if hits:
            offenders[path] = hits
    stale = sorted(set(PENDING) - set(offenders))
    assert not stale, f"these files compare no kernel name any more: remove them from PENDING: {stale}"
    unexpected = {p: h for p, h in offenders.items() if p not in PENDING}
    assert not unexpected, (f"kernel names compared outside their own module and {REGISTRY} (ask the row: "
                            f"a field of goat_jax/kernels/capabilities.py's Capability): {unexpected}")


def test_rows_are_built_with_keywords_only():
    with pytest.raises(TypeError):
        caps.Capability("toy", caps.ANY, (), "a positional row", lambda *a, **k: None)  # pylint: disable=too-many-function-args
    with pytest.raises(TypeError):
        strategies.Strategy("toy", lambda *a, **k: None)  # pylint: disable=too-many-function-args
    positional = []
    for folder in ("goat_jax", "tests"):
        for path, source in _sources(folder):
            if path == os.path.relpath(__file__, ROOT):
                continue  # the refusals above
            for node in ast.walk(ast.parse(source)):
                if isinstance(node, ast.Call) and node.args:
                    called = getattr(node.func, "attr", getattr(node.func, "id", None))
                    if called in ROW_TYPES:
                        positional.append(f"{path}:{node.lineno} {called}")
    assert not positional, f"rows built with positional arguments (use keywords): {positional}"


def test_the_built_in_rows_are_one_literal_table_imported_explicitly():
    with open(os.path.join(ROOT, REGISTRY)) as f:
        tree = ast.parse(f.read())
    tables = {node.targets[0].id if isinstance(node, ast.Assign) else node.target.id: node.value
              for node in tree.body if isinstance(node, (ast.Assign, ast.AnnAssign))}
    for table in ("KERNELS", "STRATEGIES"):
        assert isinstance(tables[table], ast.Dict), table
        assert all(isinstance(k, ast.Constant) and isinstance(k.value, str) for k in tables[table].keys), table
    assert all(row.name == name for name, row in registry.KERNELS.items())
    assert all(s.name == name for name, s in registry.STRATEGIES.items())
    assert list(registry.KERNELS) == sorted(registry.KERNELS)
    assert {n: caps.CAPABILITIES[n] for n in registry.KERNELS} == registry.KERNELS
    assert {n: strategies.STRATEGIES[n] for n in registry.STRATEGIES} == registry.STRATEGIES
    # No package walk and no writes into sys.modules: the registry is the one list.
    for path in ("goat_jax/kernels/__init__.py", "goat_jax/kernels/capabilities.py", "goat_jax/kernels/strategies.py"):
        with open(os.path.join(ROOT, path)) as f:
            source = f.read()
        imported = {a.name for n in ast.walk(ast.parse(source)) if isinstance(n, (ast.Import, ast.ImportFrom))
                    for a in n.names} | {n.module for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ImportFrom)}
        assert not imported & {"pkgutil", "importlib", "sys"}, (path, imported)
        assert "sys.modules" not in source, path


def _probe_row(**fields):
    """A plugin's row: any platform, no feature (unless ``fields`` say otherwise), no ring blocks."""
    row = dict(name="probe", platforms=caps.ANY, features=(), summary="a probe (tests/test_kernel_rows.py)",
               attention=lambda *a, **k: None, why_not={f: "the probe takes nothing" for f in caps.FEATURES})
    return caps.Capability(**{**row, **fields})


@pytest.fixture
def probe_row():
    """Registers a probe row for the test (plugins register with one call) and removes it after."""
    added = []

    def add(**fields):
        added.append(caps.register(_probe_row(**fields)))
        return added[-1]
    yield add
    for row in added:
        caps.CAPABILITIES.pop(row.name, None)


def test_a_plugins_row_is_in_implementations_at_once_without_writing_the_package(probe_row):
    assert "probe" not in kernels.IMPLEMENTATIONS
    probe_row()
    assert "probe" in kernels.IMPLEMENTATIONS and "probe" in caps.IMPLEMENTATIONS
    assert "probe" in kernels.implementations() and "IMPLEMENTATIONS" not in vars(kernels)
    with pytest.raises(ValueError, match="registered already"):
        caps.register(_probe_row())


def test_a_row_without_ring_blocks_says_nothing_of_ring_and_the_ring_refuses_it(probe_row):
    """'ring' is no column of the rows: the ring strategy reads a row's ring blocks, so a plugin
    row (or 'dense') without them is refused in the strategy's words, and one with them runs."""
    assert "ring" not in caps.FEATURES and "ring" not in caps.CAPABILITIES["dense"].why_not
    ring = strategies.get("ring")
    req = caps.Request.of(("cpu", "here"), jnp.float32, 8, strategy=ring)
    probe_row()
    for name in ("dense", "probe"):
        assert caps.refusal(name, req).startswith(f"implementation={name!r} cannot take context_strategy='ring': "
                                                  "ring attention merges blocks by their log-sum-exp")
    assert caps.refusal("flash", req) is None and caps.refusal("xla", req) is None
    with_masks = caps.Request.of(("gpu", "here"), jnp.bfloat16, 8, strategy=ring, key_masks=True)
    assert "segment ids or key padding under context_strategy='ring'" in caps.refusal("cudnn", with_masks)
    assert caps.refusal("cudnn", caps.Request.of(("gpu", "here"), jnp.bfloat16, 8, strategy=ring)) is None
    gathered = caps.Request.of(("cpu", "here"), jnp.float32, 8, strategy=strategies.get("all_gather"))
    assert caps.refusal("dense", gathered) is None


def test_what_a_layer_asks_of_a_kernel_is_its_rows_answer(probe_row):
    assert kernels.returns_probs("dense") and not kernels.returns_probs("xla")
    assert not kernels.returns_probs(None) and not kernels.returns_probs("no such kernel")
    probe_row(features=("return_probs",), why_not={f: "no" for f in caps.FEATURES if f != "return_probs"},
              bounds_documents=True)
    assert kernels.returns_probs("probe")
    assert AttentionPlan(implementation="probe").document_bound() == AttentionPlan().max_documents_per_row
    assert AttentionPlan(implementation="flash").document_bound() is None


def test_the_fallback_order_is_read_off_the_rows(monkeypatch):
    """Small CPU calls fall back to the row that holds the logits, big ones to the row that does
    not; change the rows' fields and the same calls choose otherwise, with no name compared."""
    small, big = (1, 2, 16, 16), (1, 8, 2048, 2048)
    choose = lambda shape: kernels.resolve_implementation(None, jnp.float32, 8, shape, mesh=None)
    assert (choose(small), choose(big)) == ("xla", "flash")
    xla, flash = caps.CAPABILITIES["xla"], caps.CAPABILITIES["flash"]
    monkeypatch.setitem(caps.CAPABILITIES, "xla", caps.Capability(**{**xla.__dict__, "materializes_logits": False}))
    monkeypatch.setitem(caps.CAPABILITIES, "flash", caps.Capability(**{**flash.__dict__, "materializes_logits": True}))
    assert (choose(small), choose(big)) == ("flash", "xla")
    monkeypatch.setitem(caps.CAPABILITIES, "flash", caps.Capability(**{**flash.__dict__, "fallback": None}))
    monkeypatch.setitem(caps.CAPABILITIES, "xla", caps.Capability(**{**xla.__dict__, "fallback": None}))
    assert choose(big) == "dense"  # the next tier
