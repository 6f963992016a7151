#!/usr/bin/env bash
# Compiles every CUDA source for sm_90a with nvcc, without a GPU and without linking, so the kernels
# cannot rot on a machine that never runs them (CI). Uses the torch headers of .venv (the CPU wheel
# ships c10/cuda and ATen/cuda; the one header its CMake build generates is written here). Fails on
# any compile error; prints each kernel that spills registers.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
if ! command -v nvcc >/dev/null; then
  echo "[compile_cuda] nvcc not found: skipped" >&2
  exit 0
fi
torch_include=$($PY -c 'import torch.utils.cpp_extension as c; print(" ".join(c.include_paths()))')
python_include=$($PY -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
shim=build/cuda_shim
mkdir -p "$shim/c10/cuda/impl" build/cuda_objects
[ -f "$shim/c10/cuda/impl/cuda_cmake_macros.h" ] ||
  printf '#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n' >"$shim/c10/cuda/impl/cuda_cmake_macros.h"
includes=(-I"$shim" -Isrc -I"$python_include")
for dir in $torch_include; do includes+=(-I"$dir"); done
status=0
compile() {
  local src=$1 name log
  name=$(basename "$src" .cu)
  log=build/cuda_objects/$name.log
  if ! nvcc -std=c++20 -O3 --use_fast_math -lineinfo --expt-relaxed-constexpr \
      -gencode=arch=compute_90a,code=sm_90a -DFT_WITH_CUDA -DTORCH_EXTENSION_NAME=_C \
      "${includes[@]}" --resource-usage -c "$src" -o "build/cuda_objects/$name.o" >"$log" 2>&1; then
    cat "$log" >&2
    echo "[compile_cuda] $src: FAILED" >&2
    return 1
  fi
  local spills
  # No spilling kernel means no grep match: `|| true` keeps pipefail from failing the file.
  spills=$({ grep -B2 -E "[1-9][0-9]* bytes spill stores" "$log" || true; } | sed -n "s/.*Function properties for \(.*\)/\1/p" | c++filt | sed -e 's/(anonymous namespace):://' -e 's/(.*//' | sort -u | paste -sd, - | sed 's/,/, /g')
  echo "[compile_cuda] $src: ok ($(grep -c 'Compiling entry function' "$log") kernels${spills:+; spilling: $spills})"
}
pids=()
for src in src/cuda/*.cu; do
  compile "$src" & pids+=($!)
done
for pid in "${pids[@]}"; do wait "$pid" || status=1; done
exit $status
