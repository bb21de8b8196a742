"""Config and model helpers shared by the tests."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from goat_jax.train import validation
from goat_jax.kernels.plan import AttentionPlan


def set_fields(config, **overrides):
    """Sets dotted fields, ``set_fields(c, **{'optimizer.learning_rate': 1e-3})``; returns c.
    A config with a ``task`` first gets the engine fields it leaves out at their declared
    defaults, as a run has them (goat_jax/train/validation.py), so any of them can be set."""
    if "task" in config:
        validation.add_engine_defaults(config)
    for key, value in overrides.items():
        node = config
        *path, leaf = key.split(".")
        for p in path:
            node = node[p]
        node[leaf] = value
    return config


def lm_smoke_config(**overrides):
    """``configs/lm_tiny.py:goat,smoke`` without the progress bar, with dotted overrides."""
    from configs import lm_tiny  # pylint: disable=g-import-not-at-top  # ml_collections: not on the GPU image
    config = lm_tiny.get_config("goat,smoke")
    config.progress_bar = False
    return set_fields(config, **overrides)


def compile_train_step(config, devices, abstract_mesh: bool = False):
    """The engine's sharded train step for ``config`` on ``devices`` (fake CPU devices, or a
    target's from ``goat_jax.aot.target_devices``), compiled from abstract state and batch; returns
    the compiled program (``memory_analysis()``, ``as_text()``). ``abstract_mesh``: build the steps
    under the mesh's abstract mesh (devices of another platform)."""
    import contextlib  # pylint: disable=g-import-not-at-top

    from goat_jax.train import sharding, tasks, trainer  # pylint: disable=g-import-not-at-top
    task = tasks.get_task(config.task)
    config = tasks.with_field_defaults(config, task)
    mesh = sharding.make_mesh(config.mesh, devices)
    dummy = task.dummy_batch(config, config.global_batch_size)
    bsh = {k: sharding.batch_sharding(mesh, v.ndim) for k, v in dummy.items()}
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh) if abstract_mesh else contextlib.nullcontext():
        steps = trainer.make_sharded_steps(task, config, mesh, sharding.rules_from_config(config.sharding_rules), bsh,
                                           plan=AttentionPlan.from_config(config))
    state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                         steps.abstract_state, steps.state_shardings)
    return steps.train_step.lower(state, trainer.global_abstract_batch(dummy, bsh, 1)).compile()


def random_params(model, length: int, rng: np.random.Generator, std: float = 0.3):
    """Parameters of ``model`` (an LM taking ``[1, length]`` token ids) filled with N(0, std)
    NumPy draws (norm scales 1 + 0.1 N(0, std)), from ``eval_shape``: no init compile."""
    shapes = nn.unbox(jax.eval_shape(model.init, jax.random.PRNGKey(0), jnp.zeros((1, length), jnp.int32)))

    def fill(path, x):
        noise = rng.normal(0.0, std, x.shape)
        if jax.tree_util.keystr(path).endswith("['scale']"):
            noise = 1.0 + 0.1 * noise
        return jnp.asarray(noise, x.dtype)

    return jax.tree_util.tree_map_with_path(fill, shapes["params"])


def random_lm_run(workdir, config, std: float = 0.2, seed: int = 0):
    """An :class:`goat_jax.eval.lm_run.LMRun` of ``config`` (an LM config) at step 0 whose
    parameters are all N(0, std) draws: evaluation code paths without training."""
    from goat_jax.eval import lm_run  # pylint: disable=g-import-not-at-top
    from goat_jax.train import tasks  # pylint: disable=g-import-not-at-top

    task = tasks.get_task(config.task)
    config = tasks.with_field_defaults(config, task)  # as load_run gives a run's config
    plan = AttentionPlan.from_config(config)
    model = task.build_model(config, plan)
    shapes = nn.unbox(jax.eval_shape(model.init, jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32)))
    rng = np.random.default_rng(seed)
    params = jax.tree_util.tree_map(lambda x: jnp.asarray(rng.normal(0, std, x.shape), x.dtype), shapes["params"])
    return lm_run.LMRun(workdir=str(workdir), config=config, task=task, model=model, params=params, step=0, plan=plan)


def xla_flags(devices: int) -> str:
    """XLA_FLAGS for a subprocess with ``devices`` fake CPU devices: the session's flags
    (tests/conftest.py) and the device count."""
    import os  # pylint: disable=g-import-not-at-top

    return " ".join(f for f in (os.environ.get("XLA_FLAGS", ""),
                                f"--xla_force_host_platform_device_count={devices}") if f)


def default_level_flags() -> str:
    """This process's XLA_FLAGS without tests/conftest.py's optimization level: XLA's default
    level, for a subprocess whose time is running rather than compiling, or whose bits must
    equal a recording made at the defaults."""
    import os  # pylint: disable=g-import-not-at-top

    return " ".join(f for f in os.environ.get("XLA_FLAGS", "").split()
                    if not f.startswith("--xla_backend_optimization_level"))


def _run_script(script: str, args, xla_flags_value: str, timeout: int) -> str:
    """``python -c script *args`` from the repository root on CPU with ``XLA_FLAGS`` set to
    ``xla_flags_value``; asserts it exits 0 (its stderr tail in the message), returns stdout."""
    import os  # pylint: disable=g-import-not-at-top
    import subprocess  # pylint: disable=g-import-not-at-top
    import sys  # pylint: disable=g-import-not-at-top

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, XLA_FLAGS=xla_flags_value, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", script, *args], cwd=root, env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def run_at_xla_defaults(script: str, *args: str, timeout: int = 600) -> str:
    """Runs ``python -c script *args`` like :func:`run_on_fake_devices`, one device, at XLA's
    default optimization level (:func:`default_level_flags`): for the tests that compare bits
    with a recording made at the defaults (the CPU backend's level 0 rounds transcendental
    functions differently in the last bit). Returns its stdout."""
    return _run_script(script, args, default_level_flags(), timeout)


def run_on_fake_devices(script: str, *args: str, devices: int = 8, timeout: int = 600) -> str:
    """Runs ``python -c script *args`` from the repository root in a fresh process with
    ``devices`` fake CPU devices (XLA_FLAGS must be set before jax is imported, hence the
    subprocess); asserts it exits 0 (its stderr tail in the message) and returns its stdout."""
    return _run_script(script, args, xla_flags(devices), timeout)


def computed_in_batches(compute, default_keys):
    """``get(key)``: ``compute``'s value for ``key``, memoized. ``compute(keys)`` returns
    ``{key: value}`` for a list of keys (one subprocess, say); the first call computes its key
    and every one of ``default_keys`` in one call, a later key missing from those alone."""
    found: dict = {}

    def get(key):
        if key not in found:
            found.update(compute([key] + ([] if found else [k for k in default_keys if k != key])))
        return found[key]
    return get


def run_compile_only(args, timeout: int = 300, gpu: bool = False):
    """``python *args`` from the repository root as an ahead-of-time compile runs it
    (docs/aot.md): ``JAX_PLATFORMS=cpu``, and for GPU targets ``JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1``
    (the CUDA plugin's checks of a local GPU). Returns the ``CompletedProcess`` (text output):
    the caller asserts on its exit code, since some runs are expected to fail."""
    import os  # pylint: disable=g-import-not-at-top
    import subprocess  # pylint: disable=g-import-not-at-top
    import sys  # pylint: disable=g-import-not-at-top

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    if gpu:
        env["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] = "1"
    return subprocess.run([sys.executable, *args], cwd=root, env=env, capture_output=True, text=True,
                          timeout=timeout)

