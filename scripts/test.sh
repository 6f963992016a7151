#!/usr/bin/env bash
# Sets everything up, then runs every test: pytest (CPU; CUDA tests skip where the dispatcher has
# no CUDA kernel) and the C++ unit tests through ctest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
echo "== C++ unit tests (ctest)"
(cd build/cpp && ctest --output-on-failure)
echo "== Python tests (pytest)"
.venv/bin/python -m pytest -q "$@"
