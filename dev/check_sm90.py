"""Compile the rms_norm, rope and cross-entropy kernels (the Triton one and the Gluon shared-memory one)
for sm_90a (H100/H200) on a machine without a GPU and report, per autotuning candidate or table shape,
registers per thread, spills and shared memory, so that a candidate that spills or cannot fit is seen
before a GPU run (tests/test_cross_entropy.py and tests/test_rms_norm.py run it for the Gluon kernels).

    .venv/bin/python dev/check_sm90.py [--op rms_norm|rope|cross_entropy|cross_entropy_smem|all]
                                           [--cols 4096,1024] [--dtype bf16]

Triton's own compiler and the ptxas it ships do the work; nothing runs. Registers are what decide how
many programs share an SM (65536 per SM), which rms_norm's persistent grids are sized from
(rms_norm._regs_per_thread); this script shows whether those estimates still hold.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

os.environ["TRITON_INTERPRET"] = "0"  # compile real kernels, not interpreter stand-ins

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
_TARGET = GPUTarget("cuda", 90, 32)


def compile_sm90(fn, signature: dict, constexprs: dict, aligned, num_warps: int, num_stages: int = 3) -> dict:
    """Registers, spill bytes and shared memory (bytes, static + what the pipeliner allocates) of
    `fn` compiled for sm_90a. `aligned`: the arguments Triton would see as 16-divisible (pointers of
    fresh tensors, sizes that are multiples of 16). A "num_ctas" among the constexprs is the launch
    option (a thread-block cluster), not a kernel argument; so is a "maxnreg" (a cap on registers per thread)."""
    constexprs = dict(constexprs)
    num_ctas = constexprs.pop("num_ctas", 1)
    maxnreg = constexprs.pop("maxnreg", None)  # a launch option too: the registers ptxas may use per thread
    sig = dict(signature)
    sig.update({name: "constexpr" for name in constexprs})
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in aligned}
    source = ASTSource
    if type(fn).__name__ == "GluonJITFunction":  # cross_entropy_smem's kernel
        from triton.experimental.gluon._runtime import GluonASTSource as source
    kernel = triton.compile(source(fn, sig, constexprs, attrs), target=_TARGET,
                            options={"num_warps": num_warps, "num_stages": num_stages, "num_ctas": num_ctas,
                                     **({"maxnreg": maxnreg} if maxnreg else {})})
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        usage = subprocess.run([_CUOBJDUMP, "-res-usage", f.name], capture_output=True, text=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", usage)
    return {"regs": int(m[1]), "stack": int(m[2]), "shared": max(int(m[3]), kernel.metadata.shared),
            "local": int(m[4])}


def _aligned(sig: dict, n_cols: int) -> list[str]:
    """The rms_norm arguments Triton sees as 16-divisible: the pointers, and the column count and row
    strides when the row length is a multiple of 16."""
    aligned = [k for k, v in sig.items() if v.startswith("*")]
    if n_cols % 16 == 0:
        aligned += [k for k in sig if k.startswith("n_cols") or k.startswith("stride")]
    return aligned


def rms_norm_signature(dtype: str, backward: bool) -> dict:
    """The runtime arguments of rms_norm's forward or (one-kernel) backward kernel."""
    if backward:
        return {"DY": f"*{dtype}", "X": f"*{dtype}", "W": f"*{dtype}", "RSTD": "*fp32", "DX": f"*{dtype}",
                "DW_PARTIAL": "*fp32", "n_rows": "i32", "n_cols": "i32", "stride_dy": "i32", "stride_x": "i32",
                "stride_dx": "i32", "offset": "fp32", "row_bucket": "i32"}
    return {"X": f"*{dtype}", "W": f"*{dtype}", "Y": f"*{dtype}", "RSTD": "*fp32", "n_rows": "i32",
            "n_cols": "i32", "stride_x": "i32", "stride_y": "i32", "eps": "fp32", "offset": "fp32",
            "row_bucket": "i32"}


