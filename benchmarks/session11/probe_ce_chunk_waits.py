"""Probe (session 11): does the CE shared-memory kernel lose time waiting for a whole row before pass 1?

The library commits all of a row's cp.async loads as one group (issued chunk by chunk during the
previous row's pass 2) and waits for all of them (`wait_group(0)`) before pass 1 starts. Until the last
chunk lands the CTA neither computes nor issues loads. This variant commits one group per chunk and
pass 1 waits only for the chunk it reads next (`wait_group(NCHUNK - 1 - i)`, unrolled), so pass 1 runs
while the row's last chunks are still arriving. Correct by the same argument as the library's (each
thread reads only the 16 bytes it copied itself); the probe checks the numbers against float64.

Generated from the library's source by text replacements (each checked to apply once), timed against
the library on the same inputs with queued launches (GPU time only), at V = 32000 (one CTA per row),
128256 (4-CTA clusters) and 262144 (8).

    PYTHONPATH=$PWD:$PWD/scripts python3 benchmarks/session11/probe_ce_chunk_waits.py
    .venv/bin/python benchmarks/session11/probe_ce_chunk_waits.py --compile-only   (CPU: sm_90a builds)
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "session10"))
# (it puts the repository, scripts/ and session8/ on sys.path and sets TRITON_INTERPRET=0)
from probe_ce_relaxed_barrier import (  # noqa: E402
    _module_from, _replace_once, compile_report, smem, smem_launch, time_variants)

REPLACEMENTS = (
    # the first row's prefetch: one group per chunk
    ("""        for i in range(NFULL):
            _async_load(buf.index(i), first + i * CHUNK + offs)
        if TAIL:
            _async_load(buf.index(NFULL), first + NFULL * CHUNK + offs, mask=tail)
        async_copy.commit_group()
""", """        for i in range(NFULL):
            _async_load(buf.index(i), first + i * CHUNK + offs)
            async_copy.commit_group()
        if TAIL:
            _async_load(buf.index(NFULL), first + NFULL * CHUNK + offs, mask=tail)
            async_copy.commit_group()
"""),
    # pass 1: wait for each chunk just before reading it
    ("""            async_copy.wait_group(0)
            m2 = gl.full""", """            m2 = gl.full"""),
    ("""            for i in range(NFULL):
                z = _capped(buf.index(i).load(REG), logit_scale, softcap, HAS_SCALE, HAS_SOFTCAP)
                m2, s, sumz = _stats_chunk(z, z, m2, s, sumz, HAS_LS)
            if TAIL:
                z = _capped""", """            for i in gl.static_range(NFULL):
                async_copy.wait_group(NCHUNK - 1 - i)
                z = _capped(buf.index(i).load(REG), logit_scale, softcap, HAS_SCALE, HAS_SOFTCAP)
                m2, s, sumz = _stats_chunk(z, z, m2, s, sumz, HAS_LS)
            if TAIL:
                async_copy.wait_group(0)
                z = _capped"""),
    # pass 2: the next row's chunk i is its own group (empty when there is no next row)
    ("""                        _async_load(buf.index(i), nxt_row + i * CHUNK + offs, mask=tail)
            async_copy.commit_group()
            r = nxt
""", """                        _async_load(buf.index(i), nxt_row + i * CHUNK + offs, mask=tail)
                async_copy.commit_group()
            r = nxt
"""),
)


def chunk_waits_module():
    src = open(smem.__file__).read()
    for old, new in REPLACEMENTS:
        src = _replace_once(src, old, new)
    return _module_from("ce_smem_chunk_waits_probe", src)


def main():
    time_variants([("library (one wait per row)", smem_launch(smem)),
                   ("a wait per chunk in pass 1", smem_launch(chunk_waits_module()))], vocabs=(32000, 128256, 262144))


def compile_only():
    compile_report("chunk waits", chunk_waits_module(), "*fp32", vocabs=(32000, 128256, 262144))


if __name__ == "__main__":
    if "--compile-only" in sys.argv:
        compile_only()
    else:
        main()
