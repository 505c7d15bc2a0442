"""Whether a source-only change to cross_entropy_smem.py leaves the machine code alone: compiles
_ce_smem_kernel for sm_90a at one shape per SMEM_TABLE kind, plain and with every optional term, and
prints a hash of each kernel's SASS (instructions only, without addresses or comments).

Run it before and after a refactor (e.g. with `git stash`) and diff the outputs; identical hashes mean the
GPU runs the same instructions, so the gpu tests and timings of the earlier commit still hold. Used in
session 13 for the _stats_full / _register_chunk helpers (sass_identity_t36.txt: triton 3.6, identical
before and after).

    PYTHONPATH=/tmp/t36:$PWD TRITON_INTERPRET=0 .venv/bin/python benchmarks/session13/sass_identity.py
"""

from __future__ import annotations

import hashlib
import importlib
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
sys.path.insert(0, ROOT)

import check_sm90  # noqa: E402
import triton  # noqa: E402
from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402

smem = importlib.import_module("fused_kernels.cross_entropy_smem")
ce = importlib.import_module("fused_kernels.cross_entropy")


def sass_hash(v: int, cfg, extras: bool) -> tuple[str, int]:
    sig, aligned = check_sm90.ce_smem_signature("bf16")
    flags = smem.kernel_constexprs(v, cfg.warps, cfg.ctas, has_scale=extras, has_softcap=extras, has_ls=extras,
                                   has_row_scale=extras, in_registers=cfg.in_registers)
    sig.update({k: "constexpr" for k in flags})
    fn = smem._ce_smem_kernel
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    opts = {"num_warps": cfg.warps, "num_stages": 1, "num_ctas": cfg.ctas}
    if cfg.in_registers:
        opts["maxnreg"] = smem.register_cap(cfg.warps, cfg.per_sm)
    kernel = triton.compile(GluonASTSource(fn, sig, flags, attrs), target=check_sm90._TARGET, options=opts)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        sass = subprocess.run([check_sm90._CUOBJDUMP, "-sass", f.name], capture_output=True, text=True).stdout
    code = "\n".join(re.sub(r";.*", "", re.sub(r"/\*[0-9a-f]*\*/", "", line)) for line in sass.splitlines()
                     if re.match(r"\s+/\*[0-9a-f]{4}\*/", line))
    return hashlib.sha1(code.encode()).hexdigest()[:12], len(code)


def main() -> None:
    print(f"triton {triton.__version__}")
    for v in (32000, 65536, 128256, 151936, 262144):
        for cfg in sorted({c for b, c in ce.SMEM_TABLE if b >= v and smem.registers_allowed(v, c.warps, c.ctas, c.in_registers)
                           and b == min(b2 for b2, _ in ce.SMEM_TABLE if b2 >= v)}, key=str):
            for extras in (False, True):
                digest, size = sass_hash(v, cfg, extras)
                print(f"V={v} {cfg} options {extras}: {digest} ({size} chars)", flush=True)


if __name__ == "__main__":
    main()
