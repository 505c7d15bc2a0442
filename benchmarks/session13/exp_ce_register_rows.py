"""Session 13: the library's shared-memory CE with chunks held in registers (LaunchConfig.in_registers),
against the shapes it had before, over the vocabularies people train with; 8192 rows bf16, no ignored
rows (as scripts/bench.py). Every variant is forced through the library's own dispatch
(`cross_entropy._CONFIG["force"]`), checked against float64 on the first 256 rows, then timed in turns
(queued CUDA-event medians, 3 rounds) as a fraction of a copy of the logits.

Then the optional terms (label smoothing 0.1 + softcap 30, the register rows' spilling specialisation on
triton 3.6): each shape's loss and gradient against the previous shape's (the gpu tests check both
against float64), and their times.

    PYTHONPATH=$PWD:$PWD/scripts:$PWD/benchmarks/session8 python3 benchmarks/session13/exp_ce_register_rows.py [--part2 | --part3]

The first call's results: exp_ce_register_rows.txt (library 27f56b6, the register rows as first
committed); --part2 / --part3: exp_ce_register_rows_part2.txt / _part3.txt.
"""

from __future__ import annotations

import os
import sys

import torch
import triton

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
for p in (ROOT, os.path.join(ROOT, "scripts"), os.path.join(ROOT, "benchmarks", "session8")):
    sys.path.insert(0, p)
os.environ["TRITON_INTERPRET"] = "0"

import importlib  # noqa: E402

ce = importlib.import_module("fused_kernels.cross_entropy")  # the module (the package exports the function)
smem = importlib.import_module("fused_kernels.cross_entropy_smem")

LC = ce.LaunchConfig
# name -> shape; a shape is timed at a V where smem.fits() accepts it on this GPU
SHAPES = {
    "1 CTA x 8 warps, 3/SM (before)": LC(2048, 8, 3, smem=True),
    "1 CTA x 8 warps, 4 in regs, 4/SM": LC(2048, 8, 4, smem=True, in_registers=4),
    "2 CTAs x 8 warps, 3/SM (before)": LC(2048, 8, 3, smem=True, ctas=2),
    "2 CTAs x 8 warps, 3 in regs, 4/SM": LC(2048, 8, 4, smem=True, ctas=2, in_registers=3),
    "4 CTAs x 4 warps, 4 in regs, 8/SM": LC(1024, 4, 8, smem=True, ctas=4, in_registers=4),
    "4 CTAs x 8 warps, 3/SM (before)": LC(2048, 8, 3, smem=True, ctas=4),
    "4 CTAs x 8 warps, 3 in regs, 4/SM": LC(2048, 8, 4, smem=True, ctas=4, in_registers=3),
    "8 CTAs x 4 warps, 4 in regs, 8/SM": LC(1024, 4, 8, smem=True, ctas=8, in_registers=4),
    "8 CTAs x 4 warps, 3 in regs, 8/SM": LC(1024, 4, 8, smem=True, ctas=8, in_registers=3),
    "8 CTAs x 8 warps, 4/SM (before)": LC(2048, 8, 4, smem=True, ctas=8),
    "8 CTAs x 8 warps, 3/SM (before)": LC(2048, 8, 3, smem=True, ctas=8),
    "8 CTAs x 8 warps, 3 in regs, 4/SM": LC(2048, 8, 4, smem=True, ctas=8, in_registers=3),
    # part 2 (the second call): 50304's unsplit row, and 8 CTAs of 4 warps at 7 per SM for 151936
    "1 CTA x 8 warps, 2/SM (before)": LC(2048, 8, 2, smem=True),
    "8 CTAs x 4 warps, 4 in regs, 7/SM": LC(1024, 4, 7, smem=True, ctas=8, in_registers=4),
    # part 3: 8 CTAs of 4 warps at fewer CTAs per SM (more registers) for the longer rows
    "8 CTAs x 4 warps, 3 in regs, 7/SM": LC(1024, 4, 7, smem=True, ctas=8, in_registers=3),
    "8 CTAs x 4 warps, 4 in regs, 6/SM": LC(1024, 4, 6, smem=True, ctas=8, in_registers=4),
    "8 CTAs x 4 warps, 4 in regs, 5/SM": LC(1024, 4, 5, smem=True, ctas=8, in_registers=4),
    "8 CTAs x 4 warps, 4 in regs, 4/SM": LC(1024, 4, 4, smem=True, ctas=8, in_registers=4),
}
PART3 = ("8 CTAs x 4 warps, 3 in regs, 8/SM", "8 CTAs x 4 warps, 4 in regs, 7/SM", "8 CTAs x 4 warps, 3 in regs, 7/SM",
         "8 CTAs x 4 warps, 4 in regs, 6/SM", "8 CTAs x 4 warps, 4 in regs, 5/SM", "8 CTAs x 4 warps, 4 in regs, 4/SM",
         "8 CTAs x 8 warps, 3 in regs, 4/SM")
