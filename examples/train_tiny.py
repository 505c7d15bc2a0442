"""Train a tiny Llama for a few AdamW steps on synthetic data it can learn; print the losses and what
autopatch patched. Nothing is downloaded and nothing here imports autopatch:

    FUSED_KERNELS=all python -m autopatch run examples/train_tiny.py     # every kernel on
    FUSED_KERNELS=all python examples/train_tiny.py                      # the same, via autopatch.pth
    python examples/train_tiny.py                                        # plain transformers

The data: every sequence follows one fixed random permutation of the first 64 token ids (token t is
followed by perm[t]), started at a random token, so the next token is fully predictable and the loss
falls within a few steps. On a GPU the model trains in bfloat16; on the CPU in float32, with the kernels
running in Triton's interpreter when TRITON_INTERPRET=1 (else patched components fall back to the
original code, with one notice).
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=10, help="optimizer steps (default 10)")
    p.add_argument("--batch", type=int, default=4, help="sequences per step (default 4)")
    p.add_argument("--seq", type=int, default=32, help="tokens per sequence (default 32)")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (default 3e-3)")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                   help="parameter dtype (default: bfloat16 on cuda, float32 on cpu)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def tiny_llama_config() -> LlamaConfig:
    return LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )


def make_batch(perm: torch.Tensor, batch: int, seq: int, generator: torch.Generator) -> torch.Tensor:
    """[batch, seq] token ids; each row follows t -> perm[t] from a random start token."""
    rows = torch.empty(batch, seq, dtype=torch.long)
    rows[:, 0] = torch.randint(0, perm.numel(), (batch,), generator=generator)
    for t in range(1, seq):
        rows[:, t] = perm[rows[:, t - 1]]
    return rows


def summarise_autopatch() -> None:
    autopatch = sys.modules.get("autopatch")
    if autopatch is None:
        return
    patched: dict[str, list[str]] = {}
    for record in autopatch.applied():
        if record.patched:
            targets = patched.setdefault(record.kernel, [])
            target = record.target.removesuffix(".forward")
            if target not in targets:
                targets.append(target)
    if patched:
        print("autopatch patched: " + "; ".join(f"{k} ({', '.join(v)})" for k, v in patched.items()))
    else:
        print("autopatch patched nothing (try FUSED_KERNELS=all, or python -m autopatch run ...)")
    fused = sys.modules.get("fused_kernels")
    if fused is not None:
        counts = fused.launch_counts()
        print("fused_kernels launches: " + (", ".join(f"{k}={v}" for k, v in sorted(counts.items())) or "none"))


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    torch.manual_seed(args.seed)
    generator = torch.Generator().manual_seed(args.seed)

    config = tiny_llama_config()
    model = LlamaForCausalLM(config).to(device=device, dtype=dtype)
    model.train()
    perm = torch.randperm(64, generator=generator)  # the ids the data uses: a quick, learnable rule
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"tiny llama: {config.num_hidden_layers} layers, hidden {config.hidden_size}, vocab {config.vocab_size}, "
          f"{n_params / 1e6:.2f}M parameters; {device.type}, {str(dtype).removeprefix('torch.')}; "
          f"{args.steps} steps of {args.batch}x{args.seq} tokens")

    losses = []
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        ids = make_batch(perm, args.batch, args.seq, generator).to(device)
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(out.loss.item())
        print(f"step {step:3d}  loss {losses[-1]:.4f}", flush=True)
    elapsed = time.perf_counter() - start

    print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} in {elapsed:.1f} s")
    summarise_autopatch()
    if not all(math.isfinite(x) for x in losses):
        print("error: a loss is not finite", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
