#!/usr/bin/env bash
# Prepared for the next session's first device call (~250 s; carry [".whl"]): the cluster exchange in two
# slots per cluster instead of one per row (ring_exchange.patch: 0.8 MiB of scratch at 8192 x 128256 ->
# ~30 KB, the "0 extra" of the CE target), applied on the device's copy only. Then the shared-memory gpu
# tests (their new assertion: <= 64 KiB of scratch) and the part-3 sweep, to compare with
# exp_ce_register_rows_part3.txt (128256: 1.115 ms, 262144: 2.321 ms for the table's shapes).
# If both pass and the times hold: `git apply benchmarks/session13/ring_exchange.patch` here and commit.
set -uo pipefail
cd "$(dirname "$0")/../.."
git apply benchmarks/session13/ring_exchange.patch || { echo "the patch does not apply"; exit 1; }
TEST_K=smem TEST_S=260 EXP_ARGS=--part3 bash benchmarks/session13/call_register_rows.sh
