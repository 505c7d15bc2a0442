#!/usr/bin/env bash
# Quick start, command 1: a venv with an editable install, then the main job on its embedded default
# (a tiny Llama trained a few steps, every kernel on; on a CPU the kernels run in Triton's interpreter).
# Each step says what it does and about how long it takes (2 CPU cores; a warm pip cache is faster).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH=${TORCH_VERSION:-2.13.0}
began=$SECONDS
step_began=$SECONDS

step() {  # step N "what it does" "about how long"
  step_began=$SECONDS
  echo "setup [$1/4] $2 ... $3"
}
took() {
  echo "        done in $((SECONDS - step_began)) s"
}

if [ -x .venv/bin/python ]; then
  step 1 "virtual environment .venv: already there, kept" "0 s"
else
  step 1 "creating the virtual environment .venv with $PY" "~5 s"
  "$PY" -m venv .venv
  took
fi
# torch first, pinned: on these machines 2.13.0 (CPU) lies on disk; an unpinned torch pulls a CUDA build.
step 2 "installing torch $TORCH (CPU build; set TORCH_VERSION to change)" "~1 min"
.venv/bin/python -m pip install -q --disable-pip-version-check "torch==$TORCH"
took
step 3 "installing autopatch (editable) with transformers, triton, pydantic-settings and the test tools (pytest, hypothesis, accelerate, peft)" "~1-2 min"
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[test]'
took
if ! .venv/bin/python -c 'import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  export TRITON_INTERPRET=1
  where="no GPU: the kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1)"
else
  where="on the GPU"
fi
step 4 "the main job: examples/train_tiny.py, a tiny Llama trained 10 steps with every kernel on, $where" "~40 s on a CPU, seconds on a GPU"
FUSED_KERNELS=all .venv/bin/python -m autopatch run examples/train_tiny.py
took

interp=""
[ "${TRITON_INTERPRET:-}" = 1 ] && interp="TRITON_INTERPRET=1 "
cat <<DONE

setup finished in $((SECONDS - began)) s. To use the environment:
  source .venv/bin/activate
every kernel on (what ran above):
  ${interp}FUSED_KERNELS=all python -m autopatch run examples/train_tiny.py
plain transformers, to compare:
  python examples/train_tiny.py
the test suite (about 6 minutes on 2 cores):
  bash scripts/test.sh
DONE
