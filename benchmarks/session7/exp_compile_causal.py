"""Why compiled Qwen3 attention is ~3x its eager time (session 7), and whether skipping the causal mask
fixes it. Session 7 measured per call, 8 and 28 layers (sdpa_calls_L*.txt): the same cuDNN kernels, fprop
3.1x / bprop 3.4x slower compiled, and no fmha_reduce_head kernel (the GQA reduction of dK/dV) — as if
transformers' sdpa_attention_forward got a mask tensor: then it repeats k/v to all heads and passes
is_causal=False, so cuDNN computes the full masked square instead of the causal half.

Per variant, on an 8-layer Qwen3-0.6B (HF sdpa, bf16, batch 8 x 2048) under torch.compile: what
sdpa_attention_forward receives at trace time (mask None or its shape, key heads, is_causal), then one
profiled step: cuDNN kernels' time per call and the step's time.
  as_is      transformers unchanged
  fixed      (1) masking_utils._ignore_causal_mask_sdpa returns True when there is no padding mask (session
             6's patch; alone it changes nothing: the CPU run shows it is never reached), and
             (2) find_packed_sequence_indices returns None while Qwen3Model.forward runs with no
             position ids, mask or cache given (it then makes the positions itself: an arange, never packed).
             Under compile transformers cannot look at the positions (data-dependent), assumes packing
             and so materialises the mask (found on the CPU stack, transformers 5.24).

    PYTHONPATH=$PWD:scripts python3 benchmarks/session7/exp_compile_causal.py   (GPU)
"""

import inspect
import statistics
import sys
import time

import torch
import transformers
from transformers import masking_utils
from transformers.integrations import sdpa_attention
from transformers.models.qwen3 import modeling_qwen3

import bench_e2e

ORIG_IGNORE = masking_utils._ignore_causal_mask_sdpa
ORIG_SDPA = sdpa_attention.sdpa_attention_forward
PARAMS = list(inspect.signature(ORIG_IGNORE).parameters)


def s6_skip(*args, **kwargs):
    bound = dict(zip(PARAMS, args), **kwargs)
    q, kv = bound[PARAMS[1]], bound[PARAMS[2]]
    result = bound[PARAMS[0]] is None and (q == 1 or q == kv) or ORIG_IGNORE(*args, **kwargs)
    print(f"    [trace] _ignore_causal_mask_sdpa(padding_mask={'None' if bound[PARAMS[0]] is None else 'tensor'}, "
          f"q={q}, kv={kv}) -> {result}", flush=True)
    return result


ORIG_PACKED = masking_utils.find_packed_sequence_indices
ORIG_MODEL_FORWARD = modeling_qwen3.Qwen3Model.forward
ARANGE_POSITIONS = [False]


def model_forward_flagging(self, *args, **kwargs):
    """The model builds position ids itself (an arange: never packed) when given none, no mask, no cache."""
    mine = (len(args) <= 1 and kwargs.get("position_ids") is None and kwargs.get("attention_mask") is None
            and kwargs.get("past_key_values") is None and kwargs.get("cache") is None)
    ARANGE_POSITIONS[0] = mine
    try:
        return ORIG_MODEL_FORWARD(self, *args, **kwargs)
    finally:
        ARANGE_POSITIONS[0] = False


def packed_unless_arange(*args, **kwargs):
    if ARANGE_POSITIONS[0]:
        print("    [trace] find_packed_sequence_indices: positions are the model's arange -> None", flush=True)
        return None
    return ORIG_PACKED(*args, **kwargs)


def logged_sdpa(module, query, key, value, attention_mask, *args, **kwargs):
    if not getattr(module, "_logged", False):
        module._logged = True
        mask = "None" if attention_mask is None else f"tensor{tuple(attention_mask.shape)} {attention_mask.dtype}"
        print(f"    [trace] layer {getattr(module, 'layer_idx', '?')}: mask {mask}, q {tuple(query.shape)}, "
              f"k {tuple(key.shape)}, is_causal kwarg {kwargs.get('is_causal')}", flush=True)
    return ORIG_SDPA(module, query, key, value, attention_mask, *args, **kwargs)


def main() -> int:
    print("torch", torch.__version__, "transformers", transformers.__version__)
    src = inspect.getsource(masking_utils).splitlines()
    for i, line in enumerate(src):
        if any(w in line for w in ("def sdpa_mask", "allow_is_causal_skip", "is_tracing(", "def create_causal_mask",
                                   "_ignore_causal_mask_sdpa(", "find_packed_sequence")):
            print(f"  masking_utils:{i + 1}: {line.strip()[:150]}")
    transformers.AttentionInterface._global_mapping["sdpa"] = logged_sdpa
    spec = bench_e2e.MODELS["qwen3_0.6b"]
    cpu = "--cpu" in sys.argv  # a tiny fp32 model: checks the script, not the numbers
    layers = int(next((a for a in sys.argv[1:] if a.isdigit()), 8))
    device = "cpu" if cpu else "cuda"
    small = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=64) if cpu else {}
    batch, seq = (2, 64) if cpu else (spec["batch"], spec["seq"])
    for variant in ("as_is", "fixed"):
        masking_utils._ignore_causal_mask_sdpa = ORIG_IGNORE if variant == "as_is" else s6_skip
        fixed = variant == "fixed"
        masking_utils.find_packed_sequence_indices = packed_unless_arange if fixed else ORIG_PACKED
        modeling_qwen3.Qwen3Model.forward = model_forward_flagging if fixed else ORIG_MODEL_FORWARD
        torch._dynamo.reset()
        cfg = transformers.AutoConfig.for_model(spec["model_type"], **dict(spec["config"], num_hidden_layers=layers,
                                                                           **small))
        cfg.use_cache = False
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").to(device, torch.float32 if cpu else torch.bfloat16)
        model.train()
        ids = torch.randint(0, cfg.vocab_size, (batch, seq), device=device,
                            generator=torch.Generator(device=device).manual_seed(1))
        compiled = torch.compile(model)
        print(f"{variant}:", flush=True)
        losses, times = [], []
        for _ in range(5):
            t0 = time.perf_counter()
            loss = compiled(input_ids=ids, labels=ids).loss
            loss.backward()
            losses.append(loss.item())  # synchronises
            times.append((time.perf_counter() - t0) * 1e3)
            model.zero_grad(set_to_none=True)
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU if cpu else ProfilerActivity.CUDA]) as prof:
            compiled(input_ids=ids, labels=ids).loss.backward()
            if not cpu:
                torch.cuda.synchronize()
        model.zero_grad(set_to_none=True)
        att = [(e.key, e.count, e.device_time_total / 1e3) for e in prof.key_averages() if "cudnn" in e.key]
        print(f"  loss {losses[0]:.6f}; fwd+bwd {statistics.median(times[2:]):.1f} ms; "
              + "; ".join(f"{k[:60]} x{c} {ms / c:.3f} ms/call" for k, c, ms in att), flush=True)
        del model, compiled
        if not cpu:
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
