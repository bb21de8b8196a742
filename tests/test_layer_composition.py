"""The attention layer is composed, not inherited (docs/layer.md): the core takes values and
returns values and never calls back into the layer that holds it, no layer class has two of the
package's classes as bases, and nothing in goat_jax/layers/ keeps state in a thread-local."""

import ast
import inspect
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAYERS = os.path.join(ROOT, "goat_jax", "layers")


def _tree(name):
    with open(os.path.join(LAYERS, name)) as f:
        return ast.parse(f.read())


def test_the_core_calls_nothing_on_a_layer():
    """No function of goat_jax/layers/core.py takes a layer (a parameter named layer, shell,
    module or self outside a value class) or calls an underscore method on anything but a
    NamedTuple's ``_replace``."""
    tree = _tree("core.py")
    params = {a.arg for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.Lambda))
              for a in f.args.args + f.args.kwonlyargs}
    assert not params & {"layer", "shell", "module"}, params
    private_calls = {n.func.attr for n in ast.walk(tree) if isinstance(n, ast.Call)
                     and isinstance(n.func, ast.Attribute) and n.func.attr.startswith("_")}
    assert private_calls <= {"_replace"}, private_calls


def test_no_layer_class_has_two_of_our_classes_as_bases():
    from goat_jax.layers import call, core, encoding, goat, linen, nnx, positional  # pylint: disable=g-import-not-at-top

    for module in (call, core, encoding, goat, linen, nnx, positional):
        for _, cls in inspect.getmembers(module, inspect.isclass):
            ours = [b for b in cls.__bases__ if b.__module__.startswith("goat_jax")]
            assert len(ours) <= 1, (cls, ours)


@pytest.mark.parametrize("name", sorted(n for n in os.listdir(LAYERS) if n.endswith(".py")))
def test_no_thread_local_in_the_layers(name):
    with open(os.path.join(LAYERS, name)) as f:
        assert "threading" not in f.read(), name


def test_the_layer_spec_is_the_linen_layers_fields():
    """core.LayerSpec (what the core reads of a layer) and linen.Attention's fields (what a user
    sets) name the same fields with the same defaults, so neither drifts from the other; the NNX
    layer takes the Linen fields as keywords."""
    import dataclasses  # pylint: disable=g-import-not-at-top

    from goat_jax.layers import core, linen  # pylint: disable=g-import-not-at-top

    spec = {f.name: f.default for f in dataclasses.fields(core.LayerSpec) if f.name != "owner"}
    layer = {f.name: f.default for f in dataclasses.fields(linen.Attention)
             if f.name not in ("parent", "name", "encoding")}
    assert spec == layer
