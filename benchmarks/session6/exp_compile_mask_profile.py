"""Kernel time by kind of one compiled, autopatched Qwen3-0.6B step with the causal-mask skip of
exp_compile_mask.py (GPU): is the compiled step's attention back to its eager time (34.2 ms) once SDPA
runs with is_causal=True, or does something else keep it slow?

    PYTHONPATH=$PWD:scripts python3 benchmarks/session6/exp_compile_mask_profile.py
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import exp_compile_mask  # noqa: E402
import step_diagnosis  # noqa: E402

if __name__ == "__main__":
    _spec, model, opt, ids = exp_compile_mask.compiled_qwen3(fixed=True)
    for _ in range(2):
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    res = step_diagnosis._profile_steps(model, opt, ids, torch, steps=1)
    print(f"step {res['step_ms']:.1f} ms; kernel ms by kind: "
          + ", ".join(f"{k} {v:.1f}" for k, v in res["kernel_ms"].items()), flush=True)
    for name, ms, n in res["top_kernels_ms"][:10]:
        print(f"  {ms:8.2f} ms  x{n:<4g} {name}", flush=True)
