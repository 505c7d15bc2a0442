"""Kernel time by kind of one compiled, autopatched Qwen3-0.6B step with the causal-mask skip of
exp_compile_mask.py (GPU): is the compiled step's attention back to its eager time (34.2 ms) once SDPA
runs with is_causal=True, or does something else keep it slow?

    PYTHONPATH=$PWD:scripts python3 benchmarks/session6/exp_compile_mask_profile.py
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_e2e  # noqa: E402
import exp_compile_mask  # noqa: E402
import step_diagnosis  # noqa: E402
from transformers import masking_utils  # noqa: E402

if __name__ == "__main__":
    import autopatch

    masking_utils._ignore_causal_mask_sdpa = exp_compile_mask._skip_when_unpadded
    spec = bench_e2e.MODELS["qwen3_0.6b"]
    torch.manual_seed(0)
    model = bench_e2e._build_model(spec, torch.device("cuda"), torch)
    autopatch.apply(model, **bench_e2e.OUR_TOGGLES)
    model = torch.compile(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    ids = torch.randint(0, spec["config"]["vocab_size"], (spec["batch"], spec["seq"]), device="cuda")
    for _ in range(2):
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    res = step_diagnosis._profile_steps(model, opt, ids, torch, steps=1)
    print(f"step {res['step_ms']:.1f} ms; kernel ms by kind: "
          + ", ".join(f"{k} {v:.1f}" for k, v in res["kernel_ms"].items()), flush=True)
    for name, ms, n in res["top_kernels_ms"][:10]:
        print(f"  {ms:8.2f} ms  x{n:<4g} {name}", flush=True)
