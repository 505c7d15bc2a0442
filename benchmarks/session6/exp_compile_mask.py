"""Why Qwen3 under torch.compile trains slower than eager, with or without our kernels (a diagnosis).

    PYTHONPATH=$PWD:scripts python3 benchmarks/session6/exp_compile_mask.py      (GPU)

step_diagnosis (session 6) showed cuDNN SDPA taking 93.8 ms per step compiled against 34.2 ms eager:
the same kernels, 2.7x the time, as if the causal mask were materialised (full, masked attention)
instead of `is_causal=True`. transformers skips the mask only when `is_torchdynamo_exporting()` is
False; before torch's fix (pytorch#176499) dynamo folds `torch.compiler.is_exporting()` to True while
compiling. This prints what the traced check returns on this stack, then trains the autopatched
Qwen3-0.6B compiled as is and with `masking_utils.is_torchdynamo_exporting` reading torch's flag
itself (False unless torch.export runs), the first loss and tokens/s of each.
"""

import statistics
import sys

import torch

import bench_e2e
import transformers
from transformers import masking_utils


@torch.compile(backend="eager", fullgraph=True)
def _traced_check(x):
    return x + (1 if masking_utils.is_torchdynamo_exporting() else 0)


def run(fixed: bool) -> None:
    import autopatch

    if fixed:
        masking_utils.is_torchdynamo_exporting = lambda: torch.compiler._is_exporting_flag
    torch._dynamo.reset()
    spec = bench_e2e.MODELS["qwen3_0.6b"]
    torch.manual_seed(0)
    model = bench_e2e._build_model(spec, torch.device("cuda"), torch)
    autopatch.apply(model, **bench_e2e.OUR_TOGGLES)
    model = torch.compile(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    ids = torch.randint(0, spec["config"]["vocab_size"], (spec["batch"], spec["seq"]), device="cuda",
                        generator=torch.Generator(device="cuda").manual_seed(1))
    times, losses = [], []
    for i in range(8):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        end.record()
        torch.cuda.synchronize()
        losses.append(loss.item())
        if i >= 3:
            times.append(start.elapsed_time(end))
    ms = statistics.median(times)
    print(f"fixed={fixed}: first loss {losses[0]:.6f}, step {ms:.1f} ms, {spec['batch'] * spec['seq'] / ms * 1e3:,.0f} tok/s,"
          f" peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB", flush=True)
    del model, opt
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


if __name__ == "__main__":
    print("torch", torch.__version__, "transformers", transformers.__version__)
    print("is_torchdynamo_exporting() traced by dynamo:", bool(_traced_check(torch.zeros(1)).item()), "; eager:",
          masking_utils.is_torchdynamo_exporting())
    run(fixed=False)
    run(fixed=True)
    sys.exit(0)
