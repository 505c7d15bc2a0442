"""Probe (session 11, prepared, not run): is the split CE rows' ~80 % of a copy the cluster occupancy?

Only 92 clusters of 4 CTAs fit on the H200 at once (368 CTAs), where the unsplit kernel runs 396 (3 per
SM). The unsplit kernel reaches 88 % of a copy at V = 32000, and 0.93 × 88 % ≈ 82 %, close to the split
rows' 80 % at 128256. This probe runs the library's kernel with fewer programs than it launches:
- unsplit, V = 32000, 36432 rows (a multiple of both 396 and 368, so neither grid is unevenly loaded:
  the unsplit kernel assigns rows statically), with grids 396, 368 and 330;
- split, V = 128256, 8192 rows (clusters claim rows from a counter), with grids of 99 clusters (the
  library's), 92 (what fits) and 80.

If the unsplit kernel at 368 CTAs falls to ~82 %, occupancy is the split rows' cost, and a design whose
row slices are claimed by ordinary CTAs (no cluster launch; progress needs only CTAS resident CTAs) is
the lead. If it stays at ~88 %, the cost is in the exchange.

    PYTHONPATH=$PWD:$PWD/scripts python3 benchmarks/session11/probe_ce_occupancy.py
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "session10"))
from probe_ce_relaxed_barrier import smem, smem_launch, time_variants  # noqa: E402


def main():
    time_variants([(f"grid {g} CTAs", smem_launch(smem, g)) for g in (396, 368, 330)], vocabs=(32000,), n=36432)
    time_variants([(f"grid {g} clusters", smem_launch(smem, g)) for g in (99, 92, 80)], vocabs=(128256,))


if __name__ == "__main__":
    main()
