#!/usr/bin/env bash
# Sets up goat-jax on a clean Debian machine: the Debian data packages the tests and the tiny
# configs read, a virtual environment in .venv, and the pinned Python requirements (+ test extra).
# Usage: bash scripts/setup.sh && . .venv/bin/activate
set -euo pipefail
cd "$(dirname "$0")/.."

# Real data (REFERENCE.md section 5): the Jargon File (/usr/share/doc/jargon-text/jargon.txt.gz).
if ! dpkg -s jargon-text >/dev/null 2>&1; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq jargon-text >/dev/null
fi
# Fashion-MNIST IDX files (/usr/share/datasets/fashion-mnist) for the tiny ViT config and tests.
if ! dpkg -s dataset-fashion-mnist >/dev/null 2>&1; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq dataset-fashion-mnist >/dev/null
fi

[ -d .venv ] || python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q -r requirements.txt
python -m pip install -q -e ".[test]"
echo "goat-jax is set up: . .venv/bin/activate"
