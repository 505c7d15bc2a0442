"""Every op's plan for every shape of the kernel table (benchmarks/bench_kernels.py), on an H100, an H200,
an A100 and the CPU interpreter, against the committed listing tests/golden/plans.json: a change of code
layout must leave every path, launch shape and reason as it was. A deliberate change of a plan rewrites
the listing (`python tests/test_plans.py --write`) and the diff shows what moved."""

from __future__ import annotations

import dataclasses
import json
import pathlib
import sys

import torch

from fused_kernels._gpu import OFF_GPU, DeviceFacts
import helpers

GOLDEN = pathlib.Path(__file__).parent / "golden" / "plans.json"

DEVICES = {
    "h100": (DeviceFacts(True, 132, (9, 0), 233472, True), False),
    "h200": (DeviceFacts(True, 132, (9, 0), 233472, True), False),
    "a100": (DeviceFacts(True, 108, (8, 0), 167936, True), False),
    "cpu-interpreter": (OFF_GPU, True),
}
BF16 = torch.bfloat16

# The kernel table's shapes (benchmarks/bench_kernels.py real_cases), and a few more for the ops it has not.
RMS_NORM = [(16384, 4096), (65536, 1024), (4096, 16384), (1024, 65536), (32768, 2048), (8192, 8192),
            (2048, 32768), (4096, 24576), (4096, 49152)]
LAYER_NORM = [(16384, 4096), (65536, 1024), (4096, 16384), (1024, 32768)]
ROPE = [(4, 32, 8, 4096, 128)]  # batch, q heads, kv heads, seq, head_dim
SWIGLU = [(16384, 14336)]
CROSS_ENTROPY = [(8192, 128256), (8192, 32000), (8192, 262144), (8192, 65536), (8192, 151936), (2111, 128256),
                 (768, 128256)]
FLCE = [(8192, 4096, 128256), (16384, 2304, 262144), (2048, 4096, 128256), (4096, 4096, 128256),
        (16384, 4096, 128256), (8192, 4096, 32000), (8192, 4096, 65536), (8192, 4096, 262144)]
GELU = [(16384 * 4096,), (16384 * 14336,)]
MOE = [(16384, 4096, 14336), (8192, 2048, 768)]  # routed rows, hidden, expert width


def _value(v):
    """A config as JSON: dataclasses and named tuples by type name and fields, dtypes by name."""
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return {"type": type(v).__name__, **{f.name: _value(getattr(v, f.name)) for f in dataclasses.fields(v)}}
    if isinstance(v, tuple) and hasattr(v, "_fields"):
        return {"type": type(v).__name__, **{k: _value(getattr(v, k)) for k in v._fields}}
    if isinstance(v, (tuple, list)):
        return [_value(x) for x in v]
    if isinstance(v, torch.dtype):
        return str(v)
    return v


@dataclasses.dataclass(frozen=True)
class _Candidates:
    """A list of launch configs in a listing's plan form."""
    config: list
    path: str = "candidates"
    reason: str = ""


def _entry(op: str, call: dict, p) -> dict:
    return {"op": op, "call": call, "path": str(p.path), "config": _value(p.config), "reason": p.reason}


def listing() -> list[dict]:
    """Every plan of the table, in a fixed order."""
    from fused_kernels.ops import rms_norm_config as rms_cfg
    from fused_kernels.ops import layer_norm_config as ln
    from fused_kernels.ops import rope_config as rope
    from fused_kernels.ops import glu_config as glu
    from fused_kernels.ops import gelu
    from fused_kernels.ops import cross_entropy_config as ce
    from fused_kernels.ops import fused_linear_cross_entropy_config as flce
    from fused_kernels.ops import moe_experts_config as moe
    out = []
    for name, (dev, interp) in DEVICES.items():
        def add(op, call, p):
            out.append(dict(_entry(op, call, p), device=name))

        for rows, cols in RMS_NORM:
            add("rms_norm", {"rows": rows, "cols": cols, "direction": "forward"},
                helpers.plan(rms_cfg, rows, cols, BF16, BF16, "forward", device=dev))
            for from_output in (False, True):
                add("rms_norm", {"rows": rows, "cols": cols, "direction": "backward", "from_output": from_output},
                    helpers.plan(rms_cfg, rows, cols, BF16, BF16, "backward", device=dev, dy_dtype=BF16,
                                 from_output=from_output))
        if dev.cuda:  # the configs triton.autotune times on this GPU for the "triton" path's config None
            for backward in (False, True):
                add("rms_norm", {"autotune candidates": "backward" if backward else "forward"},
                    _Candidates(rms_cfg.candidate_configs(backward, dev)))
        for rows, cols in LAYER_NORM:
            add("layer_norm", {"rows": rows, "cols": cols, "direction": "forward"},
                helpers.plan(ln, rows, cols, BF16, "forward", device=dev))
            add("layer_norm", {"rows": rows, "cols": cols, "direction": "backward"},
                helpers.plan(ln, rows, cols, BF16, "backward", device=dev, weight_dtype=BF16, dy_dtype=BF16,
                             aligned=True))
        for batch, hq, hk, seq, dim in ROPE:
            add("rope", {"tokens": batch * seq, "q_heads": hq, "k_heads": hk, "head_dim": dim},
                helpers.plan(rope, batch * seq, hq, hk, dim, device=dev))
        for rows, cols in SWIGLU:
            for direction in ("fwd", "bwd"):
                add("glu", {"rows": rows, "cols": cols, "direction": direction, "layout": "contiguous"},
                    helpers.plan(glu, 1, rows * cols, 2, direction, device=dev))
                add("glu", {"rows": rows, "cols": cols, "direction": direction, "layout": "gate_up halves"},
                    helpers.plan(glu, rows, cols, 2, direction, row_strides=(2 * cols, 2 * cols, cols), device=dev))
        for (n,) in GELU:
            add("gelu", {"n": n}, helpers.plan(gelu, n, 2, device=dev))
        for tokens, vocab in CROSS_ENTROPY:
            for grad in (BF16, None):
                add("cross_entropy", {"rows": tokens, "vocab": vocab, "grad": str(grad)},
                    helpers.plan(ce, tokens, vocab, BF16, grad, device=dev))
        for tokens, hidden, vocab in FLCE:
            p = helpers.plan(flce, tokens, vocab, 2, device=dev)
            add("fused_linear_cross_entropy", {"tokens": tokens, "hidden": hidden, "vocab": vocab}, p)
            add("cross_entropy", {"rows": p.config, "vocab": vocab, "grad": str(BF16), "in": "flce chunk"},
                helpers.plan(ce, p.config, vocab, BF16, BF16, device=dev))
        for rows, hidden, width in MOE:
            for dtype in (BF16, torch.float32):
                add("moe_experts", {"rows": rows, "hidden": hidden, "width": width, "dtype": str(dtype)},
                    helpers.plan(moe, rows, hidden, width, dtype, device=dev))
    return out


def test_every_plan_of_the_kernel_table_is_the_committed_one():
    got = listing()
    want = json.loads(GOLDEN.read_text())
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g == w, f"the plan for {w['op']} {w['call']} on {w['device']} changed"


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python tests/test_plans.py --write  (rewrites tests/golden/plans.json)")
    import os

    os.environ.setdefault("TRITON_INTERPRET", "1")
    GOLDEN.parent.mkdir(exist_ok=True)
    GOLDEN.write_text(json.dumps(listing(), indent=1) + "\n")
    print(f"wrote {GOLDEN}")
