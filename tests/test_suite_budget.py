"""Every slow test says why at its definition: each ``pytest.mark.slow`` in the tests is called
with a ``reason`` (the mark on a test, on one ``pytest.param`` case, or ``tests.marks.SLOW_CASE``),
and nothing outside a test's definition marks tests slow (conftest.py marks nothing)."""

import ast
import glob
import os

HERE = os.path.dirname(__file__)


def _slow_marks(tree):
    """``(line, is a call with reason=)`` of every ``pytest.mark.slow`` in a parsed file."""
    calls = {id(n.func): n for n in ast.walk(tree) if isinstance(n, ast.Call)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "slow" and isinstance(node.value, ast.Attribute) \
                and node.value.attr == "mark":
            call = calls.get(id(node))
            yield node.lineno, call is not None and any(k.arg == "reason" for k in call.keywords)


def test_every_slow_mark_gives_its_reason():
    bare = []
    count = 0
    for path in sorted(glob.glob(os.path.join(HERE, "*.py"))):
        with open(path) as f:
            tree = ast.parse(f.read())
        for line, reasoned in _slow_marks(tree):
            count += 1
            if not reasoned:
                bare.append(f"{os.path.basename(path)}:{line}")
    assert count > 20  # the walk found the marks
    assert not bare, f"pytest.mark.slow without reason= at {bare}"


def test_conftest_marks_nothing():
    with open(os.path.join(HERE, "conftest.py")) as f:
        tree = ast.parse(f.read())
    hooks = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
    assert "pytest_collection_modifyitems" not in hooks
