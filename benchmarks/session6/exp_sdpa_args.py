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
    """Prints every aten attention op that runs under it, once per distinct call signature."""

    def __init__(self):
        super().__init__()
        self.seen = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if "attention" in str(func):
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
    a = ap.parse_args()
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = bench_e2e.MODELS["qwen3_0.6b"]
    cfg = dict(spec["config"], num_hidden_layers=2)
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
    print("eager:", flush=True)
    with _LogAttention():
        model(input_ids=ids, labels=ids).loss.backward()
    compiled = torch.compile(model, backend=a.backend)
    compiled(input_ids=ids, labels=ids).loss.backward()  # compile outside the logging mode
    print(f"compiled ({a.backend}):", flush=True)
    with _LogAttention():
        compiled(input_ids=ids, labels=ids).loss.backward()
    return 0


if __name__ == "__main__":
    sys.exit(main())
