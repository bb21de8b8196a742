"""The entry points in experiments/ start without error-level lines on a host without TPUs
(goat_jax/platforms.py): with libtpu installed (scripts/setup.sh installs it for the compile
tool) JAX used to initialise libtpu at its first backend start and print ``Failed to find host
bounds for accelerator type``, ``E0000 ... TPU_WORKER_HOSTNAMES`` and a source-location trace
before falling back to the CPU, starting with README's first command. The decision itself is
tested on fake hosts (a TPU, a GPU, the user's own JAX_PLATFORMS: nothing changes); the commands
on this host, where they can tell (libtpu installed, no TPU or GPU)."""

import ast
import glob
import os
import re
import subprocess
import sys

import pytest

from goat_jax import platforms
from goat_jax.kernels.plan import AttentionPlan

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENTRY_POINTS = sorted(os.path.splitext(os.path.basename(p))[0] for p in glob.glob(os.path.join(ROOT, "experiments", "*.py"))
                      if not os.path.basename(p).startswith("_"))
# Error-level lines: absl/glog E and F lines, and libtpu's own words.
ERROR_LINE = re.compile(r"^([EF]\d{4} |ERROR|FATAL|Failed to find host bounds|=== Source Location Trace)")

cpu_host_with_libtpu = pytest.mark.skipif(
    not platforms.libtpu_installed() or platforms.tpu_may_be_present() or platforms.gpu_may_be_present(),
    reason="needs libtpu installed on a host without TPU or GPU (elsewhere JAX's own discovery is kept)")


def _host(tmp_path, vendors=("0x8086",), nodes=(), pci=True):
    """A fake root: PCI devices of ``vendors`` and the device ``nodes`` (e.g. 'dev/nvidia0')."""
    root = tmp_path / "root"
    (root / "dev").mkdir(parents=True)
    if pci:
        for i, vendor in enumerate(vendors):
            device = root / "sys" / "bus" / "pci" / "devices" / f"0000:00:0{i}.0"
            device.mkdir(parents=True)
            (device / "vendor").write_text(vendor + "\n")
    for node in nodes:
        (root / node).parent.mkdir(parents=True, exist_ok=True)
        (root / node).write_text("")
    return str(root)


def test_the_cpu_is_asked_for_only_where_no_tpu_or_gpu_may_be_and_the_user_chose_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(platforms, "libtpu_installed", lambda: True)
    cpu_only = _host(tmp_path)
    environ = {}
    assert platforms.avoid_libtpu_without_tpu(cpu_only, environ) and environ == {"JAX_PLATFORMS": "cpu"}
    kept = {
        "a TPU chip on the PCI bus": (_host(tmp_path / "t", vendors=("0x8086", "0x1ae0")), {}),
        "TPU device nodes": (_host(tmp_path / "a", nodes=("dev/accel0",)), {}),
        "vfio TPUs": (_host(tmp_path / "v", nodes=("dev/vfio/0",)), {}),
        "a TPU VM's environment": (cpu_only, {"TPU_WORKER_HOSTNAMES": "localhost"}),
        "an NVIDIA GPU": (_host(tmp_path / "n", nodes=("dev/nvidia0",)), {}),
        "an AMD GPU": (_host(tmp_path / "k", nodes=("dev/kfd",)), {}),
        "no readable PCI list": (_host(tmp_path / "p", pci=False), {}),
        "the user's JAX_PLATFORMS": (cpu_only, {"JAX_PLATFORMS": "tpu"}),
        "the user's JAX_PLATFORMS=''": (cpu_only, {"JAX_PLATFORMS": ""}),
    }
    for why, (root, env) in kept.items():
        before = dict(env)
        assert not platforms.avoid_libtpu_without_tpu(root, env), why
        assert env == before, why
    monkeypatch.setattr(platforms, "libtpu_installed", lambda: False)
    environ = {}
    assert not platforms.avoid_libtpu_without_tpu(cpu_only, environ) and environ == {}  # nothing to avoid


def test_every_entry_point_asks_before_any_backend_starts():
    """Each experiments/ module's ``__main__`` block calls platforms.avoid_libtpu_without_tpu()
    first (the compile tool sets JAX_PLATFORMS=cpu itself, before its imports: it compiles for
    devices it does not have)."""
    assert len(ENTRY_POINTS) >= 14
    for name in ENTRY_POINTS:
        path = os.path.join(ROOT, "experiments", f"{name}.py")
        with open(path) as f:
            tree = ast.parse(f.read())
        if name == "compile":
            code = [ast.unparse(n) for n in tree.body]
            sets = code.index("os.environ.setdefault('JAX_PLATFORMS', 'cpu')")
            assert sets < min(i for i, c in enumerate(code) if "goat_jax" in c and "import" in c), path
            continue
        main = [n for n in tree.body if isinstance(n, ast.If) and "__main__" in ast.unparse(n.test)]
        assert len(main) == 1, f"{path}: no __main__ block"
        calls = [ast.unparse(n) for n in main[0].body[:2]]
        assert calls == ["from goat_jax import platforms", "platforms.avoid_libtpu_without_tpu()"], (path, calls)


