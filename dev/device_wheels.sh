#!/usr/bin/env bash
# Here, before a GPU call: fills .whl/ (git-ignored) with what the GPU image lacks, as wheels for its
# Python 3.12 x86-64, and an autopatch wheel of this checkout (its .pth then runs there, as for a user).
# dev/device_env.sh installs them on the GPU machine; the call names ".whl" in carry (~8 MB).
#
#   bash dev/device_wheels.sh            everything: the runtime's needs, the peers, TRL and DeepSpeed
#
# The image already has torch, triton, transformers, accelerate, peft, pytest, hypothesis, wrapt,
# pandas, pyarrow, xxhash, msgpack, ninja, psutil, py-cpuinfo and nvidia-ml-py.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}  # DeepSpeed's setup imports torch
mkdir -p .whl
rm -f .whl/autopatch-*.whl
fetch() {
  "$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl "$@"
}
# the runtime's settings (pydantic-settings and what it needs)
fetch pydantic==2.14.4 pydantic-core==2.50.5 pydantic-settings==2.16.3 annotated-types==0.8.0 \
  typing-inspection==0.4.5 python-dotenv==1.2.4
# the peers
fetch liger-kernel==0.8.5 cut-cross-entropy==25.1.1
# TRL and what its trainers import
fetch trl==1.16.0 datasets==4.7.0 dill==0.4.1 multiprocess==0.70.19
# DeepSpeed has no wheel on PyPI: built here from its sdist (no ops compiled), plus hjson
fetch hjson==3.1.0
if ! compgen -G ".whl/deepspeed-*.whl" >/dev/null; then
  DS_BUILD_OPS=0 "$PY" -m pip wheel -q --disable-pip-version-check --no-deps deepspeed==0.19.8 -w .whl
fi
# today's Hugging Face stack, installed only with HUB_STACK=1 (dev/device_env.sh): transformers 5.25, which
# requires Hub kernels 0.19.1 and kernelizes from_pretrained models by default, and what they need beyond the image
mkdir -p .whl/hub
fetch_hub() { fetch "$@"; mv .whl/*.whl .whl/hub/ 2>/dev/null || true; }
keep=$(mktemp -d); mv .whl/*.whl "$keep"/
fetch_hub transformers==5.25.0 kernels==0.19.1 huggingface_hub==2.4.0 tokenizers==0.23.3 safetensors==0.8.0 \
  httpx2==2.17.0 httpcore2==2.17.0 truststore==0.10.5 h11==0.16.0 anyio==4.16.0 idna==3.21 click==8.5.1 \
  hf-xet==1.8.0 tomlkit==0.15.3 typer==0.29.2 regex==2026.12.2 typing-extensions==4.15.0
mv "$keep"/*.whl .whl/; rmdir "$keep"
# this checkout
"$PY" -m pip wheel -q --disable-pip-version-check --no-deps . -w .whl
ls -1 .whl .whl/hub
du -sh .whl
