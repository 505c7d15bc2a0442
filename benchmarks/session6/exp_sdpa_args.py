"""The attention ops a Qwen3 step calls, eager and compiled, with their arguments (shapes, strides,
is_causal, mask, scale): the next step on why compiled attention takes 2.7x its eager time on the H200
(README.md §4). Runs on a GPU (the real head shapes, 2 layers, bf16) or, with --cpu, on a small fp32
model (there, with transformers 5.24 / torch 2.13, eager and inductor call the same op with the same
arguments).

    PYTHONPATH=$PWD:scripts python3 benchmarks/session6/exp_sdpa_args.py [--cpu] [--backend inductor]
"""

import argparse
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import bench_e2e


class _LogAttention(TorchDispatchMode):
    """Prints every aten attention op that runs under it, once per distinct call signature, and counts
    the calls (a forward recomputed in the backward would show as more forward calls than layers)."""

    def __init__(self, off: bool = False):
        super().__init__()
        self.seen = set()
        self.calls = {}
        self.off = off

    def __enter__(self):
        return self if self.off else super().__enter__()

    def __exit__(self, *exc):
        return None if self.off else super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if "attention" in str(func):
            self.calls[str(func)] = self.calls.get(str(func), 0) + 1
            def describe(a):
                if isinstance(a, torch.Tensor):
                    return f"{tuple(a.shape)}{a.stride()}{str(a.dtype)[6:]}"
                return repr(a)
            line = (f"  {func}: " + ", ".join(describe(a) for a in args)
                    + "".join(f", {k}={describe(v)}" for k, v in kwargs.items()))
            if line not in self.seen:
                self.seen.add(line)
                print(line, flush=True)
        return func(*args, **kwargs)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--backend", default="inductor")
    ap.add_argument("--layers", type=int, default=2, help="decoder layers (28: the benchmarked model)")
    ap.add_argument("--no-log", action="store_true", help="skip the dispatch-mode log (only the profiler counts)")
    a = ap.parse_args()
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = bench_e2e.MODELS["qwen3_0.6b"]
    cfg = dict(spec["config"], num_hidden_layers=a.layers)
    batch, seq, dtype, device = spec["batch"], spec["seq"], torch.bfloat16, "cuda"
    if a.cpu:
        cfg.update(vocab_size=512, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=64)
        batch, seq, dtype, device = 2, 64, torch.float32, "cpu"
    config = AutoConfig.for_model(spec["model_type"], **cfg)
    config.use_cache = False
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").to(device, dtype).train()
    ids = torch.randint(0, cfg["vocab_size"], (batch, seq), device=device)
    print(f"eager ({cfg['num_hidden_layers']} layers):", flush=True)
    with _LogAttention(a.no_log) as log:
        model(input_ids=ids, labels=ids).loss.backward()
    print("  calls:", log.calls, flush=True)
    compiled = torch.compile(model, backend=a.backend)
    compiled(input_ids=ids, labels=ids).loss.backward()  # compile outside the logging mode
    print(f"compiled ({a.backend}):", flush=True)
    with _LogAttention(a.no_log) as log:
        compiled(input_ids=ids, labels=ids).loss.backward()
    print("  calls:", log.calls, flush=True)
    # The same count without a dispatch mode (which could change what dynamo runs): the profiler's
    # attention kernels per step, eager and compiled.
    from torch.profiler import ProfilerActivity, profile
    for label, m in (("eager", model), ("compiled", compiled)):
        m(input_ids=ids, labels=ids).loss.backward()
        torch.cuda.synchronize() if device == "cuda" else None
        with profile(activities=[ProfilerActivity.CUDA] if device == "cuda" else [ProfilerActivity.CPU]) as prof:
            m(input_ids=ids, labels=ids).loss.backward()
            torch.cuda.synchronize() if device == "cuda" else None
        rows = [(e.key, e.count, e.device_time_total / 1e3) for e in prof.key_averages()
                if any(w in e.key.lower() for w in ("attention", "cudnn", "fmha", "flash", "sdpa"))]
        print(f"profiler, {label}: " + "; ".join(f"{k[:90]} x{c} {ms:.2f} ms" for k, c, ms in rows), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
