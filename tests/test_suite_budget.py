"""The slow-for-budget list in conftest.py names tests that exist (a renamed test would silently
move back into the default suite, or out of every suite's view)."""

import ast
import os

from tests import conftest

HERE = os.path.dirname(__file__)


def test_every_slow_for_budget_entry_names_a_defined_test():
    missing = []
    for entry in conftest.SLOW_FOR_BUDGET:
        path, name = entry.split("::", 1)
        func = name.split("[", 1)[0]
        with open(os.path.join(HERE, path)) as f:
            tree = ast.parse(f.read())
        names = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
        if func not in names:
            missing.append(entry)
    assert not missing, f"tests/conftest.py SLOW_FOR_BUDGET names undefined tests: {missing}"
