#!/usr/bin/env bash
# On a GPU machine: the gpu-marked tests at real sizes, then the benchmark, each time-boxed, in one command.
#
#   bash dev/gpu_check.sh                     tests, then kernels and training steps (as the budget allows)
#   PART=tests   bash dev/gpu_check.sh        every gpu test                      (~490 s on an H200; box 560 s)
#   PART=kernels bash dev/gpu_check.sh        the kernel table, forward+backward only        (~270 s)
#   PART=e2e     bash dev/gpu_check.sh        the training steps, each peer in a fresh process (~470 s)
#   PART=trl_head bash dev/gpu_check.sh       TRL's chunked LM head vs ours vs torch (benchmarks/bench_trl_head.py;
#                                             JSON: $OUT/trl_head.json; needs a TRL wheel in .whl/;
#                                             BENCH_TRL_HEAD_ARGS="--cases qwen3_0.6b --sets sft" narrows it)
#   PART=trl_steps bash dev/gpu_check.sh        TRL SFT, DPO, GRPO steps per peer (benchmarks/bench_trl.py; JSON:
#                                             $OUT/trl_steps.json; needs TRL, datasets, dill, multiprocess
#                                             wheels and an autopatch wheel in .whl/; BENCH_TRL_ARGS narrows)
#
# The README table comes from the kernels and e2e parts on one commit, merged:
#   python benchmarks/bench.py --merge k.json e.json --out benchmarks/results/<gpu>-<stack>.json
#   python benchmarks/plot.py benchmarks/results/<gpu>-<stack>.json
#   python benchmarks/readme_table.py benchmarks/results/<gpu>-<stack>.json --update README.md
#
# What it does: (a) installs carried wheels from .whl/ (pydantic-settings & co., liger-kernel,
# cut-cross-entropy: dev/device_env.sh) and uses the repository from PYTHONPATH; (b) prints the GPU and
# the stack; (c) `pytest -v -m gpu tests` with TRITON_INTERPRET=0 (log: $OUT/gpu_tests.log, a line a
# test, so a time box shows where it stopped, then the 15 slowest); (d) benchmarks/bench.py (JSON:
# $OUT/bench.json, log: $OUT/bench.log); (e) the table of what was measured.
# A failing test run does not stop the benchmark. Exit status: 1 if the tests failed or timed out, else
# 2 if the benchmark failed, else 0.
#
# Knobs (environment): PART (above; default all), TOTAL_BUDGET_S=480 (wall clock of the whole script),
#   GPU_TESTS=1, GPU_TEST_K (pytest -k), TEST_BUDGET_S=100, BENCH_PARTS=kernels,e2e (empty: tests only),
#   BENCH_KERNEL_BUDGET_S / BENCH_E2E_BUDGET_S (default: what is left, 55 % / 45 %), BENCH_ONLY,
#   BENCH_PEERS, BENCH_MODES (fwdbwd: the table's mode, ~1/3 of the time), BENCH_E2E_MODELS,
#   BENCH_E2E_PEERS, BENCH_COMPILE_MODE (model|layers), BENCH_E2E_RUN_CAP_S=240, HYPOTHESIS_PROFILE=gpu.
set -uo pipefail
cd "$(dirname "$0")/.."
case "${PART:-all}" in
  all) ;;
  tests) : "${TOTAL_BUDGET_S:=595}" "${TEST_BUDGET_S:=560}"; BENCH_PARTS=${BENCH_PARTS-} ;;
  kernels) : "${TOTAL_BUDGET_S:=560}"; GPU_TESTS=${GPU_TESTS:-0}; BENCH_PARTS=kernels; BENCH_MODES=${BENCH_MODES:-fwdbwd} ;;
  e2e) : "${TOTAL_BUDGET_S:=540}"; GPU_TESTS=${GPU_TESTS:-0}; BENCH_PARTS=e2e ;;
  trl_head) : "${TOTAL_BUDGET_S:=540}"; GPU_TESTS=${GPU_TESTS:-0}; BENCH_PARTS=trl_head ;;
  trl_steps) : "${TOTAL_BUDGET_S:=540}"; GPU_TESTS=${GPU_TESTS:-0}; BENCH_PARTS=trl_steps ;;
  *) echo "gpu_check: PART must be all, tests, kernels, e2e, trl_head or trl_steps; got '$PART'" >&2; exit 2 ;;
esac
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
START=$SECONDS
TOTAL_BUDGET_S=${TOTAL_BUDGET_S:-480}
TEST_BUDGET_S=${TEST_BUDGET_S:-100}
PARTS=${BENCH_PARTS-kernels,e2e}  # set but empty: tests only
since() { echo $((SECONDS - START)); }

echo "== (a) wheels"
source dev/device_env.sh

echo "== (b) machine and stack"
nvidia-smi 2>&1 | tee "$OUT/env.txt"
python3 - <<'EOF' 2>&1 | tee -a "$OUT/env.txt"
import importlib.metadata as md, sys
print("python", sys.version.split()[0], sys.executable)
for d in ("torch", "triton", "transformers", "trl", "liger-kernel", "cut-cross-entropy", "pydantic", "pydantic-settings",
          "typing_extensions", "wrapt", "pytest", "hypothesis", "accelerate", "peft"):
    try:
        print(f"  {d} {md.version(d)}")
    except md.PackageNotFoundError:
        print(f"  {d} MISSING")
