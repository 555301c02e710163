#!/usr/bin/env bash
# The GPU acceptance run in one call: gpu_acceptance/run.sh OUT [BUNDLE]
# (BUNDLE: what `make gpu-bundle` wrote, default gpu-bundle/). Installs the
# bundle offline, runs every part within 8 minutes, writes each part's
# result, its log and one summary under OUT (see gpu_acceptance/acceptance.py).
# PYTHON: the interpreter with torch, numba and pytest (default python3).
set -euo pipefail
if [ $# -lt 1 ] || [ $# -gt 2 ]; then
  echo "usage: gpu_acceptance/run.sh OUT [BUNDLE]" >&2
  exit 2
fi
mkdir -p "$1"
args=("$(cd "$1" && pwd)")
if [ $# -eq 2 ]; then args+=("$(cd "$2" && pwd)"); fi
cd "$(dirname "$0")/.."
exec "${PYTHON:-python3}" gpu_acceptance/acceptance.py "${args[@]}"
