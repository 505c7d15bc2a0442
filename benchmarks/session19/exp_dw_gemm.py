"""Session 19 experiment: the fused linear CE's grad_weight accumulation as a Triton GEMM.

Per token chunk the FLCE adds G_cᵀ h_c into the V × H grad_weight buffer (bf16):

    C[m, n] += Σ_k G[k, m] · h[k, n]      G: [K, M] (the chunk's logits buffer, K = chunk rows, M = V)
                                          h: [K, N] (the chunk's hidden rows, N = H),  C: [M, N]

cuBLAS' addmm (beta = 1) reads and writes C once per chunk: at 16384 × 2304 → 262144 with 512-row chunks
that is 32 × 2.4 GB, and the GEMM took 40.6 ms where one full-size GEMM takes 28.5 (session 5): the C
traffic adds to the tensor-core time instead of hiding under it. K is only 504–1024, so each output tile
runs 8–16 k-steps and then spends as long again on its C read and write.

The candidates here are plain Triton GEMMs (pointer loads, cp.async pipeline, wgmma) whose tiles are
small enough that two CTAs share an SM: while one reads / writes its C tile, the other's k-loop runs.
Variants: the C tile is loaded before the k-loop into the accumulator (INIT_FROM_C) or added after it.

    python benchmarks/session19/exp_dw_gemm.py            (on the H200; prints a table, --json PATH)

Each case checks the result against an fp32 reference first (bf16: 1e-2 relative), then times the
cuBLAS addmm and each candidate with triton.testing.do_bench (medians, fresh C each case).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import triton
import triton.language as tl


@triton.jit
def dw_accumulate_kernel(g_ptr, h_ptr, c_ptr, M, N, K, stride_gk, stride_hk, stride_cm,
                         ACCUMULATE: tl.constexpr, INIT_FROM_C: tl.constexpr, EVEN_MN: tl.constexpr,
                         BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(N, BN)
    # The tiles of one row block of C are neighbours: its G tile is read from HBM once, then from L2.
    pid_m = pid // tiles_n
    pid_n = pid % tiles_n
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    a_ptrs = g_ptr + offs_k[:, None] * stride_gk + offs_m[None, :]
    b_ptrs = h_ptr + offs_k[:, None] * stride_hk + offs_n[None, :]
    c_ptrs = c_ptr + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :]
    if EVEN_MN:  # constant masks: the compiler drops them
        m_ok = tl.full((BM,), 1, tl.int1)
        n_ok = tl.full((BN,), 1, tl.int1)
    else:
        m_ok = offs_m < M
        n_ok = offs_n < N
    c_mask = m_ok[:, None] & n_ok[None, :]
    if ACCUMULATE and INIT_FROM_C:
        acc = tl.load(c_ptrs, mask=c_mask, other=0.0).to(tl.float32)
    else:
        acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        k_ok = offs_k[:, None] < K - k0
        a = tl.load(a_ptrs, mask=k_ok & m_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok & n_ok[None, :], other=0.0)
        acc = tl.dot(tl.trans(a), b, acc)
        a_ptrs += BK * stride_gk
        b_ptrs += BK * stride_hk
    if ACCUMULATE and not INIT_FROM_C:
        acc += tl.load(c_ptrs, mask=c_mask, other=0.0).to(tl.float32)
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)


@triton.jit
def dw_accumulate_tma_kernel(g_desc, h_desc, c_desc, M, N, K,
                             ACCUMULATE: tl.constexpr, INIT_FROM_C: tl.constexpr,
                             BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """The same GEMM through TMA descriptors (rows past K and the C edges are zero-filled / clipped)."""
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(N, BN)
    off_m = (pid // tiles_n) * BM
    off_n = (pid % tiles_n) * BN
    if ACCUMULATE and INIT_FROM_C:
        acc = c_desc.load([off_m, off_n]).to(tl.float32)
    else:
        acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        a = g_desc.load([k0, off_m])
        b = h_desc.load([k0, off_n])
        acc = tl.dot(a.T, b, acc)
    if ACCUMULATE and not INIT_FROM_C:
        acc += c_desc.load([off_m, off_n]).to(tl.float32)
    c_desc.store([off_m, off_n], acc.to(c_desc.dtype))


def dw_accumulate(g: torch.Tensor, h: torch.Tensor, c: torch.Tensor, accumulate: bool, cfg: dict) -> None:
    """c (+)= gᵀ h with g [K, M], h [K, N], c [M, N], all row-major (unit last stride)."""
    k, m = g.shape
    n = h.shape[1]
    bm, bn = cfg["BM"], cfg["BN"]
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    if cfg.get("tma"):
        from triton.tools.tensor_descriptor import TensorDescriptor
        bk = cfg["BK"]
        dw_accumulate_tma_kernel[grid](
            TensorDescriptor.from_tensor(g, [bk, bm]), TensorDescriptor.from_tensor(h, [bk, bn]),
            TensorDescriptor.from_tensor(c, [bm, bn]), m, n, k,
            ACCUMULATE=accumulate, INIT_FROM_C=cfg.get("init_from_c", False), BM=bm, BN=bn, BK=bk,
            num_warps=cfg["warps"], num_stages=cfg["stages"],
        )
        return
    dw_accumulate_kernel[grid](
        g, h, c, m, n, k, g.stride(0), h.stride(0), c.stride(0),
        ACCUMULATE=accumulate, INIT_FROM_C=cfg.get("init_from_c", False), EVEN_MN=(m % bm == 0 and n % bn == 0),
        BM=bm, BN=bn, BK=cfg["BK"], num_warps=cfg["warps"], num_stages=cfg["stages"],
    )


CONFIGS = {
    "128x128x64_w4_s3": dict(BM=128, BN=128, BK=64, warps=4, stages=3),
    "128x128x64_w4_s3_init": dict(BM=128, BN=128, BK=64, warps=4, stages=3, init_from_c=True),
    "128x128x32_w8_s6": dict(BM=128, BN=128, BK=32, warps=8, stages=6),
    "tma_128x128x64_w8_s3": dict(BM=128, BN=128, BK=64, warps=8, stages=3, tma=True),
    "tma_128x128x64_w8_s3_init": dict(BM=128, BN=128, BK=64, warps=8, stages=3, tma=True, init_from_c=True),
    "tma_128x128x64_w4_s3": dict(BM=128, BN=128, BK=64, warps=4, stages=3, tma=True),
    "tma_128x256x64_w8_s3": dict(BM=128, BN=256, BK=64, warps=8, stages=3, tma=True),
    "tma_128x256x64_w8_s4": dict(BM=128, BN=256, BK=64, warps=8, stages=4, tma=True),
    "128x128x64_w4_s4": dict(BM=128, BN=128, BK=64, warps=4, stages=4),
    "128x128x64_w8_s4": dict(BM=128, BN=128, BK=64, warps=8, stages=4),
    "128x128x64_w8_s3": dict(BM=128, BN=128, BK=64, warps=8, stages=3),
    "128x128x64_w8_s3_init": dict(BM=128, BN=128, BK=64, warps=8, stages=3, init_from_c=True),
    "128x256x64_w8_s3": dict(BM=128, BN=256, BK=64, warps=8, stages=3),
    "128x256x64_w8_s4": dict(BM=128, BN=256, BK=64, warps=8, stages=4),
    "256x128x64_w8_s3": dict(BM=256, BN=128, BK=64, warps=8, stages=3),
    "128x256x64_w8_s3_init": dict(BM=128, BN=256, BK=64, warps=8, stages=3, init_from_c=True),
}

# (M = vocab, N = hidden, K = chunk rows, chunks per step): the library's chunks at the table's FLCE cases.
CASES = [(262144, 2304, 504, 33), (128256, 4096, 1024, 8), (151936, 1024, 864, 19)]


def _check(g, h, c0, cfg) -> float:
    ref = c0.double() + g.double().t() @ h.double()
    c = c0.clone()
    dw_accumulate(g, h, c, True, cfg)
    if not torch.isfinite(c).all():
        return float("nan")
    return ((c.double() - ref).norm() / ref.norm()).item()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    args = ap.parse_args()
    from triton.testing import do_bench

    torch.manual_seed(0)
    results = []
    for m, n, k, chunks in CASES:
        g = (torch.randn(k, m, device="cuda") * 1e-2).to(torch.bfloat16)
        h = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
        c0 = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        flop = 2.0 * m * n * k
        row = {"M": m, "N": n, "K": k, "chunks": chunks}
        c = c0.clone()
        ms = do_bench(lambda: c.addmm_(g.t(), h), warmup=50, rep=300)
        row["cublas_addmm_ms"] = ms
        ms_mm = do_bench(lambda: torch.mm(g.t(), h, out=c), warmup=50, rep=300)
        row["cublas_mm_ms"] = ms_mm
        print(f"M={m} N={n} K={k}: cuBLAS addmm {ms:.3f} ms ({flop / ms / 1e9:.0f} TFLOP/s), "
              f"mm (no C read) {ms_mm:.3f} ms; x{chunks} chunks = {ms * chunks:.1f} ms", flush=True)
        for name in args.configs.split(","):
            cfg = CONFIGS[name]
            try:
                err = _check(g, h, c0, cfg)
                c = c0.clone()
                t = do_bench(lambda: dw_accumulate(g, h, c, True, cfg), warmup=50, rep=300)
            except Exception as exc:  # a config that does not fit (shared memory) is reported, not fatal
                print(f"   {name:24s} failed: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
                row[name] = {"error": str(exc)[:200]}
                continue
            row[name] = {"ms": t, "rel_err": err}
            print(f"   {name:24s} {t:.3f} ms ({flop / t / 1e9:.0f} TFLOP/s)  x{chunks} = {t * chunks:.1f} ms  "
                  f"rel err {err:.2e}  vs addmm {ms / t:.2f}x", flush=True)
        results.append(row)
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
