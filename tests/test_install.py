"""The light core install: the layer needs jax, flax and numpy only; every other module names
the extra it needs in one line when that extra is missing.

The default-suite tests run Python in a subprocess where the optional packages cannot be
imported (a ``sys.meta_path`` blocker), which is what an install without the extra looks like
to the import system. The slow test builds the wheel and installs it into a fresh virtual
environment with the core dependencies only (from PyPI), then runs the README's example there.
"""

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import venv

import pytest

from goat_jax import _extras

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def readme_layer_example(index: int = 0) -> str:
    """The python block ``index`` of the README's 'Using the layer' section, verbatim (0: the
    Linen layer, 1: the same layer in native Flax NNX)."""
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    section = readme[readme.index("## Using the layer"):]
    section = section[:section.index("\n## ", 1)]
    return re.findall(r"```python\n(.*?)```", section, re.S)[index]


# Every optional top-level package except the few that flax itself depends on (so a core
# install has them anyway: optax, orbax, etils, absl), which are blocked only where a test
# says so.
OPTIONAL = sorted(set(_extras.EXTRA_OF_MODULE) - {"optax", "orbax", "etils", "absl"})

_BLOCKER = """
import sys
class _Blocked:
    names = {blocked!r}
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in self.names:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None
sys.meta_path.insert(0, _Blocked())
"""


