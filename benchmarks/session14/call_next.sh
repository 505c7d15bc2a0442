#!/usr/bin/env bash
# Prepared in session 14 for the next session's first device call (<= ~9 min; carry [".whl"]): the three
# experiments that session could not run, in order of what they decide, each under its own time limit.
#   1. call_ring.sh: session 13's ring exchange (two slots per cluster: CE scratch 0.8 MiB -> ~30 KB, the
#      "0 extra" of the CE target) with the shared-memory gpu tests, and CE 128256 / 262144 timed.
#   2. call_rms_regs.sh: the RMSNorm long-row backward read once, w_eff and dw in registers (the one
#      RMSNorm target not met).
#   3. call_flce_granule.sh: FLCE chunk rows at the Gemma-like shape and Qwen3's lm_head.
#   and, after 1, the gpu test of the rope kernel rotating one tensor (k of no heads), new in session 14.
# The patch of 1 stays applied on the device's copy for 2 and 3 (FLCE's chunks run the CE kernel).
# Afterwards, here: if 1 passed, `git apply benchmarks/session13/ring_exchange.patch` and commit; then the
# full table (benchmarks/session12/call_table.sh, PART=kernels then PART=e2e).
set -uo pipefail
cd "$(dirname "$0")/../.."
export OUT=${OUT:-$PWD/gpu_out}; mkdir -p "$OUT"
TEST_S=${TEST_S:-100} EXP_S=${EXP_S:-60} bash benchmarks/session14/call_ring.sh
git apply --check -R benchmarks/session13/ring_exchange.patch 2>/dev/null || echo "NOTE: the ring patch is not applied"
# the rope kernel with a k of no heads at Gemma 4's layout (the rope rule's one-tensor forms, session 14):
# early, because the rule already sends Gemma 3n / 4 and GPT-J there
(source scripts/device_env.sh >/dev/null 2>&1; timeout ${ROPE_S:-50} python3 -m pytest -m gpu -q -x -p no:cacheprovider \
  tests/test_rope.py -k one_tensor 2>&1 | tail -n 5 | tee "$OUT/gpu_tests_rope_one_tensor.log")
EXP_S=${RMS_S:-150} bash benchmarks/session14/call_rms_regs.sh
GEMMA_S=${GEMMA_S:-100} QWEN_S=${QWEN_S:-50} bash benchmarks/session14/call_flce_granule.sh
