#!/usr/bin/env bash
# The prepared one-GPU check: kernels vs the float64 reference, cuDNN / flash / XLA attention at
# 1k-16k, and the 125M train step; writes benchmarks/gpu.md (see experiments/device_check.py).
# Usage (repository root or anywhere): scripts/device_check.sh [--wheel_dir DIR] [--out FILE]
#        scripts/device_check.sh --dry_run --out /tmp/gpu.md     # CPU rehearsal, tiny sizes
# The whole check finishes within 8 minutes: an internal budget (--budget_s 420) skips late rows,
# and this hard limit stops anything that hangs (sections already written stay in the file).
set -euo pipefail
cd "$(dirname "$0")/.."
exec timeout 475 "${PYTHON:-python3}" -m experiments.device_check "$@"
