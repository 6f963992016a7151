#!/usr/bin/env bash
# Sets everything up, then runs every test that this machine can run: the C++ unit tests (ctest),
# pytest (CUDA tests skip where the dispatcher has no CUDA kernel), the long property runs
# (pytest -m slow), and, where nvcc exists, a compile of every CUDA source for sm_90a.
# On a GPU machine, `bash benchmarks/gpu_check.sh` builds the CUDA kernels and runs every test there.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
echo "== C++ unit tests (ctest)"
(cd build/cpp && ctest --output-on-failure)
# pytest spreads the tests over one worker process a core (pytest-xdist, at most 4: each worker
# holds torch and transformers); on 2 cores the default run takes about 60 s instead of 95 s.
workers=$(.venv/bin/python -c 'import os; print(min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))')
echo "== Python tests (pytest, $workers workers)"
.venv/bin/python -m pytest -q -n "$workers" "$@"
echo "== long property runs (pytest -m slow, $workers workers)"
.venv/bin/python -m pytest -q -n "$workers" -m slow
echo "== CUDA sources (nvcc, sm_90a, no GPU needed)"
bash scripts/compile_cuda.sh