VOCABS = (32000, 65536, 100352, 128256, 131072, 151936, 201088, 256000, 262144)
# the previous table's shape for V (what the new rows replace) and the optional-term comparison
BEFORE = {16384: "1 CTA x 8 warps, 3/SM (before)", 32768: "1 CTA x 8 warps, 3/SM (before)",
          50304: "1 CTA x 8 warps, 2/SM (before)", 32000: "1 CTA x 8 warps, 3/SM (before)", 65536: "2 CTAs x 8 warps, 3/SM (before)",
          100352: "4 CTAs x 8 warps, 3/SM (before)", 128256: "4 CTAs x 8 warps, 3/SM (before)",
          131072: "4 CTAs x 8 warps, 3/SM (before)", 151936: "8 CTAs x 8 warps, 4/SM (before)",
          201088: "8 CTAs x 8 warps, 3/SM (before)", 256000: "8 CTAs x 8 warps, 3/SM (before)",
          262144: "8 CTAs x 8 warps, 3/SM (before)"}


def forced(case, cfg, **options):
    opts = dict(ignore_index=-100, label_smoothing=0.0, z_loss=0.0, softcap=None)
    opts.update(options)

    def run():
        ce._CONFIG["force"] = cfg
        try:
            ce.launch_ce(case.x, case.t, case.grad, case.loss, case.coef, None, case.flag, **opts)
        finally:
            ce._CONFIG["force"] = None
    return run


def plain(vocabs, names=None):
    from ce_case import ce_case, check_and_time, copy_ms
    from tune_cross_entropy import queued_ms
    for v in vocabs:
        case = ce_case(v, n=8192, ref_rows=256, ignored=False)
        copy = copy_ms(case.x, timer=queued_ms)
        table = ce.launch_config(v, lambda c: ce.smem_shape_fits(smem, case.x, c))
        print(f"V={v}: copy {copy:.3f} ms; the table's shape now {table}", flush=True)
        runs = [(name, forced(case, cfg)) for name, cfg in SHAPES.items() if (names is None or name in names)
                and v >= ce.SMEM_FROM and smem.fits(v, cfg.warps, cfg.per_sm, cfg.ctas, 2, case.x.device, cfg.in_registers)]
        check_and_time(case, runs, copy, rounds=3, timer=queued_ms)
        case = None
        torch.cuda.empty_cache()


def with_options(vocabs, option_sets=(dict(label_smoothing=0.1, softcap=30.0),)):
    from ce_case import ce_case, copy_ms
    from tune_cross_entropy import queued_ms
    for v, opts in ((v, o) for v in vocabs for o in option_sets):
        case = ce_case(v, n=8192, ref_rows=256, ignored=True)
        copy = copy_ms(case.x, timer=queued_ms)
        before = SHAPES[BEFORE[v]]
        now = ce.launch_config(v, lambda c: ce.smem_shape_fits(smem, case.x, c))
        forced(case, before, **opts)()
        loss0, grad0 = case.loss.clone(), case.grad.clone()
        case.loss.fill_(float("nan"))
        case.grad.fill_(float("nan"))
        forced(case, now, **opts)()
        dl = ((case.loss - loss0).abs().max() / loss0.abs().max()).item()
        dg = ((case.grad.float() - grad0.float()).abs().max() / grad0.float().abs().max()).item()
        nan = case.loss.isnan().any().item() or case.grad.isnan().any().item()
        print(f"V={v} {opts}, 10 % ignored: {now} against {BEFORE[v]}: loss rel diff "
              f"{dl:.1e}, grad rel diff {dg:.1e} {'WRONG' if nan or dl > 1e-5 or dg > 1e-2 else 'ok'}", flush=True)
        for rnd in range(3):
            for label, cfg in (("before", before), ("now", now)):
                ms = queued_ms(forced(case, cfg, **opts), reps=15)
                print(f"  V={v} {opts} round {rnd}: {ms:.3f} ms  {copy / ms:5.1%} of copy  {label} {cfg}", flush=True)
        case = loss0 = grad0 = None
        torch.cuda.empty_cache()


if __name__ == "__main__":
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}", flush=True)
    if "--part3" in sys.argv:
        plain((128256, 151936, 201088, 256000, 262144), PART3)
    elif "--part2" in sys.argv:  # the second call: after softcap's x / softcap became a multiply
        plain((16384, 32768, 50304, 65536, 151936))
        with_options((128256, 262144), (dict(softcap=30.0), dict(label_smoothing=0.1),
                                        dict(label_smoothing=0.1, softcap=30.0)))
    else:
        plain(VOCABS)
        with_options((128256, 151936, 262144))
