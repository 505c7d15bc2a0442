#!/usr/bin/env bash
# Quick start, command 2: the CPU test suite (kernels under TRITON_INTERPRET=1, set in tests/conftest.py).
# Progress: pytest's dots with the share done at the end of each row, and a line for each test file
# once its last test has finished (scripts/pytest_progress.py: under pytest-xdist the files' tests
# interleave); pytest's summary line comes last.
set -euo pipefail
cd "$(dirname "$0")/.."
workers=${PYTEST_WORKERS:-2}
echo "test: the CPU test suite on $workers pytest-xdist workers (PYTEST_WORKERS), about 6 minutes on 2 cores," \
     "most of it in Triton's interpreter; extra arguments go to pytest"
exec .venv/bin/python -m pytest -n "$workers" -p scripts.pytest_progress tests "$@"