def _errors(stderr):
    return [line for line in stderr.splitlines() if ERROR_LINE.match(line)]


def _env():
    from tests import config_helpers  # pylint: disable=g-import-not-at-top

    env = dict(os.environ)
    env.pop("JAX_PLATFORMS", None)  # as a newcomer's shell has it
    # ... and XLA's own optimization level (tests/conftest.py lowers it for the test session's
    # small programs; the README's job is a training run, whose time is running, not compiling).
    env["XLA_FLAGS"] = config_helpers.default_level_flags()
    return env


@cpu_host_with_libtpu
def test_the_readme_first_command_prints_no_error_lines(tmp_path):
    """README's first command, ``python -m experiments.toy_prior --workdir runs/toy``, at its
    smallest (the smoke config, ~15 s on 2 cores)."""
    proc = subprocess.run([sys.executable, "-m", "experiments.toy_prior", "--config", "configs/toy_copy_mixture.py:smoke",
                           "--workdir", str(tmp_path / "toy")], cwd=ROOT, env=_env(), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not _errors(proc.stderr), proc.stderr[-3000:]
    assert (tmp_path / "toy" / "toy_prior.png").exists()


_START = """
import runpy, sys
sys.argv = [sys.argv[1], "--help"]
try:
    runpy.run_module("experiments." + sys.argv[0], run_name="__main__")
except SystemExit:
    pass
import jax  # imported by the command already: the same module
print("BACKEND", jax.default_backend(), flush=True)  # what the command's work would start
"""


@cpu_host_with_libtpu
@pytest.mark.slow(reason="one fresh process per entry point (~3 s each); README's first command runs in the "
                         "default suite, and every entry point's start is checked there statically")
@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_every_entry_point_starts_without_error_lines(name):
    """Each command's start (its ``--help``), then the first backend its work would start."""
    proc = subprocess.run([sys.executable, "-c", _START, name], cwd=ROOT, env=_env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0 and "BACKEND cpu" in proc.stdout, proc.stderr[-3000:]
    assert not _errors(proc.stderr), proc.stderr[-3000:]


# ----------------------------------------------------------------------------------------------
# config.gpu_xla_flags: XLA's GPU options reach programs compiled for GPUs only
# ----------------------------------------------------------------------------------------------


def test_gpu_xla_flags_only_for_gpu_devices():
    assert platforms.gpu_compiler_options(True, "gpu") == platforms.GPU_XLA_FLAGS
    assert platforms.gpu_compiler_options(True, "cuda") == platforms.GPU_XLA_FLAGS
    assert all(k.startswith("xla_gpu_") for k in platforms.GPU_XLA_FLAGS)
    for platform in ("cpu", "tpu"):
        assert platforms.gpu_compiler_options(True, platform) == {}
    assert platforms.gpu_compiler_options(False, "gpu") == {}


def test_gpu_xla_flags_are_off_in_a_cpu_train_step(monkeypatch):
    """``gpu_xla_flags=True`` on a CPU mesh: the trainer's jitted steps get no compiler option
    (the jit calls are watched)."""
    import jax  # pylint: disable=g-import-not-at-top

    from goat_jax.train import sharding, tasks, trainer  # pylint: disable=g-import-not-at-top
    from tests.config_helpers import lm_smoke_config  # pylint: disable=g-import-not-at-top

    seen = []
    real_jit = jax.jit

    def watching_jit(fun, **kwargs):
        seen.append(kwargs.get("compiler_options"))
        return real_jit(fun, **kwargs)

    monkeypatch.setattr(trainer.jax, "jit", watching_jit)
    config = lm_smoke_config(gpu_xla_flags=True)
    task = tasks.get_task("lm")
    mesh = sharding.make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])
    batch = task.dummy_batch(config, 2)
    bsh = {k: sharding.batch_sharding(mesh, v.ndim) for k, v in batch.items()}
    steps = trainer.make_sharded_steps(task, config, mesh, sharding.rules_from_config(config.sharding_rules), bsh,
                                       plan=AttentionPlan.from_config(config))
    assert mesh.devices.flat[0].platform == "cpu"
    assert len(seen) == 3 and all(not opts for opts in seen), seen
    assert steps.train_step is not None
