"""Every slow test says why at its definition: each ``pytest.mark.slow`` in the tests is called
with a ``reason`` (the mark on a test, on one ``pytest.param`` case, or ``tests.marks.SLOW_CASE``),
and nothing outside a test's definition marks tests slow (conftest.py marks nothing). The
README's test command, .ci/run and a bare ``pytest`` run the same default suite, and the README
stays a short front door."""

import ast
import glob
import os
import re
import shlex
import tomllib

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


ROOT = os.path.dirname(HERE)


def _pytest_args(command: str) -> list:
    """The arguments after ``-m pytest`` of a shell command line."""
    words = shlex.split(command)
    at = next(i for i in range(len(words) - 1) if words[i:i + 2] == ["-m", "pytest"])
    return words[at + 2:]


def test_readme_ci_and_a_bare_pytest_run_the_same_default_suite():
    """The README's test command is what .ci/run runs, and a bare ``pytest`` selects the same
    tests (``addopts`` in pyproject.toml), while ``-m slow`` on the command line replaces it."""
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    promised = [line.split("then: ", 1)[1] for line in readme.splitlines() if line.startswith("bash .ci/run")]
    assert len(promised) == 1, "README: one `bash .ci/run  # = ..., then: <pytest command>` line"
    with open(os.path.join(ROOT, ".ci", "run")) as f:
        ran = [line for line in f.read().splitlines() if " -m pytest" in line and not line.startswith("#")]
    assert len(ran) == 1 and _pytest_args(ran[0]) == _pytest_args(promised[0]), (ran, promised)
    args = _pytest_args(promised[0])
    marker = args[args.index("-m") + 1]
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        addopts = tomllib.load(f)["tool"]["pytest"]["ini_options"]["addopts"]
    assert shlex.split(addopts) == ["-m", marker] == ["-m", "not slow"]


def test_the_readme_is_a_short_front_door_whose_links_resolve():
    """README at most 200 lines (the details live in docs/), its main-job command names a real
    entry point, and every relative link of the README and docs/install.md resolves."""
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    assert len(readme.splitlines()) <= 200
    assert "bash scripts/setup.sh && .venv/bin/python -m experiments.toy_prior --workdir runs/toy" in readme
    assert os.path.exists(os.path.join(ROOT, "experiments", "toy_prior.py"))
    for page in ("README.md", os.path.join("docs", "install.md")):
        with open(os.path.join(ROOT, page)) as f:
            text = f.read()
        base = os.path.dirname(os.path.join(ROOT, page))
        targets = [t.split("#")[0] for t in re.findall(r"\]\(([^)\s]+)\)", text) if "://" not in t]
        missing = [t for t in targets if t and not os.path.exists(os.path.join(base, t))]
        assert targets and not missing, (page, missing)
