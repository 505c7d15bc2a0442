#!/usr/bin/env bash
# Two GPUs (nvidia-h200-x2), one call: data-parallel training of a small Llama-shaped model (~120M
# parameters, vocab 32000) with torchrun, plain vs patched by the environment alone, loss curves compared.
#
#   bash dev/two_gpu_check.sh          (on a machine with two GPUs,
#                                           carry [".whl"]; results under $OUT)
#
# How the ranks get patched here: the repository is not installed on that machine (it is on PYTHONPATH),
# so autopatch.pth does not run; `python -m autopatch run -m torch.distributed.run ...` puts
# autopatch/_launcher (a sitecustomize) first on PYTHONPATH, and every rank torchrun starts runs it.
# With autopatch installed (pip install), `FUSED_KERNELS=all torchrun ...` alone does the same.
#
# Runs, in this order, each time-boxed (RUN_CAP_S) and skipped when the budget is short (50 steps each):
#   ddp  bf16 autocast      plain | patched (autopatch run -m torch.distributed.run)
#   fsdp bf16 (fully_shard per layer + root; lm_head in the root unit)   plain | patched
#   tests: the two-GPU tests of tests/test_stack_gpu.py (device_map="auto", kernels on cuda:1), time-boxed
#   ddp  bf16 patched via `autopatch run -m accelerate.commands.launch --multi_gpu` (if accelerate is there)
#   fsdp bf16 patched with lm_head in a fully_shard unit of its own (the fused linear CE steps aside)
#   ddp  fp32               plain | patched (tighter tolerance)
#   fsdp fp32               plain | patched (only when asked: RUNS="... fsdp_fp32"; FSDP2's numerics
#                           without bf16 rounding, to tell kernel differences from bf16 drift)
#   fsdp_noise              control, only when asked: plain bf16 FSDP vs the same from initial weights
#                           perturbed by 1e-6 (relative). Its differences are the training's own
#                           sensitivity; compare_control_*.json is reported, not counted as pass/fail
# Output: $OUT/<run>.json (per run), $OUT/<run>.log, $OUT/compare_<run>.json, $OUT/two_gpu_summary.json,
# $OUT/stack_gpu_tests.log; a compact summary is printed last. Exit 0 when every comparison and the tests
# passed, 1 otherwise.
#
# Knobs: STEPS=50  TOTAL_BUDGET_S=470  RUN_CAP_S=150  RUNS="ddp fsdp tests accelerate fsdp_lm_head ddp_fp32"
#        (also: fsdp_fp32)
#        (a subset, any order; a second call can take the rest)  STACK_TESTS=1  TEST_BUDGET_S=120
#        STACK_TESTS_K="second_gpu or device_map" (pytest -k; STACK_TESTS_K="" runs the convergence tests too)
#        PYTHON=python3;  CPU_DRY_RUN=1: the same runs on the CPU (gloo, tiny model, kernels in Triton's
#        interpreter, no wheels) to check this script itself, e.g.
#        CPU_DRY_RUN=1 PYTHON=.venv/bin/python STEPS=2 STACK_TESTS=0 RUNS="ddp fsdp" bash dev/two_gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
START=$SECONDS
TOTAL_BUDGET_S=${TOTAL_BUDGET_S:-470}
RUN_CAP_S=${RUN_CAP_S:-150}
STEPS=${STEPS:-50}
RUNS=${RUNS:-"ddp fsdp tests accelerate fsdp_lm_head ddp_fp32"}
STACK_TESTS_K=${STACK_TESTS_K-"second_gpu or device_map"}
since() { echo $((SECONDS - START)); }
left() { echo $((TOTAL_BUDGET_S - $(since))); }

# NVLink multicast / NVLS stay off on the lent machines.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 OMP_NUM_THREADS=4
PY=${PYTHON:-python3}
EXTRA=()
if [ "${CPU_DRY_RUN:-0}" = 1 ]; then
  export TRITON_INTERPRET=1
  EXTRA=(--size tiny --device cpu)
fi
# the plain runs must see no autopatch variable
unset FUSED_KERNELS
for v in $(env | sed -n 's/^\(AUTOPATCH_[A-Za-z0-9_]*\)=.*/\1/p'); do unset "$v"; done

