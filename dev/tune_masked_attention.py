"""Query block size of the masked_attention rule (GPU only): forward + backward of transformers'
sdpa_attention_forward under a boolean mask, one call against one call per query block, bf16.

    python dev/tune_masked_attention.py [--blocks 256,512,1024] [--out t.json]

Masks (Gemma-3-4B's text attention at the benchmark's 4 x 4096 tokens: 8 query heads, 4 key heads,
head_dim 256): a causal sliding window of 1024 (its local layers) and causal with a 256-token
bidirectional image block (its global layers); and a Llama-3.2-3B-shaped causal mask with right padding
(24 / 8 heads of 128, a padded DPO batch) and the same shape with four packed documents a row (what
transformers builds from restarting position_ids, no cache). Reports do_bench medians (ms) and the peak memory of the
call beyond its inputs (MiB).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _mask(kind: str, batch: int, n: int) -> torch.Tensor:
    i = torch.arange(n, device="cuda")
    causal = i[:, None] >= i[None, :]
    if kind == "sliding 1024":
        return (causal & (i[:, None] - i[None, :] < 1024)).expand(batch, 1, n, n)
    if kind == "packed":  # documents of 1024, 1536, 512 and 1024 tokens a row, each attending to itself
        doc = torch.repeat_interleave(torch.arange(4, device="cuda"),
                                      torch.tensor([1024, 1536, 512, 1024], device="cuda"))
        return (causal & (doc[:, None] == doc[None, :])).expand(batch, 1, n, n)
    mask = causal.expand(batch, 1, n, n).clone()
    if kind == "causal + image":
        mask[:, :, 16:272, 16:272] = True
    else:  # causal, padded: each row of the batch shorter by 600 tokens more
        for b in range(batch):
            end = n - 600 * b
            mask[b, :, :, end:] = False
            mask[b, :, end:, end - 1] = True
    return mask


def main() -> int:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from autopatch.rules import masked_attention as rule

    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", default="256,512,1024")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    cases = [("sliding 1024", 4, 4096, 8, 4, 256), ("causal + image", 4, 4096, 8, 4, 256),
             ("causal, padded", 4, 4096, 24, 8, 128), ("packed", 4, 4096, 24, 8, 128)]
    rows = []
    for kind, batch, n, heads, kv_heads, dim in cases:
        g = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(batch, heads, n, dim, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
        k, v = (torch.randn(batch, kv_heads, n, dim, device="cuda", dtype=torch.bfloat16, generator=g)
                .requires_grad_() for _ in range(2))
        mask = _mask(kind, batch, n)
        grad = torch.randn(batch, n, heads, dim, device="cuda", dtype=torch.bfloat16, generator=g)
        module = torch.nn.Module()
        module.num_key_value_groups, module.is_causal = heads // kv_heads, True
        fns = {"one call": sdpa_attention_forward}
        for block in map(int, a.blocks.split(",")):
            fns[f"blocks of {block}"] = rule.masked_attention(sdpa_attention_forward, False, False, block=block)
        for name, fn in fns.items():
            def step():
                out, _ = fn(module, q, k, v, mask, dropout=0.0, scaling=dim ** -0.5)
                torch.autograd.grad(out, (q, k, v), grad)

            step()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            step()
            peak = (torch.cuda.max_memory_allocated() - base) / 2**20
            ms = do_bench(step, warmup=5, rep=40)
            row = {"mask": kind, "shape": [batch, heads, kv_heads, n, dim], "path": name, "fwd_bwd_ms": ms,
                   "peak_mib": peak}
            rows.append(row)
            print(f"{kind:16s} {name:16s} {ms:8.2f} ms  {peak:8.0f} MiB", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
