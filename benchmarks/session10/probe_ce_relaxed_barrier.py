"""Probe (session 10): how much of the split-row CE kernel's time is the release fence of its cluster
barrier? A timing bound only; the probe's results are NOT correct.

ncu (run_ncu_ce_split.sh, ncu_ce_stalls.txt) gives 0.93 cycles of "membar" stall per issued instruction
for the 4-CTA split kernel at V = 128256 (of 10.3 in all), and none for the unsplit kernel. Its one
fence is `barrier.cluster.arrive.release`. Release makes each thread wait until all its earlier stores
are performed, and those include the previous row's gradient, just issued.

The probe builds a copy of fused_kernels/cross_entropy_smem.py with `.relaxed` arrives. The partials
exchanged through global memory may then be read stale, so the loss and gradient may be wrong. It times
that copy against the library on the same inputs, with queued launches. The difference bounds what a
fence-free exchange could save, e.g. st.async into the peer CTAs' shared memory completing on an
mbarrier, which orders only its own bytes.

A second, correct, variant ("tagged", prepared on the CPU; compiled for sm_90a, never run) drops the
per-row cluster barrier altogether:
- Each CTA publishes each partial as one 64-bit word, (row + 1) << 32 | fp32 bits, with
  st.relaxed.gpu from one thread.
- Thread 0 of CTA 0 publishes the claimed next row the same way.
- Every CTA spins with ld.relaxed.gpu on the words it needs until their tag is the row's.
- A word's tag and value arrive together (single-copy atomicity of an aligned 64-bit access), so no
  fence is needed, and nothing waits for the previous row's gradient stores.
- The exchange buffer is zeroed per launch, so a tag is never stale from an earlier launch.

Both variants are generated from the library's source (text replacements checked to apply exactly
once), so they stay the library's kernel in everything else.

    PYTHONPATH=$PWD:$PWD/scripts python3 benchmarks/session10/probe_ce_relaxed_barrier.py
    .venv/bin/python benchmarks/session10/probe_ce_relaxed_barrier.py --compile-only   (CPU: sm_90a builds)
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path[:0] = [ROOT, os.path.join(ROOT, "scripts"), os.path.join(ROOT, "benchmarks", "session8"), HERE]
os.environ["TRITON_INTERPRET"] = "0"

import torch  # noqa: E402
import triton  # noqa: E402

ce = importlib.import_module("fused_kernels.cross_entropy")
smem = importlib.import_module("fused_kernels.cross_entropy_smem")

RELEASE = "barrier.cluster.arrive.release.aligned;"
RELAXED = "barrier.cluster.arrive.relaxed.aligned;"


# The tagged exchange replaces the library's per-row block, from its first line to its last (each checked
# to occur once): partials to global memory, the claim, the cluster barrier, the reads back.
EXCHANGE_FIRST = "                slot = partials_ptr + row * (3 * CTAS)\n"
EXCHANGE_LAST = "                nxt = gl.load(next_ptr + row, cache_modifier=\".cg\")\n"
EXCHANGE_NEW = """                slot = partials_ptr + row * (3 * CTAS + 1)  # int64 words: m, s, z per CTA, then the next row
                tag = r + 1
                _publish(slot + ranks, tag, m_cta)
                _publish(slot + CTAS + ranks, tag, s_cta)
                if HAS_LS:
                    _publish(slot + 2 * CTAS + ranks, tag, z_cta)
                _claim_row_tagged(counter_ptr, slot + 3 * CTAS, tag)
                m_row = _collect(slot, tag).to(gl.float32, bitcast=True)
                for k in gl.static_range(1, CTAS):
                    m_row = gl.maximum(m_row, _collect(slot + k, tag).to(gl.float32, bitcast=True))
                s_row = 0.0
                z_row = 0.0
                for k in gl.static_range(CTAS):
                    s_row += _collect(slot + CTAS + k, tag).to(gl.float32, bitcast=True) * \\
                        gl.exp2(_collect(slot + k, tag).to(gl.float32, bitcast=True) - m_row)
                    if HAS_LS:
                        z_row += _collect(slot + 2 * CTAS + k, tag).to(gl.float32, bitcast=True)
                nxt = _collect(slot + 3 * CTAS, tag).to(gl.int32, bitcast=True)