def _run_blocked(code: str, blocked, timeout: int = 240) -> subprocess.CompletedProcess:
    script = _BLOCKER.format(blocked=set(blocked)) + textwrap.dedent(code)
    env = {**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_readme_layer_example_runs_without_any_optional_package():
    example = readme_layer_example()
    assert "GoatAttention" in example and "(4, 1024, 512)" in example
    # A shorter input than the README's [4, 1024, 512] keeps this in the default suite; the
    # slow wheel test runs the example as written.
    example = example.replace("(4, 1024, 512)", "(2, 64, 512)")
    proc = _run_blocked(example + textwrap.dedent("""
        import sys
        assert y.shape == x.shape[:2] + (512,), y.shape
        assert bool(jax.numpy.all(jax.numpy.isfinite(y)))
        import goat_jax.interop, goat_jax.positional, goat_jax.models, goat_jax.models.sampling
        loaded = sorted({m.split('.')[0] for m in sys.modules} & BLOCKED)
        assert not loaded, loaded
        print("layer-ok")
        """).replace("BLOCKED", repr(set(OPTIONAL + ["optax", "orbax"]))),
        OPTIONAL + ["optax", "orbax"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "layer-ok" in proc.stdout


def test_readme_nnx_example_runs_without_any_optional_package():
    example = readme_layer_example(1)
    assert "from goat_jax.nnx import GoatAttention" in example and "(4, 1024, 512)" in example
    example = example.replace("(4, 1024, 512)", "(2, 64, 512)")  # shorter, as the Linen example's test
    proc = _run_blocked(example + textwrap.dedent("""
        assert y.shape == x.shape[:2] + (512,), y.shape
        assert bool(jnp.all(jnp.isfinite(y)))
        assert float(jnp.abs(grads["q_proj"]["kernel"].get_value()).max()) > 0
        print("nnx-ok")
        """), OPTIONAL)  # flax.nnx itself imports optax (a dependency of flax), so it is not blocked
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "nnx-ok" in proc.stdout


# (module, the package made missing, the extra the message must name)
MISSING_EXTRA_CASES = [
    ("goat_jax.train.trainer", "optax", "train"),
    ("goat_jax.train.checkpoint", "orbax", "train"),
    ("goat_jax.data.text", "grain", "train"),
    ("goat_jax.eval.plots", "matplotlib", "eval"),
    ("goat_jax.eval.harness", "lm_eval", "eval"),
    ("goat_jax.train.wandb_logger", "wandb", "wandb"),
]


def test_a_missing_extra_fails_with_one_line_naming_it():
    # One interpreter for all cases (jax is imported once); the blocked set changes per case,
    # and a module whose import failed is not left in sys.modules.
    proc = _run_blocked(f"""
        import importlib, json, sys
        blocker = sys.meta_path[0]
        out = {{}}
        for module, package, _ in {MISSING_EXTRA_CASES!r}:
            blocker.names = {{package}}
            try:
                mod = importlib.import_module(module)
                if hasattr(mod, "require"):
                    mod.require()  # the package is needed only once the feature is switched on
                out[module] = None
            except ModuleNotFoundError as e:
                out[module] = str(e)
        # The ViT evaluations import without the plotting extra; only drawing a figure needs it.
        blocker.names = {{"matplotlib"}}
        vision = importlib.import_module("goat_jax.eval.vision")
        try:
            vision.plot_resolutions({{}}, "unused.png")
            out["plot_resolutions"] = None
        except ModuleNotFoundError as e:
            out["plot_resolutions"] = str(e)
        print("RESULT:" + json.dumps(out))
        """, [])
    assert proc.returncode == 0, proc.stderr[-3000:]
    messages = json.loads(proc.stdout.split("RESULT:", 1)[1])
    for module, package, extra in MISSING_EXTRA_CASES:
        message = messages[module]
        assert message is not None, f"{module} imported without {package}"
        assert "\n" not in message
        assert message.startswith(module) and repr(package) in message, message
        assert f"pip install 'goat-jax[{extra}]'" in message, message
    assert messages["plot_resolutions"].startswith("goat_jax.eval.vision needs 'matplotlib'"), messages


def test_other_import_errors_are_not_disguised_as_a_missing_extra():
    with pytest.raises(ModuleNotFoundError) as info:
        with _extras.imports("goat_jax.somewhere"):
            import goat_jax_no_such_module  # noqa: F401  pylint: disable=import-error,unused-import
    assert not isinstance(info.value, _extras.MissingExtraError)
    assert "pip install" not in str(info.value)


@pytest.mark.slow(reason="builds a wheel and installs it into a fresh venv")
def test_wheel_in_a_fresh_venv_with_core_dependencies_runs_the_readme_example(tmp_path):
    """Builds the wheel, installs it (no extras; jax, flax, numpy from PyPI, or pip's cache)
    into a new venv without system site-packages, and runs the README example there."""
    # Built from a copy, so that no build/ or egg-info lands in the checkout (an egg-info on
    # sys.path would also make pip think goat-jax is installed already).
    src, dist = tmp_path / "src", tmp_path / "dist"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(os.path.join(ROOT, name), src / name)
    shutil.copytree(os.path.join(ROOT, "goat_jax"), src / "goat_jax",
                    ignore=shutil.ignore_patterns("__pycache__"))
    clean_env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-w", str(dist), str(src)], check=True, capture_output=True, timeout=600,
                   cwd=str(src), env=clean_env)
    wheel = next(dist.glob("goat_jax-*.whl"))
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True, system_site_packages=False).create(env_dir)
    python = str(env_dir / "bin" / "python")
    pins = {}
    with open(os.path.join(ROOT, "requirements.txt")) as f:
        for line in f:
            m = re.match(r"^(jax|jaxlib|flax|numpy)==(\S+)", line.strip())
            if m:
                pins[m.group(1)] = m.group(2)
    # The same versions as the project's pins, so the wheel cache is reused; the wheel's own
    # metadata decides what else comes (flax's dependencies).
    proc = subprocess.run([python, "-m", "pip", "install", "-q", str(wheel)] +
                          [f"{k}=={v}" for k, v in pins.items()], capture_output=True, text=True,
                          timeout=1200, env=clean_env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    freeze = subprocess.run([python, "-m", "pip", "freeze"], capture_output=True, text=True).stdout
    for heavy in ("tensorflow-datasets", "grain", "matplotlib", "lm_eval", "lm-eval", "wandb",
                  "torch", "sentencepiece", "pyarrow", "ml-collections", "ml_collections"):
        assert not re.search(rf"^{heavy}==", freeze, re.M | re.I), f"{heavy} came with the core install"
    script = readme_layer_example() + "\nassert y.shape == (4, 1024, 512)\nprint('wheel-ok')\n"
    proc = subprocess.run([python, "-c", script], cwd=str(tmp_path), capture_output=True, text=True,
                          env={"PATH": os.environ.get("PATH", ""), "JAX_PLATFORMS": "cpu"}, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "wheel-ok" in proc.stdout


def test_every_extra_named_in_the_errors_is_declared_in_pyproject():
    import tomllib

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    extras = project["optional-dependencies"]
    assert set(_extras.EXTRA_OF_MODULE.values()) <= set(extras)
    assert project["dependencies"] == ["jax==0.10.2", "jaxlib==0.10.2", "flax>=0.12", "numpy"]
    # [all] is every extra but the test one and aot-gpu (the CUDA plugin: ~5 GB, docs/aot.md)
    assert extras["all"] == [f"goat-jax[{','.join(sorted(set(extras) - {'all', 'test', 'aot-gpu'}, key=list(extras).index))}]"]
    assert "aot-gpu" in extras
