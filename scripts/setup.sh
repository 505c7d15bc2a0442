#!/usr/bin/env bash
# Quick start, command 1: a venv with an editable install, then the main job on its embedded default
# (a tiny Llama trained a few steps, every kernel on; on a CPU the kernels run in Triton's interpreter).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
# torch first, pinned: on these machines 2.13.0 (CPU) lies on disk; an unpinned torch pulls a CUDA build.
.venv/bin/python -m pip install -q --disable-pip-version-check "torch==${TORCH_VERSION:-2.13.0}"
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[test]'
if ! .venv/bin/python -c 'import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  export TRITON_INTERPRET=1
fi
FUSED_KERNELS=all .venv/bin/python -m autopatch run examples/train_tiny.py
