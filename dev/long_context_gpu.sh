#!/usr/bin/env bash
# On a GPU machine: the long-context measurements still open, each part one device command (<= 10 min),
# JSON per part under $OUT (written after every trial, so a time box keeps what was measured).
#
#   PART=liger3b   bash dev/long_context_gpu.sh   Liger's 3B bound: 262144, then bisection      (~4 min)
#   PART=cost64k   bash dev/long_context_gpu.sh   the offload's cost at 64K: 3B full depth, ours_tiled and
#                                                 ours_offload_tiled, twice each (target <= 1.15x) (~5 min)
#   PART=common    bash dev/long_context_gpu.sh   tokens/s at 32K (every peer fits), full depth, 3B   (~6 min)
#   PART=cross     bash dev/long_context_gpu.sh   3B ours_offload_tiled at 131072, full depth and cut (~6 min)
#   PART=8b        bash dev/long_context_gpu.sh   the offload GPU tests, then 8B LoRA ours_offload_tiled at 500000, and 458752 if that
#                                                 fails (500000 measured 57.1 GiB on the cut without the
#                                                 offload's early release, est. 80.0; with it back, ~72.4)
#                                                 The offload GPU tests include the no-room test of the
#                                                 release and room check                                  (~7 min)
#   PART=qblocks   bash dev/long_context_gpu.sh   the query-block attention: its GPU test, then 8B LoRA
#                                                 ours_offload_tiled_qblocks at 524288                  (~6 min)
#
# cost64k's two runs are read side by side (a merge keeps one trial per model, peer and length).
# Then, here: python benchmarks/bench_long_context.py --merge <the committed JSON> $OUT/*.json \
#   --out <the committed JSON> --plot <its .png>
# Run from the repository root with the wheels of dev/device_wheels.sh in .whl/ (HUB_STACK=1 for
# transformers 5.25).
set -uo pipefail
cd "$(dirname "$0")/.."
source dev/device_env.sh >/dev/null 2>&1
OUT=${OUT:-/tmp/long_context_out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name --format=csv,noheader
free -g | head -2
# On an H200 the trials play an H100 80GB (its 79.18 GiB: the allocator capped, fits judged against it)
# unless CAPACITY_GIB says otherwise: the targets are an H100's.
if [ -z "${CAPACITY_GIB:-}" ] && nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  CAPACITY_GIB=79.1787109375
fi
# (an array, not a function: timeout(1) runs programs)
bench=(python3 benchmarks/bench_long_context.py --offload true --tiled-mlp-tokens 8192
       ${CAPACITY_GIB:+--capacity-gib "$CAPACITY_GIB"})
case "${PART:?set PART: liger3b, cost64k, common, cross, 8b or qblocks}" in
  liger3b) timeout 560 "${bench[@]}" --layers 3 --models llama3.2_3b_full --peers liger --start 262144 --max-seq 262144 \
             --granularity 16384 --trial-timeout-s 200 --out "$OUT/3b-liger.json" ;;
  cost64k) for run in 1 2; do
             timeout 270 "${bench[@]}" --models llama3.2_3b_full --peers ours_tiled,ours_offload_tiled --start 65536 \
               --max-seq 65536 --trial-timeout-s 130 --out "$OUT/3b-64k-full-depth-run$run.json"
           done ;;
  common)  timeout 560 "${bench[@]}" --models llama3.2_3b_full --peers hf,liger,ours,ours_offload_tiled --start 32768 \
             --max-seq 32768 --trial-timeout-s 130 --out "$OUT/3b-32k-full-depth.json" ;;
  cross)   timeout 560 "${bench[@]}" --layers 3 --models llama3.2_3b_full --peers ours_offload_tiled --cross-check 131072 \
             --trial-timeout-s 400 --out "$OUT/3b-cross-check-131072.json" ;;
  8b)      timeout 90 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_offload.py \
             || { echo "offload GPU tests failed: no trial"; exit 1; }
           timeout 280 "${bench[@]}" --layers 3 --models llama3.1_8b_lora --peers ours_offload_tiled --start 500000 \
             --max-seq 500000 --trial-timeout-s 270 --out "$OUT/8b-ours-500000.json"
           if ! grep -q '"longest": 500000' "$OUT/8b-ours-500000.json" 2>/dev/null; then
             timeout 230 "${bench[@]}" --layers 3 --models llama3.1_8b_lora --peers ours_offload_tiled --start 458752 \
               --max-seq 458752 --trial-timeout-s 220 --out "$OUT/8b-ours-458752.json"
           fi ;;
  qblocks) timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_attention_query_blocks.py
           timeout 420 "${bench[@]}" --layers 3 --models llama3.1_8b_lora --peers ours_offload_tiled_qblocks --start 524288 \
             --max-seq 524288 --trial-timeout-s 400 --out "$OUT/8b-qblocks-524288.json" ;;
  *) echo "unknown PART=$PART"; exit 2 ;;
esac
