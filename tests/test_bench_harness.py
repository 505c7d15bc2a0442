"""The GPU call's scripts, run on the CPU on tiny shapes: a harness bug should cost a CI run, not a
device call. benchmarks/bench.py's kernel part (every peer that is installed here, the host-floor
yardstick included, results checked against HF eager) and dev/tune_cross_entropy.py's smoke run
(every candidate's output checked against the table's kernel)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(args, tmp_path, timeout=600, **extra_env):
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT, **extra_env)
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_bench_kernels_tiny_runs_every_peer(tmp_path):
    out = tmp_path / "bench.json"
    proc = _run(["benchmarks/bench.py", "--device", "cpu", "--tiny", "--parts", "kernels",
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
    proc = _run(["dev/tune_cross_entropy.py", "--cpu-smoke"], tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "FAILED" not in proc.stdout, proc.stdout[-3000:]
    assert "per_sm=0.5" in proc.stdout and "LAUNCH_TABLE rows" in proc.stdout


def test_bench_modes_filter(tmp_path):
    """--modes fwdbwd: only that mode (forward + backward, the one the comparison tables use) is measured."""
    out = tmp_path / "bench.json"
    proc = _run(["benchmarks/bench.py", "--device", "cpu", "--tiny", "--parts", "kernels", "--only", "rms_norm",
                 "--peers", "ours", "--modes", "fwdbwd", "--out", str(out)], tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    cases = [k for k in json.loads(out.read_text())["kernels"] if "peers" in k]
    assert cases and all(k["modes"] == ["fwdbwd"] for k in cases)
    assert all(set(k["peers"]["ours"]["modes"]) == {"fwdbwd"} for k in cases)


def test_bench_trl_head_tiny_every_row(tmp_path):
    """benchmarks/bench_trl_head.py --tiny: every shape x output set has a row; TRL's head (installed
    here), ours and plain torch each ran with a positive time and a float64 check that is finite and
    tight (bf16 logits: ~2e-3), and is_top1 was compared on targets that are neither all nor none
    top-1. Ours has no entropy gradient: the entropy-bonus row says so instead of a time."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_trl_head", os.path.join(ROOT, "benchmarks",
                                                                                  "bench_trl_head.py"))
    bth = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bth)
    out = tmp_path / "trl_head.json"
    proc = _run(["benchmarks/bench_trl_head.py", "--tiny", "--out", str(out), "--budget-s", "300"], tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    data = json.loads(out.read_text())
    assert data["status"] == "complete" and data["trl"]["importable"], data.get("trl")
    assert {(r["case"], r["set"]) for r in data["rows"]} == {(c, s) for c in bth.TINY_SHAPES for s in bth.OUTPUT_SETS}
    for row in data["rows"]:
        assert set(row["peers"]) == {"trl", "ours", "torch"}, row["peers"].keys()
        for peer, res in row["peers"].items():
            if peer == "ours" and "entropy" in row["grad_outputs"]:
                assert res["status"] == "unsupported", res
                continue
            assert res["status"] == "ok", (row["case"], row["set"], peer, res)
            assert math.isfinite(res["ms"]) and res["ms"] > 0, res
            check = res["check"]
            expected = {"log_probs", "grad_hidden", "grad_weight"} | (
                {"entropy"} if peer != "ours" or "entropy" in data["ours_stats"] else set())
            assert expected <= set(check["rel_err"]), (peer, check["rel_err"])
            assert all(math.isfinite(e) and 0 < e < 2e-2 for e in check["rel_err"].values()), (peer, check)
            assert check["max_rel_err"] == max(check["rel_err"].values())
            if "is_top1" in res["outputs_computed"]:
                assert 0 < check["is_top1_true"] < check["tokens"]
                assert check["is_top1_mismatch"] <= 1, (peer, check)
            assert set(res["outputs_computed"]) | set(res["missing"]) == set(row["outputs"])
        if row["peers"]["ours"]["status"] == "ok":
            assert row["trl_ms_over_ours_ms"] > 0 and row["torch_ms_over_ours_ms"] > 0
    assert data["timer"].startswith("perf_counter")
    assert [(x["case"], x["set"]) for x in data["summary"]] == [(r["case"], r["set"]) for r in data["rows"]]
    for line in data["summary"]:
        assert all(math.isfinite(line[f"{p}_ms"]) and line[f"{p}_ms"] > 0 for p in ("trl", "torch")), line


def test_step_diagnosis_parts_on_the_cpu():
    """dev/step_diagnosis.py: its cycle probe finds nothing left by a step of a tiny patched Llama (and
    would see a leaked graph)."""
    import torch

    sys.path.insert(0, os.path.join(ROOT, "dev"))
    import step_diagnosis as sd
    from transformers import AutoConfig, AutoModelForCausalLM

    import autopatch
    from autopatch import patching

    cfg = AutoConfig.for_model("llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                               max_position_embeddings=64)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).train()
    ids = torch.randint(0, 256, (2, 16))
    try:
        autopatch.apply(model, rope=True, rms_norm=True, swiglu=True, fused_linear_cross_entropy=True)

        def step():
            model(input_ids=ids, labels=ids).loss.backward()
            model.zero_grad(set_to_none=True)

        assert sd._graph_tensors_after_a_step(step, torch) == 0
        kept = []
        assert sd._graph_tensors_after_a_step(lambda: kept.append(model(input_ids=ids, labels=ids).loss), torch) > 0
    finally:
        patching.restore_all()


def test_host_overhead_cpu_stub(tmp_path):
    """dev/host_overhead.py --cpu-stub: our ops' Python around their (stubbed) launches, against the
    empty autograd node, for every op it covers."""
    proc = _run(["dev/host_overhead.py", "--cpu-stub"], tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    for op in ("rms_norm", "rope", "cross_entropy"):
        for peer in ("ours", "host_floor"):
            assert any(line.startswith(op) and f" {peer} " in line and "fwd+bwd" in line
                       for line in proc.stdout.splitlines()), (op, peer, proc.stdout[-1500:])


def test_plot_draws_the_time_asked_for():
    # benchmarks/plot.py draws GPU time by default (the README's comparison); a peer with no time of that
    # kind is left out, never drawn with the other kind
    import importlib.util

    spec = importlib.util.spec_from_file_location("plot", os.path.join(ROOT, "benchmarks", "plot.py"))
    plot = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plot)
    entry = {"peers": {
        "ours": {"status": "ok", "modes": {"fwdbwd": {"ms": 0.70, "gpu_ms": 0.21}}},
        "liger": {"status": "ok", "modes": {"fwdbwd": {"ms": 1.14}}},
        "cutce": {"status": "failed", "modes": {"fwdbwd": {"ms": 9.0, "gpu_ms": 8.0}}},
    }}
    assert plot._ok_ms(entry, "ours") == 0.21
    assert plot._ok_ms(entry, "ours", "wall") == 0.70
    assert plot._ok_ms(entry, "liger") is None and plot._ok_ms(entry, "liger", "wall") == 1.14
    assert plot._ok_ms(entry, "cutce") is None and plot._ok_ms(entry, "missing") is None


def test_bench_moe_tiny_checks_every_peer_against_eager(tmp_path):
    """benchmarks/bench_moe.py on a tiny shape: transformers' grouped_mm experts and ours (Liger where
    installed) run forward and backward and agree with transformers' eager experts in float32."""
    out = tmp_path / "moe.json"
    proc = _run(["benchmarks/bench_moe.py", "--tiny", "--out", str(out)], tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (row,) = json.loads(out.read_text())["rows"]
    assert all(n > 0 for n in row["ref_norms"].values()), row["ref_norms"]  # never compared on zeros
    for peer in ("hf_grouped_mm", "ours"):
        res = row["peers"][peer]
        assert res["status"] == "ok" and res["finite"], (peer, res)
        # transformers' grouped_mm on the CPU can run eager's very matmuls: 0 is then its exact answer
        assert 0 <= res["rel_err_out"] < 1e-5, (peer, res)
        assert all(0 <= e < 1e-5 for e in res["rel_err_grads"].values()), (peer, res)
    assert row["peers"]["ours"]["rel_err_out"] > 0  # our kernels' own sums, not a copy of eager's


def test_bench_e2e_image_text_worker_on_the_cpu(tmp_path):
    """benchmarks/bench_e2e.py's image-text path on its tiny Qwen2.5-VL: HF eager and ours train a step on
    batches with an image per sequence (placeholder tokens, grid pixels), the same first loss, and ours
    runs the fused loss on the multimodal head, whether applied (ours) or from FUSED_KERNELS=all in the
    environment alone (ours_env: the worker calls nothing of ours but reads the records)."""
    results = {}
    for peer in ("hf_eager", "ours", "ours_env"):
        out = tmp_path / f"{peer}.json"
        extra = {"FUSED_KERNELS": "all"} if peer == "ours_env" else {}
        proc = _run(["benchmarks/bench_e2e.py", "--worker", "--model", "tiny_qwen2_5_vl", "--peer", peer,
                     "--device", "cpu", "--steps", "1", "--warmup", "1", "--result", str(out)], tmp_path, **extra)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        results[peer] = json.loads(out.read_text())
        assert results[peer]["status"] == "ok" and results[peer]["finite"], results[peer]
    ref = results["hf_eager"]["loss_first"]
    assert ref > 0
    for peer in ("ours", "ours_env"):
        assert abs(results[peer]["loss_first"] - ref) / ref < 1e-2, (peer, results[peer]["loss_first"], ref)
        assert "fused_linear_cross_entropy:Qwen2_5_VLForConditionalGeneration.forward" in results[peer]["patched"]
    # every kernel from the environment: the vision tower's norms and the text MLP too
    kernels = {p.split(":")[0] for p in results["ours_env"]["patched"]}
    assert {"rms_norm", "swiglu", "fused_linear_cross_entropy"} <= kernels, kernels


@pytest.mark.slow
def test_bench_trl_dry_run_on_the_cpu(tmp_path):
    """benchmarks/bench_trl.py on its tiny Llama, SFT, DPO and GRPO: plain TRL and TRL with
    FUSED_KERNELS=all (each in a fresh process, nothing of ours imported by the worker) log the same losses
    and gradient norms, our layer kernels ran inside TRL's trainers, and GRPO's generation is timed apart."""
    pytest.importorskip("trl", reason="TRL is a test dependency (pip install -e .[test])")
    pytest.importorskip("datasets", reason="TRL's trainers take datasets.Dataset")
    out = tmp_path / "trl.json"
    proc = _run(["benchmarks/bench_trl.py", "--device", "cpu", "--trainers", "sft,dpo,grpo", "--models", "tiny_llama",
                 "--peers", "trl,trl_ours", "--steps", "1", "--warmup", "1", "--profile-steps", "1", "--out", str(out)],
                tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    runs = {(r["trainer"], r["peer"]): r for r in json.loads(out.read_text())["runs"]}

    def close(a, b, rel):
        return abs(a - b) <= rel * abs(b)

    for kind in ("sft", "dpo", "grpo"):
        plain, ours = runs[(kind, "trl")], runs[(kind, "trl_ours")]
        assert plain["status"] == "ok" and ours["status"] == "ok", (plain, ours)
        # warm-up, timed and profiled steps each log; only the timed one is in step_ms
        assert len(plain["losses"]) == 3 and len(plain["grad_norms"]) == 3
        assert len(plain["step_ms"]) == 1 and plain["profile"]["profiled_step_ms"] > 0, plain.get("profile")
        assert len(plain["gc_ms"]) == len(plain["gc_full_collections"]) == 1
        assert 0 <= plain["gc_ms"][0] < plain["step_ms"][0], (plain["gc_ms"], plain["step_ms"])
        # GRPO's gradient is 0 on a step whose completions all earn the same reward; never on every step
        assert all(math.isfinite(g) for g in plain["grad_norms"]) and max(plain["grad_norms"]) > 0, plain["grad_norms"]
        # bf16 weights, as the benchmark trains
        for got, want in ((ours["losses"], plain["losses"]), (ours["grad_norms"], plain["grad_norms"])):
            for a, b in zip(got, want, strict=True):
                assert abs(a - b) <= 1e-2 * abs(b) + 1e-6, (kind, got, want)
        for kernel in ("rms_norm:LlamaRMSNorm", "rope:apply_rotary_pos_emb", "swiglu:LlamaMLP"):
            assert ours["runs"].get(kernel, 0) > 0, (kind, ours["runs"])
    assert all(v > 0 for v in runs[("sft", "trl")]["losses"])
    assert close(runs[("sft", "trl_ours")]["losses"][0], runs[("sft", "trl")]["losses"][0], 1e-4)
    assert abs(runs[("dpo", "trl")]["losses"][0] - math.log(2)) < 1e-3  # the policy starts as its reference
    grpo = runs[("grpo", "trl_ours")]
    assert len(grpo["profile"]["generation_ms"]) == 1
    assert len(grpo["generation_ms"]) == 1 and all(0 < t < s for t, s in zip(grpo["train_ms"], grpo["step_ms"]))


def test_kernel_kinds_of_the_step_diagnoses():
    """bench_common.kernel_kind sorts the kernel names a training step's profile shows: Liger's norm
    kernels are fused, not TRL's head, though their names end like TRL's two kernels."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import bench_common

    expected = {
        "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTN": "gemm", "sm90_xmma_gemm_bf16bf16_bf16f32": "gemm",
        "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT": "gemm",
        "pytorch_flash::flash_fwd_kernel": "attention",
        "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma": "attention",
        "_rms_norm_forward_kernel": "fused", "_rms_norm_bwd_kernel": "fused", "_rope_kernel": "fused",
        "_glu_fwd_kernel": "fused", "_glu_bwd_kernel": "fused", "_ce_kernel": "fused",
        "_swiglu_backward_kernel": "fused", "liger_cross_entropy_kernel": "fused",
        "_forward_kernel": "trl_head", "_backward_kernel": "trl_head",
        "multi_tensor_apply_kernel": "optimizer",
        "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<...adam...>": "optimizer",
        "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add>": "other"}
    kinds = {name: bench_common.kernel_kind(name) for name in expected}
    assert kinds == expected, kinds
