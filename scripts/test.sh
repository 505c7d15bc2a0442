#!/usr/bin/env bash
# Quick start, command 2: the CPU test suite (kernels under TRITON_INTERPRET=1, set in tests/conftest.py).
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/python -m pytest -q -n "${PYTEST_WORKERS:-2}" tests "$@"