echo "== wheels (pydantic-settings & co.) into /tmp/site; the repository from PYTHONPATH"
if [ "${CPU_DRY_RUN:-0}" = 1 ]; then
  echo "CPU dry run: no wheels"
elif compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || echo "WARNING: wheel install failed"
else
  echo "WARNING: no .whl/ carried; autopatch needs pydantic-settings"
fi
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader 2>&1 | tee "$OUT/gpus.txt"
"$PY" -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__, 'gpus', torch.cuda.device_count())" 2>&1 | tee -a "$OUT/gpus.txt"
HAS_ACCELERATE=$("$PY" -c "import accelerate" 2>/dev/null && echo 1 || echo 0)

TORCHRUN=(-m torch.distributed.run --standalone --nproc-per-node 2)
CHECK=(dev/ddp_fsdp_check.py --steps "$STEPS" --max-seconds $((RUN_CAP_S - 60)) "${EXTRA[@]}")
declare -A RC

# launch NAME plain|patched|accelerate ARGS...: one time-boxed run writing $OUT/NAME.json
launch() {
  local name=$1 how=$2; shift 2
  if [ "$(left)" -lt $((RUN_CAP_S / 2)) ]; then
    echo "[two_gpu] $name: skipped, $(left) s left"; RC[$name]=skipped; return
  fi
  local cap=$RUN_CAP_S; [ "$(left)" -lt "$cap" ] && cap=$(left)
  local cmd
  case $how in
    plain) cmd=("$PY" "${TORCHRUN[@]}" "${CHECK[@]}" "$@" --out "$OUT/$name.json") ;;
    patched) cmd=(env FUSED_KERNELS=all "$PY" -m autopatch run "${TORCHRUN[@]}" "${CHECK[@]}" "$@" --out "$OUT/$name.json") ;;
    accelerate) cmd=(env FUSED_KERNELS=all "$PY" -m autopatch run -m accelerate.commands.launch --multi_gpu
                     --num_processes 2 --num_machines 1 --mixed_precision no --dynamo_backend no
                     --main_process_port 29517 "${CHECK[@]}" "$@" --out "$OUT/$name.json") ;;
  esac
  echo "[two_gpu] $name: ${cmd[*]}  (cap ${cap} s, at $(since) s)"
  timeout --kill-after=10 "$cap" "${cmd[@]}" >"$OUT/$name.log" 2>&1
  RC[$name]=$?
  grep -E "^\[(ddp|fsdp)\]|autopatch: (modeling|fused)|Error|error" "$OUT/$name.log" | sort -u | tail -6
  echo "[two_gpu] $name: exit ${RC[$name]} at $(since) s"
}

compare() {  # compare NAME PLAIN PATCHED
  local name=$1 plain=$2 patched=$3
  if [ -s "$OUT/$plain.json" ] && [ -s "$OUT/$patched.json" ]; then
    "$PY" dev/ddp_fsdp_check.py --compare "$OUT/$plain.json" "$OUT/$patched.json" >"$OUT/compare_$name.json" 2>"$OUT/compare_$name.err"
    echo "[two_gpu] compare $name: exit $?"
  else
    echo "{\"run\": \"$name\", \"ok\": false, \"problems\": [\"missing result: $plain=${RC[$plain]:-not run} $patched=${RC[$patched]:-not run}\"]}" >"$OUT/compare_$name.json"
  fi
}

TEST_NOTE="not run"
TEST_RC=0
stack_tests() {  # the two-GPU tests of tests/test_stack_gpu.py (convergence runs in gpu_check.sh)
  local tb=${TEST_BUDGET_S:-120}; [ "$(left)" -lt "$tb" ] && tb=$(left)
  if [ "$tb" -lt 30 ]; then TEST_NOTE="skipped: only $(left) s left"; return; fi
  echo "== gpu tests of tests/test_stack_gpu.py -k '$STACK_TESTS_K' (time box ${tb} s, at $(since) s)"
  timeout --kill-after=10 "$tb" env OUT="$OUT" "$PY" -m pytest -q -m gpu tests/test_stack_gpu.py -k "$STACK_TESTS_K" \
    -p no:cacheprovider >"$OUT/stack_gpu_tests.log" 2>&1
  TEST_RC=$?
  TEST_NOTE="exit $TEST_RC: $(grep -E '(passed|failed|error|skipped)' "$OUT/stack_gpu_tests.log" | tail -1)"
  [ "$TEST_RC" = 0 ] || grep -E "^(FAILED|ERROR)" "$OUT/stack_gpu_tests.log" | head -8
  echo "[two_gpu] tests: $TEST_NOTE"
}

