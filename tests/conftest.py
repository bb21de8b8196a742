"""Shared fixtures: fresh random inputs every run, with the seed printed for reproduction."""

import os
import shutil
import tempfile
import time

import numpy as np
import pytest


# XLA's CPU backend at LLVM optimization level 0: the tests' programs are small, so their time
# is mostly compiling, not running (measured 2026-12-05: tests/test_attention.py 148 -> 107 CPU
# seconds). The math is the same HLO; only the machine code is less optimized.
# GOAT_TEST_XLA_OPT=1 keeps XLA's default level.
TEST_XLA_FLAGS = "--xla_backend_optimization_level=0"


def pytest_configure(config):
    """Sets :data:`TEST_XLA_FLAGS` (unless ``GOAT_TEST_XLA_OPT=1``) before any test module
    imports jax (subprocesses keep them: ``tests.config_helpers.xla_flags``); then the
    compilation cache below."""
    if (os.environ.get("GOAT_TEST_XLA_OPT", "0") != "1" and not hasattr(config, "workerinput")
            and "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", "")):
        os.environ["XLA_FLAGS"] = " ".join(f for f in (os.environ.get("XLA_FLAGS", ""), TEST_XLA_FLAGS) if f)
    _compilation_cache(config)


def _compilation_cache(config):
    """One persistent XLA compilation cache for the whole test session, in a fresh folder: the
    many tests that start ``experiments.train`` (or build the same small model again in process)
    compile the same programs, and a cached executable is the same compiled code, loaded instead
    of compiled. Set before any test module imports jax; the environment reaches the xdist
    workers and every subprocess a test starts. ``GOAT_TEST_XLA_CACHE=0`` turns it off; an
    existing ``JAX_COMPILATION_CACHE_DIR`` is left as it is. Removed at the end of the session."""
    if (os.environ.get("GOAT_TEST_XLA_CACHE", "1") == "0" or "JAX_COMPILATION_CACHE_DIR" in os.environ
            or hasattr(config, "workerinput")):  # an xdist worker inherits the controller's
        return
    folder = tempfile.mkdtemp(prefix="goat-jax-tests-xla-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = folder
    # Programs that compile in under ~0.2 s are not worth a file each.
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")
    config.goat_xla_cache = folder


def pytest_unconfigure(config):
    """Removes the session's compilation cache (pytest_configure)."""
    folder = getattr(config, "goat_xla_cache", None)
    if folder:
        shutil.rmtree(folder, ignore_errors=True)
        os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)


@pytest.fixture(scope="session", autouse=True)
def temporary_files_under_pytest(tmp_path_factory):
    """Points TMPDIR (this process's ``tempfile`` and every subprocess a test starts) at a folder
    under pytest's base temp, which pytest prunes: a library that leaves temporary files behind
    does so there, not in the machine's /tmp (TFDS's DatasetInfo makes an empty ``tmp*tfds``
    folder for each builder of a dataset that is not prepared, e.g. under ``mock_data``)."""
    folder = str(tmp_path_factory.mktemp("tmpdir"))
    old = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = folder
    tempfile.tempdir = None  # re-read TMPDIR
    yield folder
    if old is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = old
    tempfile.tempdir = None


@pytest.fixture
def rng(request):
    """A NumPy Generator seeded from the clock (or GOAT_TEST_SEED), so every run sees new
    inputs; the seed is printed so a failure can be replayed with GOAT_TEST_SEED=<seed>."""
    seed = int(os.environ.get("GOAT_TEST_SEED", time.time_ns() % (1 << 32)))
    print(f"[{request.node.name}] GOAT_TEST_SEED={seed}")
    return np.random.default_rng(seed)
