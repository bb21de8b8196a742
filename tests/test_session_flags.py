"""The test session's XLA flags (tests/conftest.py): set before jax starts and kept in every
subprocess a test starts with fake devices, beside the device count."""

import os

import pytest

from tests import config_helpers

TEST_XLA_FLAGS = "--xla_backend_optimization_level=0"  # tests/conftest.py's


@pytest.mark.skipif(os.environ.get("GOAT_TEST_XLA_OPT") == "1", reason="GOAT_TEST_XLA_OPT=1 keeps XLA's level")
def test_the_session_flags_reach_this_process_and_fake_device_subprocesses():
    assert TEST_XLA_FLAGS in os.environ["XLA_FLAGS"]
    out = config_helpers.run_on_fake_devices("import os; print(os.environ['XLA_FLAGS'])", devices=3)
    assert TEST_XLA_FLAGS in out and "--xla_force_host_platform_device_count=3" in out, out
