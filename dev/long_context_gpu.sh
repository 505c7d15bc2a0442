#!/usr/bin/env bash
# On a GPU machine: the long-context measurements of docs/kernels/long_context.md, each part one device
# command (<= 10 min), JSON per part under $OUT (written after every trial, so a time box keeps what was
# measured).
#
# Every trial keeps AdamW's moments resident through the measured step (the bench's optimizer is made
# once per model; trials before that had a fresh one per step, and a merge voids them where a peer has
# newer ones: the 8B rows are still of that kind, the adapters' moments 0.3 GiB).
#
#   PART=3b        bash dev/long_context_gpu.sh   the 3B rows of HF and Liger by bisection         (~8 min)
#   PART=3b_ours   bash dev/long_context_gpu.sh   the 3B row of ours at 589824                     (~3 min)
#   PART=cost64k   bash dev/long_context_gpu.sh   the offload's cost at 64K: 3B full depth, ours_tiled and
#                                                 ours_offload_tiled, twice each, each timing its second
#                                                 step at 64K (target <= 1.15x), and =auto once a run (~9 min)
#   PART=common    bash dev/long_context_gpu.sh   tokens/s at 32K (every peer fits), full depth, 3B,
#                                                 the second step at 32K timed                   (~8 min)
#   PART=cross     bash dev/long_context_gpu.sh   3B ours_offload_tiled at 131072, full depth and cut (~6 min)
#   PART=8b        bash dev/long_context_gpu.sh   the offload GPU tests (the no-room peak test apart: it does not
#                                                 stop the trial), then 8B LoRA ours_offload_tiled at 500000,
#                                                 and 458752 if that fails (500000: 72.5 GiB estimated with
#                                                 a fresh optimizer per step; LoRA's moments add 0.3)   (~7 min)
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
case "${PART:?set PART: 3b, 3b_ours, cost64k, common, cross, 8b or qblocks}" in
  cost64k) for run in 1 2; do
             timeout 190 "${bench[@]}" --models llama3.2_3b_full --peers ours_tiled,ours_offload_tiled --start 65536 \
               --max-seq 65536 --steps-at-length 2 --trial-timeout-s 90 --out "$OUT/3b-64k-full-depth-run$run.json"
             # what AUTOPATCH_OFFLOAD=auto does there (it keeps on the GPU what fits)
             timeout 95 "${bench[@]}" --offload auto --models llama3.2_3b_full --peers ours_offload_tiled --start 65536 \
               --max-seq 65536 --steps-at-length 2 --trial-timeout-s 90 --out "$OUT/3b-64k-full-depth-auto-run$run.json"
           done ;;
  common)  timeout 570 "${bench[@]}" --models llama3.2_3b_full --peers hf,liger,ours,ours_offload_tiled --start 32768 \
             --max-seq 32768 --steps-at-length 2 --trial-timeout-s 140 --out "$OUT/3b-32k-full-depth.json" ;;
  3b)      timeout 150 "${bench[@]}" --layers 3 --models llama3.2_3b_full --peers hf --start 32768 --max-seq 65536 \
             --granularity 16384 --trial-timeout-s 60 --out "$OUT/3b-hf.json"
           timeout 420 "${bench[@]}" --layers 3 --models llama3.2_3b_full --peers liger --start 196608 --max-seq 393216 \
             --granularity 16384 --trial-timeout-s 80 --out "$OUT/3b-liger-bound.json" ;;
  3b_ours) timeout 400 "${bench[@]}" --layers 3 --models llama3.2_3b_full --peers ours_offload_tiled --start 589824 \
             --max-seq 589824 --trial-timeout-s 390 --out "$OUT/3b-ours-589824.json" ;;
  cross)   timeout 560 "${bench[@]}" --layers 3 --models llama3.2_3b_full --peers ours_offload_tiled --cross-check 131072 \
             --trial-timeout-s 400 --out "$OUT/3b-cross-check-131072.json" ;;
  8b)      timeout 90 python3 -m pytest -q -p no:cacheprovider -m gpu -k "not no_room" tests/test_offload.py \
             || { echo "offload GPU tests failed: no trial"; exit 1; }
           timeout 60 python3 -m pytest -q -p no:cacheprovider -m gpu -k no_room tests/test_offload.py
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