def rms_norm_cases(cols: list[int], dtype: str):
    from fused_kernels.ops import rms_norm_config as rms_cfg
    from fused_kernels.ops import rms_norm as rms
    for backward in (False, True):
        configs = [triton.Config(c.meta(), num_warps=c.num_warps, num_stages=c.num_stages)
                   for c in rms_cfg.candidate_configs(backward, rms_cfg.SM90)]
        for n in cols:
            for cfg in rms_cfg._prune(configs, {"n_cols": n, "row_bucket": 65536}):
                flags = dict(CASTING=0, HAS_WEIGHT=True, EXACT_BF16=False, **cfg.kwargs)
                if backward:
                    flags["COMPUTE_DW"] = True
                    flags["FROM_OUTPUT"] = False
                kernel = rms._rms_norm_bwd_kernel if backward else rms._rms_norm_fwd_kernel
                sig = rms_norm_signature(dtype, backward)
                aligned = _aligned(sig, n)
                label = f"rms_norm {'bwd' if backward else 'fwd'} n_cols={n} {cfg.kwargs} warps={cfg.num_warps}"
                yield label, kernel, sig, flags, aligned, cfg.num_warps, cfg.num_stages, cfg.kwargs["PROGRAMS_PER_SM"]


def rms_norm_split_cases(cols: list[int], dtype: str):
    """The split backward's two kernels (rows longer than SPLIT_BACKWARD_FROM) with the default config."""
    from fused_kernels.ops import rms_norm_config as rms_cfg
    from fused_kernels.ops import rms_norm as rms
    cfg = rms_cfg.SplitBackwardConfig()
    dot_sig = {"DY": f"*{dtype}", "X": f"*{dtype}", "W": f"*{dtype}", "RSTD": "*fp32", "DOT": "*fp32",
               "n_cols": "i32", "stride_dy": "i32", "stride_x": "i32", "offset": "fp32", "n_dot_blocks": "i32"}
    split_sig = {"DY": f"*{dtype}", "X": f"*{dtype}", "W": f"*{dtype}", "RSTD": "*fp32", "DOT": "*fp32",
                 "DX": f"*{dtype}", "DW_PARTIAL": "*fp32", "n_rows": "i32", "n_cols": "i32", "stride_dy": "i32",
                 "stride_x": "i32", "stride_dx": "i32", "offset": "fp32", "n_dot_blocks": "i32",
                 "rows_per_group": "i32"}
    for n in cols:
        if n <= rms_cfg.SPLIT_BACKWARD_FROM:  # plan() takes the split backward for longer rows only
            continue
        n_dot = -(-n // cfg.dot_block)
        common = dict(CASTING=0, HAS_WEIGHT=True, EXACT_BF16=False, FROM_OUTPUT=False)
        for kernel, sig, flags, warps, stages in (
                (rms._rms_norm_bwd_rowdot_kernel, dot_sig, dict(common, BLOCK_N=cfg.dot_block), cfg.dot_warps, 1),
                (rms._rms_norm_bwd_split_kernel, split_sig,
                 dict(common, COMPUTE_DW=True, BLOCK_N=cfg.block_n, DOT_BLOCKS=max(2, triton.next_power_of_2(n_dot)),
                      NUM_STAGES=cfg.num_stages), cfg.num_warps, cfg.num_stages)):
            aligned = _aligned(sig, n)
            yield f"rms_norm split bwd n_cols={n} {kernel.__name__} {cfg}", kernel, sig, flags, aligned, warps, stages, 0


def rope_cases(shapes: list[tuple[int, int, int]], dtype: str):
    from fused_kernels.ops import rope
    from fused_kernels.ops import rope_config
    sig = {"q_ptr": f"*{dtype}", "k_ptr": f"*{dtype}", "qo_ptr": f"*{dtype}", "ko_ptr": f"*{dtype}",
           "cos_ptr": f"*{dtype}", "sin_ptr": f"*{dtype}"}
    for name in rope._rope_kernel.arg_names[6:]:
        if name.isupper() or name.startswith("BLOCK"):
            break
        sig[name] = "i32"
    aligned = [k for k in sig if k.endswith("_ptr")] + [k for k in sig if k[-3:] in ("_sb", "_ss", "_sh")]
    for hq, hk, d in shapes:
        for backward in (False, True):
            for cfg in rope_config.candidate_configs(hq, hk, d):
                flags = dict(BLOCK_R=triton.next_power_of_2(d // 2), BLOCK_PQ=0, BLOCK_PK=0, INTERLEAVED=False,
                             BACKWARD=backward, **cfg.meta())
                label = f"rope {'bwd' if backward else 'fwd'} heads {hq}/{hk} dim {d} {cfg}"
                yield label, rope._rope_kernel, sig, flags, aligned, cfg.num_warps, 3, 0


def _ce_signature(dtype: str) -> dict:
    """The runtime arguments of the Triton cross-entropy kernel, in order (the Gluon one takes the same
    without V, which is a constexpr there, plus its cluster exchange buffers)."""
    return {"x_ptr": f"*{dtype}", "x_stride": "i32", "tgt_ptr": "*i64", "grad_ptr": f"*{dtype}", "grad_stride": "i32",
            "loss_ptr": "*fp32", "coef_ptr": "*fp32", "row_scale_ptr": "*fp32", "flag_ptr": "*i32", "n_rows": "i32",
            "V": "i32", "ignore_index": "i32", "logit_scale": "fp32", "softcap": "fp32", "label_smoothing": "fp32",
            "z_loss": "fp32"}


def cross_entropy_cases(vocabs: list[int], dtype: str):
    """The cross-entropy kernel with the launch table's shape for each V, writing the gradient."""
    from fused_kernels.ops import cross_entropy as ce
    from fused_kernels.ops import cross_entropy_config as ce_cfg
    sig = _ce_signature(dtype)
    pointers = [k for k in sig if k.endswith("_ptr")]
    for v in vocabs:
        # what Triton specialises on at launch: V (and the row strides of contiguous logits) divisible by 16
        aligned = pointers + (["V", "x_stride", "grad_stride"] if v % 16 == 0 else [])
        cfg = ce_cfg.launch_config(v)
        for softcap in (False, True):
            flags = ce.kernel_constexprs(cfg, v, has_scale=False, has_softcap=softcap, has_ls=softcap,
                                         has_row_scale=False, write_grad=True, exact_bf16=False)
            label = f"cross_entropy V={v} softcap/label smoothing {softcap} {cfg}"
            yield label, ce._ce_kernel, sig, flags, aligned, cfg.warps, 3, 0


def ce_smem_signature(dtype: str, partials: str = "*fp32") -> tuple[dict, list[str]]:
    """The Gluon kernel's runtime arguments (the Triton kernel's without V, plus the cluster exchange
    buffers; `partials`: their type) and those that are 16-divisible (what eligible() demands)."""
    sig = {}
    for k, t in _ce_signature(dtype).items():
        if k == "n_rows":  # the cluster exchange buffers come before the scalars
            sig.update(partials_ptr=partials, next_ptr="*i32", counter_ptr="*i32")
        if k != "V":
            sig[k] = t
    return sig, [k for k in sig if k.endswith("_ptr")] + ["x_stride", "grad_stride"]


def cross_entropy_smem_cases(vocabs: list[int], dtype: str):
    """The Gluon kernel (row in shared memory) with each SMEM_TABLE shape for each V it covers (a split
    row, and the unsplit one a GPU without clusters takes), with and without the optional terms; per_sm
    is the CTAs per SM the table expects to fit."""
    from fused_kernels.ops import cross_entropy as ce
    from fused_kernels.ops import cross_entropy_config as ce_cfg
    from fused_kernels.ops import cross_entropy_smem as smem
    from fused_kernels import _gpu
    sig, aligned = ce_smem_signature(dtype)
    for v in vocabs:
        bound = min((b for b, _ in ce_cfg.SMEM_TABLE if v <= b), default=None)  # every row for V: per-GPU fallbacks
        for cfg, extras in ((c, e) for b, c in ce_cfg.SMEM_TABLE if b == bound for e in (False, True)):
            flags = dict(smem.kernel_constexprs(v, cfg.warps, cfg.ctas, has_scale=extras, has_softcap=extras,
                                                has_ls=extras, has_row_scale=extras, in_registers=cfg.in_registers),
                         num_ctas=cfg.ctas)
            if cfg.in_registers:  # the launch caps ptxas so that per_sm CTAs fit (launch_ce_smem)
                flags["maxnreg"] = _gpu.register_cap(cfg.warps, cfg.per_sm)
            label = f"cross_entropy_smem V={v} scale/softcap/label smoothing/row scale {extras} {cfg}"
            # split rows are claimed from a counter: CTAs beyond what fits only wait, and find the rows taken
            per_sm = int(cfg.per_sm) if cfg.ctas == 1 else 0
            yield label, smem._ce_smem_kernel, sig, flags, aligned, cfg.warps, 1, per_sm


def norm_smem_cases(cols: list[int], dtype: str):
    """The long-row backward read once (norm_smem) for each length rms_norm dispatches to it, in every
    casting mode, with an offset and without dw, and the long-row forward likewise (with an offset and
    without a weight); their launches cap registers (maxnreg) for per_sm CTAs."""
    from fused_kernels.ops import rms_norm_config as rms_cfg
    from fused_kernels.ops import layer_norm as ln
    from fused_kernels.ops import norm_smem as smem
    t = {"bf16": "*bf16", "fp16": "*fp16"}[dtype]
    sig = {"dy_ptr": t, "x_ptr": t, "w_ptr": t, "mean_ptr": "*fp32", "rstd_ptr": "*fp32", "dx_ptr": t,
           "dw_part_ptr": "*fp32", "db_part_ptr": "*fp32", "next_ptr": "*i32", "counter_ptr": "*i32", "n_rows": "i32",
           "stride_dy": "i32", "stride_x": "i32", "stride_dx": "i32"}
    aligned = [a for a in sig if a.endswith("_ptr") or a.startswith("stride")]
    for n in cols:
        shape = rms_cfg.cluster_shape(n, backward=True)
        if shape is None:
            continue
        for casting_id, offset, compute_dw in ((0, 0.0, True), (0, 1.0, False), (1, 1.0, True), (2, 0.0, True)):
            flags = smem.kernel_constexprs(n, shape, offset=offset, casting_id=casting_id, compute_dw=compute_dw)
            flags.pop("num_warps")
            label = f"norm_smem N={n} casting {casting_id} offset {offset} dw {compute_dw} {shape}"
            yield label, smem._norm_bwd_smem_kernel, sig, flags, aligned, shape.warps, 1, 0
    for n in cols:  # LayerNorm's backward: the same kernel, centred
        shape = ln.cluster_shape(n)
        if shape is None:
            continue
        for has_weight, compute_dw, compute_db in ((True, True, True), (True, False, True), (False, False, False)):
            flags = smem.kernel_constexprs(n, shape, offset=0.0, casting_id=smem.LAYER_NORM_CASTING,
                                           compute_dw=compute_dw, centered=True, has_weight=has_weight,
                                           compute_db=compute_db)
            flags.pop("num_warps")
            label = (f"norm_smem layer_norm N={n} weight {has_weight} dw {compute_dw} db {compute_db} {shape}")
            yield label, smem._norm_bwd_smem_kernel, sig, flags, aligned, shape.warps, 1, 0
    fwd_sig = {"x_ptr": t, "w_ptr": t, "y_ptr": t, "rstd_ptr": "*fp32", "next_ptr": "*i32", "counter_ptr": "*i32",
               "n_rows": "i32", "stride_x": "i32", "stride_y": "i32", "eps": "fp32"}
    fwd_aligned = [a for a in fwd_sig if a.endswith("_ptr") or a.startswith("stride")]
    for n in cols:
        shape = rms_cfg.cluster_shape(n, backward=False)
        if shape is None:
            continue
        for casting_id, offset, has_weight in ((0, 0.0, True), (0, 1.0, True), (1, 1.0, True), (2, 0.0, True),
                                               (0, 0.0, False)):
            flags = smem.forward_constexprs(n, shape, offset=offset, casting_id=casting_id, has_weight=has_weight)
            flags.pop("num_warps")
            label = f"norm_smem forward N={n} casting {casting_id} offset {offset} weight {has_weight} {shape}"
            yield label, smem._rms_fwd_smem_kernel, fwd_sig, flags, fwd_aligned, shape.warps, 1, 0


# Spills allowed to a kernel whose launch caps its registers (maxnreg: cross_entropy_smem's shapes holding
# chunks in registers). With every optional term on, triton 3.6 spills 8-160 B per thread under the cap
# (none for plain CE), triton 3.9 48-192 B (0-32 B plain); a few spilled bytes under the cap cost less
# than the rows in flight the cap buys. More than this is a regression to look at.
CAPPED_SPILL_BYTES = 256


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--op", choices=("rms_norm", "rope", "cross_entropy", "cross_entropy_smem", "norm_smem", "all"),
                    default="all")
    ap.add_argument("--vocab", default="32000,128256,262144", help="cross_entropy vocabulary sizes")
    ap.add_argument("--smem-vocab", default="16384,32000,50304,65536,128256,151936,262144",
                    help="cross_entropy_smem vocabulary sizes")
    ap.add_argument("--cols", default="128,1024,4096,16384,65536", help="rms_norm row lengths")
    ap.add_argument("--smem-cols", default="16384,24576,32768,49152,65536", help="norm_smem row lengths")
    ap.add_argument("--rope", default="32x8x128", help="rope q_heads x k_heads x head_dim, comma separated")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    args = ap.parse_args()
    cases = []
    if args.op in ("rms_norm", "all"):
        cases += list(rms_norm_cases([int(c) for c in args.cols.split(",")], args.dtype))
        cases += list(rms_norm_split_cases([int(c) for c in args.cols.split(",")], args.dtype))
    if args.op in ("rope", "all"):
        shapes = [tuple(int(v) for v in s.split("x")) for s in args.rope.split(",")]
        cases += list(rope_cases(shapes, args.dtype))
    if args.op in ("cross_entropy", "all"):
        cases += list(cross_entropy_cases([int(v) for v in args.vocab.split(",")], args.dtype))
    if args.op in ("cross_entropy_smem", "all") and args.dtype != "fp32":
        cases += list(cross_entropy_smem_cases([int(v) for v in args.smem_vocab.split(",")], args.dtype))
    if args.op in ("norm_smem", "all") and args.dtype != "fp32":
        cases += list(norm_smem_cases([int(c) for c in args.smem_cols.split(",")], args.dtype))
    from fused_kernels.ops.rms_norm_config import SM90  # the GPU these compiles are for

    bad = 0
    capped_spills = 0
    for label, kernel, sig, flags, aligned, num_warps, num_stages, per_sm in cases:
        capped = "maxnreg" in flags  # compile_sm90 takes it out of flags
        try:
            r = compile_sm90(kernel, sig, flags, aligned, num_warps, num_stages)
        except Exception as exc:  # report and go on: one bad candidate should not hide the others
            print(f"FAILED  {label}: {type(exc).__name__}: {str(exc)[:200]}")
            bad += 1
            continue
        regs = -(-max(r["regs"], 1) // 8) * 8  # allocated in units of 8 per thread
        resident = min(65536 // (regs * 32 * num_warps), 64 // num_warps, SM90.smem_per_block // max(r["shared"], 1))
        note = ""
        if capped and r["local"] + r["stack"] <= CAPPED_SPILL_BYTES:
            # held to the registers that let per_sm CTAs share an SM: a few spilled bytes are the price
            note = f"  capped, spills {r['local'] + r['stack']} B" if r["local"] or r["stack"] else "  capped"
            capped_spills += bool(r["local"] or r["stack"])
        elif r["local"] or r["stack"]:
            note = f"  SPILLS {r['local'] + r['stack']} B"
            bad += 1
        if per_sm and resident < per_sm:
            note += f"  (grid sized for {per_sm}/SM, {resident} fit)"
        print(f"regs {r['regs']:3d} local {r['local']:4d} shared {r['shared']:6d} fit/SM {resident:2d}  {label}{note}")
    print(f"{len(cases)} kernels compiled for sm_90a, {bad} with spills or failures "
          f"({capped_spills} register-capped ones spill <= {CAPPED_SPILL_BYTES} B)")


if __name__ == "__main__":
    main()