"""
HELPERS_AFTER = "    @gluon.jit\n    def _ce_smem_kernel("
# The tagged exchange's Gluon helpers (ce_tagged_words.py, next to this file) in the generated module.
HELPERS = "    from ce_tagged_words import _claim_row_tagged, _collect, _publish  # noqa: F401\n\n"
BUFFER_OLD = "partials = torch.empty(n * 3 * ctas, dtype=torch.float32, device=x.device)"
BUFFER_NEW = "partials = torch.zeros(n * (3 * ctas + 1), dtype=torch.int64, device=x.device)"


def _module_from(name: str, src: str):
    path = os.path.join(tempfile.mkdtemp(), f"{name}.py")  # a real file: triton reads the source
    with open(path, "w") as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses (rms_norm's configs) look their module up there
    spec.loader.exec_module(mod)
    return mod


def _index_once(src: str, text: str) -> int:
    assert src.count(text) == 1, f"the library's kernel changed; update the probe ({text[:60]!r})"
    return src.index(text)


def _replace_once(src: str, old: str, new: str) -> str:
    i = _index_once(src, old)
    return src[:i] + new + src[i + len(old):]


def _replace_block(src: str, first: str, last: str, new: str) -> str:
    """src with the block from its line `first` to its line `last` (each found once) replaced by new."""
    start = _index_once(src, first)
    end = _index_once(src, last) + len(last)
    assert start < end, "the block's last line comes before its first"
    return src[:start] + new + src[end:]


def relaxed_module():
    return _module_from("ce_smem_relaxed_probe", _replace_once(open(smem.__file__).read(), RELEASE, RELAXED))


def tagged_module():
    src = open(smem.__file__).read()
    src = _replace_block(src, EXCHANGE_FIRST, EXCHANGE_LAST, EXCHANGE_NEW)
    src = _replace_once(src, HELPERS_AFTER, HELPERS + HELPERS_AFTER)
    src = _replace_once(src, BUFFER_OLD, BUFFER_NEW)
    return _module_from("ce_smem_tagged_probe", src)


def smem_launch(module, grid=None):
    """A launch of `module`'s launch_ce_smem (the library's module or a variant built from its source) on
    a case, with the library's launch config and grid, or `grid` programs instead."""
    def launch(case, cfg, library_grid):
        module.launch_ce_smem(case.x, case.t, case.grad, case.loss, case.coef, None, case.flag, warps=cfg.warps,
                              ctas=cfg.ctas, grid=grid or library_grid, ignore_index=-100, label_smoothing=0.0,
                              z_loss=0.0, softcap=None, logit_scale=1.0)
    return launch


def time_variants(variants, vocabs=(128256, 262144), n: int = 8192) -> None:
    """Each (label, launch) of variants, launch(case, cfg, library_grid) (e.g. smem_launch(...)), on the
    same n-row case per V: its numbers against float64, then queued GPU times as fractions of a copy of
    the logits."""
    from ce_case import ce_case, check_and_time, copy_ms
    from tune_cross_entropy import queued_ms
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}")
    for v in vocabs:
        case = ce_case(v, n=n, ref_rows=256, ignored=False)
        copy = copy_ms(case.x, timer=queued_ms)
        cfg = ce.launch_config(v, lambda c: True)
        grid = ce.grid_programs(cfg, case.n, case.x.device)
        print(f"V={v}, {n} rows: copy {copy:.3f} ms; library {cfg}, grid {grid}", flush=True)
        check_and_time(case, [(label, lambda launch=launch, case=case, cfg=cfg, grid=grid: launch(case, cfg, grid))
                              for label, launch in variants],
                       copy, rounds=3, timer=queued_ms)
        del case


def main():
    time_variants([("library (release arrive)", smem_launch(smem)),
                   ("PROBE relaxed arrive (results may be wrong)", smem_launch(relaxed_module())),
                   ("tagged exchange, no per-row barrier", smem_launch(tagged_module()))])


def compile_report(name: str, module, partials: str, vocabs=(128256, 262144)) -> None:
    """A variant's kernels for sm_90a at the SMEM_TABLE shapes of `vocabs`, with and without the optional
    terms (registers, spills, shared memory), as scripts/check_sm90.py does for the library's."""
    import check_sm90
    sig, aligned = check_sm90.ce_smem_signature("bf16", partials)
    for v in vocabs:
        cfg = ce.launch_config(v, lambda c: True)
        for extras in (False, True):
            flags = dict(module.kernel_constexprs(v, cfg.warps, cfg.ctas, has_scale=extras, has_softcap=extras,
                                                  has_ls=extras, has_row_scale=extras), num_ctas=cfg.ctas)
            res = check_sm90.compile_sm90(module._ce_smem_kernel, sig, flags, aligned, cfg.warps, 1)
            print(f"{name} V={v} options {extras} {cfg}: {res}", flush=True)


def compile_only():
    """Both variants' kernels for sm_90a at the split-row shapes."""
    compile_report("relaxed", relaxed_module(), "*fp32")
    compile_report("tagged", tagged_module(), "*i64")


if __name__ == "__main__":
    if "--compile-only" in sys.argv:
        compile_only()
    else:
        main()