for run in $RUNS; do
  case $run in
    ddp) launch plain_ddp plain --parallel ddp; launch patched_ddp patched --parallel ddp
         compare ddp plain_ddp patched_ddp ;;
    fsdp) launch plain_fsdp plain --parallel fsdp; launch patched_fsdp patched --parallel fsdp
          compare fsdp plain_fsdp patched_fsdp ;;
    accelerate) if [ "$HAS_ACCELERATE" = 1 ]; then
                  launch accelerate_ddp accelerate --parallel ddp
                  [ -s "$OUT/plain_ddp.json" ] || launch plain_ddp plain --parallel ddp
                  compare accelerate plain_ddp accelerate_ddp
                else echo "[two_gpu] accelerate: not installed, skipped"; fi ;;
    fsdp_lm_head) launch patched_fsdp_lm_head patched --parallel fsdp --shard-lm-head
                  [ -s "$OUT/plain_fsdp.json" ] || launch plain_fsdp plain --parallel fsdp
                  compare fsdp_lm_head plain_fsdp patched_fsdp_lm_head ;;
    ddp_fp32) launch plain_ddp_fp32 plain --parallel ddp --dtype fp32; launch patched_ddp_fp32 patched --parallel ddp --dtype fp32
              compare ddp_fp32 plain_ddp_fp32 patched_ddp_fp32 ;;
    fsdp_fp32) launch plain_fsdp_fp32 plain --parallel fsdp --dtype fp32; launch patched_fsdp_fp32 patched --parallel fsdp --dtype fp32
               compare fsdp_fp32 plain_fsdp_fp32 patched_fsdp_fp32 ;;
    fsdp_noise) [ -s "$OUT/plain_fsdp.json" ] || launch plain_fsdp plain --parallel fsdp
                launch plain_fsdp_perturbed plain --parallel fsdp --perturb 1e-6
                compare control_fsdp_noise plain_fsdp plain_fsdp_perturbed ;;
    tests) [ "${STACK_TESTS:-1}" = 1 ] && stack_tests ;;
    *) echo "[two_gpu] unknown run $run (valid: ddp fsdp tests accelerate fsdp_lm_head ddp_fp32 fsdp_fp32 fsdp_noise)" ;;
  esac
done

echo
echo "== summary (details: \$OUT/compare_*.json, two_gpu_summary.json)"
"$PY" - "$OUT" "$TEST_NOTE" <<'EOF'
import glob, json, os, sys
out, test_note = sys.argv[1], sys.argv[2]
rows, ok = [], True
for path in sorted(glob.glob(os.path.join(out, "compare_*.json"))):
    try:
        with open(path) as f:
            c = json.load(f)
    except Exception as exc:
        c = {"run": os.path.basename(path), "ok": False, "problems": [f"unreadable: {exc}"]}
    label = os.path.basename(path)[len("compare_"):-len(".json")]
    if not label.startswith("control_"):  # a control measures the noise floor; it passes or fails nothing
        ok &= bool(c.get("ok"))
    rows.append(c)
    c["name"] = label
    verdict = "CTRL" if label.startswith("control_") else "OK " if c.get("ok") else "BAD"
    print(f"{label:13s} {c.get('run', ''):24s} {verdict} steps {c.get('steps')} "
          f"max|dloss| {c.get('max_abs_loss_diff')} max rel {c.get('max_rel_loss_diff')} "
          f"flce/rank {c.get('flce_launches_per_rank')} loss {c.get('loss_first_last', {}).get('patched')} "
          + ("; ".join(c.get("problems", [])) or ""))
versions = next((c.get("versions") for c in rows if c.get("versions")), None)
print("versions", versions, "| tests:", test_note)
with open(os.path.join(out, "two_gpu_summary.json"), "w") as f:
    json.dump({"ok": ok, "comparisons": rows, "tests": test_note, "versions": versions}, f, indent=1)
sys.exit(0 if ok and rows else 1)
EOF
SUMMARY_RC=$?
echo "[two_gpu] total $(since) s"
[ "$SUMMARY_RC" = 0 ] && [ "$TEST_RC" = 0 ] && exit 0
exit 1
