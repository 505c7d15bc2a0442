"""The causal_mask rule over every causal-LM architecture of the installed transformers (CPU, fp32): each
tiny model with SDPA, trained one step unpatched in eager mode (the reference), then patched and compiled
(dynamo, eager backend: the mask is decided while dynamo traces). Per architecture: whether the rule
wrapped a forward, how many SDPA calls got no mask tensor, and the largest relative difference of the
loss and every gradient against the reference (fp32: at most 1e-5).

    .venv/bin/python benchmarks/session7/causal_mask_matrix.py [--only llama,qwen3] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
import warnings

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import transformers  # noqa: E402

from autopatch import patching, tiny_models  # noqa: E402
from autopatch._api import modules_of  # noqa: E402
from autopatch.rules import causal_mask  # noqa: E402
from transformers.integrations import sdpa_attention  # noqa: E402

SDPA = sdpa_attention.sdpa_attention_forward
CALLS: list[bool] = []


def spy(module, query, key, value, attention_mask, *args, **kwargs):
    CALLS.append(attention_mask is None)
    return SDPA(module, query, key, value, attention_mask, *args, **kwargs)


def step(call, model, inputs):
    torch.manual_seed(0)  # the same random draws (PhiMoE's router jitter) in the reference and the compiled run
    model.zero_grad(set_to_none=True)
    out = call(**inputs)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item() if a.numel() else 0.0


def check(arch) -> dict:
    row = {"arch": arch.class_name}
    try:
        model = tiny_models.build_tiny(arch).train()
    except Exception as exc:  # noqa: BLE001
        return dict(row, status="could not build", detail=str(exc)[:160])
    try:
        model.set_attn_implementation("sdpa")
    except Exception as exc:  # noqa: BLE001
        return dict(row, status="no sdpa", detail=str(exc)[:160])
    inputs = tiny_models.smoke_inputs(model, seq=12)
    try:
        ref = step(model, model, inputs)
        records = [r for m in modules_of(model) for r in causal_mask.RULE.patch_module(m, lambda k: True)]
        row["wrapped"] = sorted(r.target for r in records if r.patched)
        if not row["wrapped"]:
            return dict(row, status="not a candidate")
        CALLS.clear()
        got = step(torch.compile(model, backend="eager"), model, inputs)
        row["sdpa_calls"], row["no_mask"] = len(CALLS), sum(CALLS)
        errs = [rel(got[0], ref[0])] + [rel(got[1][n], g) for n, g in ref[1].items() if n in got[1]]
        row["max_rel_err"] = max(errs)
        row["status"] = "ok" if row["max_rel_err"] <= 1e-5 and set(got[1]) == set(ref[1]) else "MISMATCH"
    except Exception as exc:  # noqa: BLE001
        row["status"] = "error"
        row["detail"] = "".join(traceback.format_exception_only(exc)).strip()[:200]
    finally:
        patching.restore_all()
        torch._dynamo.reset()
    return row


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    transformers.AttentionInterface._global_mapping["sdpa"] = spy
    archs = tiny_models.causal_lm_architectures()
    if a.only:
        archs = [x for x in archs if x.model_dir in a.only.split(",")]
    rows, t0 = [], time.time()
    for arch in archs:
        row = check(arch)
        rows.append(row)
        print(f"{row['arch']:45s} {row['status']:16s} calls {row.get('sdpa_calls', '-')!s:>3} no mask "
              f"{row.get('no_mask', '-')!s:>3} err {row.get('max_rel_err', float('nan')):.1e} {row.get('detail', '')[:80]}",
              flush=True)
    counts = {}
    for r in rows:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    print(f"\n{len(rows)} architectures in {time.time() - t0:.0f} s: {counts}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"transformers": transformers.__version__, "torch": torch.__version__, "counts": counts,
                       "rows": rows}, f, indent=1)
    return 0 if not any(r["status"] in ("MISMATCH",) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
