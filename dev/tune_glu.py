"""Sweep fused_kernels.glu's block configuration on a GPU (run on the target GPU).

    TRITON_INTERPRET=0 .venv/bin/python dev/tune_glu.py [--rows 16384 --cols 14336 --dtype bf16]

For each tile size (elements per program) and warp count it times the SwiGLU forward op and backward op
separately (triton.testing.do_bench medians), against the floor from a copy measured in the same run
(forward moves 3 tensors, backward 5). The best pair goes into glu_config._TILE_ELEMS / _NUM_WARPS; the
last line also times the halves of a fused gate_up tensor (strided rows) with the current defaults.
"""

from __future__ import annotations

import argparse
import itertools

import torch
import triton

from fused_kernels.ops import glu_config

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=16384)
    ap.add_argument("--cols", type=int, default=14336)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--tiles", default="1024,2048,4096,8192")
    ap.add_argument("--warps", default="4,8,16")
    args = ap.parse_args()
    dtype = DTYPES[args.dtype]
    torch.manual_seed(0)
    gate, up, dout = (torch.randn(args.rows, args.cols, device="cuda", dtype=dtype) for _ in range(3))
    nbytes = gate.numel() * gate.element_size()

    src = torch.empty(nbytes * 2, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy_ms = triton.testing.do_bench(lambda: dst.copy_(src))
    bw = 2 * src.numel() / (copy_ms * 1e-3)
    del src, dst
    fwd_floor, bwd_floor = 3 * nbytes / bw * 1e3, 5 * nbytes / bw * 1e3
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    print(f"copy {bw / 1e9:.0f} GB/s; floors fwd {fwd_floor:.3f} ms, bwd {bwd_floor:.3f} ms, "
          f"total {fwd_floor + bwd_floor:.3f} ms  ({args.rows}x{args.cols} {args.dtype})")

    elem = gate.element_size()
    best = {"fwd": (float("inf"), None), "bwd": (float("inf"), None)}
    default_tile, default_warps = dict(glu_config._TILE_ELEMS), dict(glu_config._NUM_WARPS)
    for tile, warps in itertools.product(map(int, args.tiles.split(",")), map(int, args.warps.split(","))):
        glu_config._TILE_ELEMS[elem] = tile
        glu_config._NUM_WARPS.update(fwd=warps, bwd=warps)
        f_ms = triton.testing.do_bench(lambda: torch.ops.fused_kernels.swiglu_fwd(gate, up))
        b_ms = triton.testing.do_bench(lambda: torch.ops.fused_kernels.swiglu_bwd(dout, gate, up))
        print(f"tile {tile:5d} warps {warps:2d}: fwd {f_ms:.3f} ms ({fwd_floor / f_ms:.1%} of floor)  "
              f"bwd {b_ms:.3f} ms ({bwd_floor / b_ms:.1%})  total {f_ms + b_ms:.3f} ms")
        best["fwd"] = min(best["fwd"], (f_ms, (tile, warps)))
        best["bwd"] = min(best["bwd"], (b_ms, (tile, warps)))
    print(f"best fwd {best['fwd'][0]:.3f} ms at (tile, warps) {best['fwd'][1]}; "
          f"best bwd {best['bwd'][0]:.3f} ms at {best['bwd'][1]}; "
          f"sum {best['fwd'][0] + best['bwd'][0]:.3f} ms")

    glu_config._TILE_ELEMS.update(default_tile)
    glu_config._NUM_WARPS.update(default_warps)
    gate_up = torch.randn(args.rows, 2 * args.cols, device="cuda", dtype=dtype)
    g2, u2 = gate_up.chunk(2, dim=-1)
    f_ms = triton.testing.do_bench(lambda: torch.ops.fused_kernels.swiglu_fwd(g2, u2))
    b_ms = triton.testing.do_bench(lambda: torch.ops.fused_kernels.swiglu_bwd(dout, g2, u2))
    print(f"defaults on gate_up.chunk(2) halves: fwd {f_ms:.3f} ms, bwd {b_ms:.3f} ms, total {f_ms + b_ms:.3f} ms")


if __name__ == "__main__":
    main()
