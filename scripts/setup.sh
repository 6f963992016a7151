#!/usr/bin/env bash
# Sets up everything on a fresh CPU machine (idempotent; quick when already done):
# system packages (cmake, GoogleTest), a virtual environment in .venv with the CPU build of torch
# 2.13.0, the Python dependencies, the ft_ops extension built in place, and the C++ unit tests
# (skipped with --without-cpp-tests: the demo does not need them).
set -euo pipefail
cd "$(dirname "$0")/.."
cpp_tests=1
for arg in "$@"; do
  case $arg in
    --without-cpp-tests) cpp_tests=0 ;;
    *) echo "[setup] unknown option $arg (known: --without-cpp-tests)" >&2; exit 2 ;;
  esac
done

log() { printf '[setup] %s\n' "$*"; }
# A failing step says which one, even where its own output was quiet.
trap 'echo "[setup] failed (exit $?) at scripts/setup.sh line $LINENO: $BASH_COMMAND" >&2' ERR

# A usable .venv has pip: without python3-venv, Debian's `python3 -m venv` fails at ensurepip and
# leaves a .venv without it, which is made again once the package is there.
venv_ok() { [ -x .venv/bin/python ] && .venv/bin/python -m pip --version >/dev/null 2>&1; }
if ! command -v cmake >/dev/null || { [ ! -d /usr/lib/x86_64-linux-gnu/cmake/GTest ] && [ ! -d /usr/lib/cmake/GTest ]; } \
    || { ! venv_ok && ! python3 -c 'import ensurepip' 2>/dev/null; }; then
  log "installing cmake, GoogleTest and python3-venv (Debian packages)"
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq cmake libgtest-dev g++ python3-venv >/dev/null
fi

if ! venv_ok; then
  log "creating .venv"
  rm -rf .venv
  python3 -m venv .venv
fi
PY=.venv/bin/python
# torch is pinned to 2.13.0's CPU build: PyPI's torch for Linux is a CUDA build of several GB. Where
# pip has no index or wheel directory of its own configured (a machine with the CPU wheel on disk
# points PIP_FIND_LINKS at it; an extra index does not replace PyPI), the CPU build comes from
# PyTorch's CPU index.
if ! $PY -c 'import torch, sys; sys.exit(0 if torch.__version__.startswith("2.13.0") else 1)' 2>/dev/null; then
  torch_source=()
  if [ -z "${PIP_FIND_LINKS:-}${PIP_INDEX_URL:-}" ] \
      && ! $PY -m pip config list 2>/dev/null | grep -qE '\.index-url|find-links'; then
    torch_source=(--index-url https://download.pytorch.org/whl/cpu)
  fi
  log "installing torch 2.13.0 (CPU build${torch_source[*]:+ from ${torch_source[1]}})"
  $PY -m pip install -q --upgrade pip
  $PY -m pip install -q torch==2.13.0 "${torch_source[@]}"
fi
if ! $PY -c 'import transformers, safetensors, pytest, xdist, hypothesis, expecttest, ninja' 2>/dev/null; then
  log "installing Python dependencies"
  $PY -m pip install -q "torch==2.13.0" "transformers>=5.17" "safetensors>=0.4" accelerate numpy \
    "pytest>=8" pytest-xdist "hypothesis>=6" expecttest ninja
fi

mkdir -p build
# The extension's file, or nothing on a fresh clone (no `ls`: its exit status 2 on no match would end
# this script under `set -e -o pipefail`, silently, as it did in CI).
built=""
for so in ft_ops/_C*.so; do
  if [ -e "$so" ]; then built=$so; break; fi
done
if ! $PY -m pip show -q freetoken-ops >/dev/null 2>&1; then
  # The editable install builds ft_ops._C in place too.
  log "building ft_ops._C (CPU kernels) and installing ft_ops, freetoken_plugin in editable mode (about 2 minutes on 2 cores; log: build/ext_build.log)"
  build=( -m pip install -q --no-build-isolation --no-deps -e . )
elif [ -n "$built" ] && [ -z "$(find src setup.py -type f -newer "$built" | head -1)" ]; then
  # Newer than every source (the editable install's build leaves no objects for build_ext to
  # reuse, so it would compile everything again).
  build=()
  log "ft_ops._C is up to date"
else
  log "building ft_ops._C (CPU kernels), incrementally (log: build/ext_build.log)"
  build=( setup.py build_ext --inplace )
fi
if [ ${#build[@]} -gt 0 ] && ! MAX_JOBS=${MAX_JOBS:-2} $PY "${build[@]}" >build/ext_build.log 2>&1; then
  tail -40 build/ext_build.log >&2
  echo "[setup] the extension did not build (full log: build/ext_build.log)" >&2
  exit 1
fi
compgen -G 'ft_ops/_C*.so' >/dev/null || { echo "[setup] ft_ops/_C*.so is missing after the build" >&2; exit 1; }

if [ "$cpp_tests" = 0 ]; then
  log "ready (C++ unit tests not built: --without-cpp-tests)"
  exit 0
fi
log "building the C++ unit tests (about 2 minutes on 2 cores the first time; log: build/cpp_build.log)"
if ! { cmake -S . -B build/cpp -DCMAKE_PREFIX_PATH="$($PY -c 'import torch; print(torch.utils.cmake_prefix_path)')" &&
       cmake --build build/cpp -j "${MAX_JOBS:-2}"; } >build/cpp_build.log 2>&1; then
  tail -40 build/cpp_build.log >&2
  echo "[setup] the C++ tests did not build (full log: build/cpp_build.log)" >&2
  exit 1
fi
log "ready"
