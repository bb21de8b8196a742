#!/usr/bin/env bash
# Sets up goat-jax on a clean Debian machine: the Debian data packages the tests and the tiny
# configs read, a virtual environment in .venv, and the pinned Python requirements (+ test extra).
# Usage: bash scripts/setup.sh && . .venv/bin/activate
set -euo pipefail
cd "$(dirname "$0")/.."

# Real data the tests and the tiny configs read (docs/protocols.md, "Real data used at small
# scale"): the Jargon File (language), Fashion-MNIST IDX files (ViT), bacterial genomes and
# 40 kb of human chr17 and ~200 kb of human GRCh37 chromosomes 1-3 (DNA).
DATA_PACKAGES="jargon-text dataset-fashion-mnist ragout-examples python-pyfaidx-examples artfastqgenerator-examples"
MISSING=""
for pkg in $DATA_PACKAGES; do dpkg -s "$pkg" >/dev/null 2>&1 || MISSING="$MISSING $pkg"; done
if [ -n "$MISSING" ]; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq $MISSING >/dev/null
fi

[ -d .venv ] || python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q -r requirements.txt
python -m pip install -q -e ".[all,test]"
echo "goat-jax is set up: . .venv/bin/activate"
