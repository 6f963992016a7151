#!/usr/bin/env bash
# Sets everything up, then runs the main job: the freetoken demo.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --without-cpp-tests >&2
exec .venv/bin/python -m freetoken_plugin.cli demo "$@"
