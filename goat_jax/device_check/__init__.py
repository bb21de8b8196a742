"""Sections of the prepared one-GPU check (``scripts/device_check.sh`` ->
``experiments/device_check.py``) that live in the library: :mod:`~goat_jax.device_check.ring`,
ring attention's per-step work on one device. Nothing here imports the tests: the float64
reference and the cuDNN stand-in of a dry run are handed in by the command."""
