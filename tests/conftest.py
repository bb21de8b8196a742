"""Shared fixtures: fresh random inputs every run, with the seed printed for reproduction."""

import os
import time

import numpy as np
import pytest


@pytest.fixture
def rng(request):
    """A NumPy Generator seeded from the clock (or GOAT_TEST_SEED), so every run sees new
    inputs; the seed is printed so a failure can be replayed with GOAT_TEST_SEED=<seed>."""
    seed = int(os.environ.get("GOAT_TEST_SEED", time.time_ns() % (1 << 32)))
    print(f"[{request.node.name}] GOAT_TEST_SEED={seed}")
    return np.random.default_rng(seed)
