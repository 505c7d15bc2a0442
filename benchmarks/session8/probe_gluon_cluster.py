"""Probe (session 8, CPU only): does Gluon lower a reduction across the CTAs of a cluster? The lever for
cross entropy at V >= 128256, where a row (256 KB+) does not fit one SM's shared memory: split it over a
cluster of 4 CTAs holding <= 64 KB each, and reduce max / sum-exp across the cluster.

    .venv/bin/python benchmarks/session8/probe_gluon_cluster.py

Triton 3.9 (CPU stack): with num_ctas=4 and cga_layout=[[1], [2]] a gl.max over the distributed tensor
compiles for sm_90a to mapa + ld.shared::cluster + barrier.cluster (distributed shared memory). With
cga_layout bases given as element offsets ([[N // 4], [N // 2]]) the layout lowering aborts the process
("Layout is expected to be surjective"). Loads here are 2-byte: no divisibility attributes are passed.
Not yet checked: Triton 3.6 (the H200 image), vectorised loads, what the bases mean exactly, speed.
"""

import os
import re

os.environ["TRITON_INTERPRET"] = "0"

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402


@gluon.jit
def _cluster_max(x_ptr, o_ptr, N: gl.constexpr, num_warps: gl.constexpr):
    layout: gl.constexpr = gl.BlockedLayout([8], [32], [num_warps], [0], cga_layout=[[1], [2]])
    offs = gl.arange(0, N, layout=layout)
    x = gl.load(x_ptr + offs).to(gl.float32)
    m = gl.max(x, 0)  # across all 4 CTAs of the cluster
    gl.store(o_ptr + offs, (x - m).to(gl.bfloat16))


if __name__ == "__main__":
    sig = {"x_ptr": "*bf16", "o_ptr": "*bf16", "N": "constexpr", "num_warps": "constexpr"}
    k = triton.compile(GluonASTSource(_cluster_max, sig, {"N": 8192, "num_warps": 4}, {}),
                       target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_ctas": 4})
    ptx = k.asm["ptx"]
    print(f"triton {triton.__version__}: compiled; mapa {ptx.count('mapa')}, ld/st shared::cluster "
          f"{ptx.count('shared::cluster')}, barrier.cluster {ptx.count('barrier.cluster')}, "
          f"global loads {sorted(set(re.findall(r'ld[.]global[.a-z0-9]*', ptx)))}")
