"""The GPU call's scripts, run on the CPU on tiny shapes: a harness bug should cost a CI run, not a
device call. scripts/bench.py's kernel part (every peer that is installed here, the host-floor
yardstick included, results checked against HF eager) and scripts/tune_cross_entropy.py's smoke run
(every candidate's output checked against the table's kernel)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(args, tmp_path, timeout=600):
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_bench_kernels_tiny_runs_every_peer(tmp_path):
    out = tmp_path / "bench.json"
    proc = _run(["scripts/bench.py", "--device", "cpu", "--tiny", "--parts", "kernels",
                 "--only", "rms_norm,rope,cross_entropy", "--out", str(out)], tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    data = json.loads(out.read_text())
    cases = [k for k in data["kernels"] if "peers" in k]
    assert {k["op"] for k in cases} == {"rms_norm", "rope", "cross_entropy"}
    for case in cases:
        for peer in ("ours", "host_floor"):
            res = case["peers"][peer]
            assert res["status"] == "ok", (case["case"], peer, res)
            assert res["modes"]["fwdbwd"]["ms"] > 0, (case["case"], peer)
        # ours is checked against HF eager in the same run; the yardstick is left out of the ratios
        errs = case["peers"]["ours"]["rel_err_vs_hf_eager"]
        assert errs and all(e <= 1e-2 for e in errs.values()), (case["case"], errs)
        assert case.get("best", {}).get("fwdbwd", {}).get("peer") != "host_floor"


def test_tune_cross_entropy_smoke(tmp_path):
    proc = _run(["scripts/tune_cross_entropy.py", "--cpu-smoke"], tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "FAILED" not in proc.stdout, proc.stdout[-3000:]
    assert "per_sm=0.5" in proc.stdout and "LAUNCH_TABLE rows" in proc.stdout
