"""Why Qwen3 under torch.compile trains slower than eager, with or without our kernels (a diagnosis).

    PYTHONPATH=$PWD:scripts python3 benchmarks/session6/exp_compile_mask.py      (GPU)

step_diagnosis (session 6) showed cuDNN SDPA taking 93.8 ms per step compiled against 34.2 ms eager:
the same kernels, 2.7x the time, as if the causal mask were materialised (full, masked attention)
instead of `is_causal=True`. transformers' `masking_utils._ignore_causal_mask_sdpa` decides that; in
older releases it never skips while dynamo traces (`is_torchdynamo_compiling()`), in newer ones only
when torch.compiler.is_exporting() reads False, which dynamo folds to True before torch's fix
(pytorch#176499). This prints the function's first lines on this stack, then trains the autopatched
Qwen3-0.6B compiled as is and with the skip taken whenever no padding mask exists (padding_mask None,
q_length == kv_length or 1, no local attention window reached, not exporting): the first loss, step
time, tokens/s and peak memory of each.

Outcome (README.md §4): the skip does not change the compiled step's attention time (92.4 ms, profiled
by exp_compile_mask_profile.py); the mask is not why compiled attention is slow.
"""

import inspect
import statistics
import sys

import torch

import bench_e2e
import transformers
from transformers import masking_utils


_ORIGINAL = masking_utils._ignore_causal_mask_sdpa
_PARAMS = list(inspect.signature(_ORIGINAL).parameters)


def _skip_when_unpadded(*args, **kwargs):
    """The skip without reading any tensor: no padding mask, causal over the whole (q == kv) or one
    query, no local window reached, not under torch.export."""
    bound = dict(zip(_PARAMS, args), **kwargs)
    q, kv = bound[_PARAMS[1]], bound[_PARAMS[2]]
    window = bound.get("local_attention_size")
    if (bound[_PARAMS[0]] is None and (q == 1 or q == kv) and (window is None or kv < window)
            and not torch.compiler._is_exporting_flag):
        return True
    return _ORIGINAL(*args, **kwargs)


def compiled_qwen3(fixed: bool):
    """(spec, model, optimizer, input ids): autopatched Qwen3-0.6B under torch.compile, the mask skip
    on (fixed) or off."""
    masking_utils._ignore_causal_mask_sdpa = _skip_when_unpadded if fixed else _ORIGINAL
    torch._dynamo.reset()
    spec = bench_e2e.MODELS["qwen3_0.6b"]
    torch.manual_seed(0)
    model, _info = bench_e2e.peer_model(spec, "ours_compile", torch.device("cuda"), torch)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    ids = torch.randint(0, spec["config"]["vocab_size"], (spec["batch"], spec["seq"]), device="cuda",
                        generator=torch.Generator(device="cuda").manual_seed(1))
    return spec, model, opt, ids


def run(fixed: bool) -> None:
    spec, model, opt, ids = compiled_qwen3(fixed)
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
    print("\n".join(inspect.getsource(_ORIGINAL).splitlines()[:40]))
    run(fixed=False)
    run(fixed=True)
    sys.exit(0)