import torch
print("cuda", torch.version.cuda, "|", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "NO GPU")
for mod in ("fused_kernels", "autopatch", "liger_kernel.transformers", "cut_cross_entropy", "trl.kernels"):
    try:
        __import__(mod)
        print(f"  import {mod}: ok")
    except Exception as exc:
        print(f"  import {mod}: {type(exc).__name__}: {exc}")
EOF
echo "[gpu_check] setup done at $(since) s"

TEST_RC=0
TEST_NOTE="not run (GPU_TESTS=0)"
if [ "${GPU_TESTS:-1}" = "1" ]; then
  echo "== (c) gpu tests (time box ${TEST_BUDGET_S} s)"
  timeout --kill-after=10 "$TEST_BUDGET_S" env HYPOTHESIS_PROFILE="${HYPOTHESIS_PROFILE:-gpu}" \
    python3 -m pytest -v -m gpu tests -p no:cacheprovider --durations=15 ${GPU_TEST_K:+-k "$GPU_TEST_K"} 2>&1 \
    | tee "$OUT/gpu_tests.log"
  TEST_RC=${PIPESTATUS[0]}
  case $TEST_RC in
    0) TEST_NOTE="passed" ;;
    5) TEST_NOTE="NO gpu tests collected"; TEST_RC=0 ;;
    124|137) TEST_NOTE="TIMED OUT after ${TEST_BUDGET_S} s (raise TEST_BUDGET_S)" ;;
    *) TEST_NOTE="FAILED (pytest exit $TEST_RC)" ;;
  esac
  TEST_NOTE="$TEST_NOTE: $(grep -E '(passed|failed|error|skipped|deselected)' "$OUT/gpu_tests.log" | tail -1)"
  echo "[gpu_check] tests: $TEST_NOTE, at $(since) s"
fi

BENCH_RC=0
LEFT=$((TOTAL_BUDGET_S - $(since) - 30))
if [ -z "$PARTS" ]; then
  echo "[gpu_check] BENCH_PARTS is empty: benchmark not run"
elif [ "$PARTS" = trl_head ]; then
  echo "== (d) TRL's LM head vs ours (budget ${LEFT} s)"
  python3 -c "import trl.kernels" 2>/dev/null \
    || echo "[gpu_check] trl is NOT importable: the TRL peer will be missing (carry a TRL 1.16 wheel in .whl/)"
  timeout --kill-after=10 $((LEFT + 30)) python3 benchmarks/bench_trl_head.py --out "$OUT/trl_head.json" \
    --budget-s "$LEFT" ${BENCH_TRL_HEAD_ARGS:-} 2>&1 | tee "$OUT/trl_head.log"
  BENCH_RC=${PIPESTATUS[0]}
elif [ "$PARTS" = trl_steps ]; then
  echo "== (d) TRL SFT, DPO and GRPO steps: plain, use_liger_kernel, FUSED_KERNELS=all (budget ${LEFT} s)"
  timeout --kill-after=10 $((LEFT + 30)) python3 benchmarks/bench_trl.py --out "$OUT/trl_steps.json" \
    --budget-s "$LEFT" ${BENCH_TRL_ARGS:-} 2>&1 | tee "$OUT/trl_steps.log"
  BENCH_RC=${PIPESTATUS[0]}
elif [ "$LEFT" -lt 60 ]; then
  echo "[gpu_check] only $LEFT s left: benchmark not run"
  BENCH_RC=3
else
  KB=0; EB=0
  case ",$PARTS," in
    *,kernels,*e2e,*|*,e2e,*kernels,*) KB=${BENCH_KERNEL_BUDGET_S:-$((LEFT * 55 / 100))}; EB=${BENCH_E2E_BUDGET_S:-$((LEFT - KB))} ;;
    *,kernels,*) KB=${BENCH_KERNEL_BUDGET_S:-$LEFT} ;;
    *,e2e,*) EB=${BENCH_E2E_BUDGET_S:-$LEFT} ;;
  esac
  echo "== (d) benchmark: parts $PARTS, kernels ${KB} s, e2e ${EB} s"
  timeout --kill-after=10 $((KB + EB + 45)) python3 benchmarks/bench.py --out "$OUT/bench.json" --parts "$PARTS" \
    --kernel-budget-s "$KB" --e2e-budget-s "$EB" 2>&1 | tee "$OUT/bench.log"
  BENCH_RC=${PIPESTATUS[0]}
  if [ "$BENCH_RC" != 0 ] && [ -s "$OUT/bench.json" ]; then
    echo "== (e) table of what was measured before the benchmark stopped (exit $BENCH_RC)"
    python3 benchmarks/bench.py --table "$OUT/bench.json"
  fi
fi

echo
echo "[gpu_check] tests: $TEST_NOTE"
echo "[gpu_check] benchmark: exit $BENCH_RC; results in \$OUT: $(cd "$OUT" && ls | tr '\n' ' ')"
echo "[gpu_check] total $(since) s"
if [ "$TEST_RC" != 0 ]; then exit 1; fi
if [ "$BENCH_RC" != 0 ]; then exit 2; fi
exit 0
