"""Marks shared by the tests: ``SLOW_CASE`` marks one case of a parametrized test slow (the
suite's other cases of it run by default), with the reason pytest shows for it."""

import pytest

SLOW_CASE = pytest.mark.slow(reason="one more case of a test whose other cases run in the default suite")
