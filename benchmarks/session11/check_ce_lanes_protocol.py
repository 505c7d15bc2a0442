"""CPU check of probe_ce_lanes.py's two assumptions (no GPU needed; run: python3 this_file.py).

1. Coverage: over the S lanes, the full chunks and the masked tail chunk cover every class of a row
   exactly once (the kernel's offsets: lane·T·8 + thread·8 + element within each chunk of S·T·8).
2. Progress: a simulation of the lanes protocol with random interleavings: R resident CTAs out of a
   grid of G (the rest launched in pid order as CTAs exit); each CTA publishes its slice of row r,
   claims its lane's next row, waits until all S slices of r are published, then finishes r. Every row
   must be finished by exactly S CTAs. With fewer resident CTAs than lanes it must deadlock (the
   docstring's condition is also necessary).
"""

import random

import numpy as np


def coverage(v: int, lanes: int, warps: int) -> tuple[int, int]:
    t = 32 * warps
    chunk = lanes * t * 8
    nfull = v // chunk
    seen = np.zeros(v, dtype=np.int64)
    base = (np.arange(t)[:, None] * 8 + np.arange(8)[None, :]).ravel()
    for lane in range(lanes):
        offs = base + lane * t * 8
        for i in range(nfull):
            seen[i * chunk + offs] += 1
        if v % chunk:
            seen[nfull * chunk + offs[offs < v - nfull * chunk]] += 1
    return int(seen.min()), int(seen.max())


def simulate(n_rows: int, lanes: int, grid: int, resident: int, seed: int, max_steps: int = 10**6) -> str:
    rnd = random.Random(seed)
    counters = [0] * lanes
    published = set()
    finished = [0] * n_rows
    waiting_to_launch = list(range(grid))
    running = []

    def launch():
        pid = waiting_to_launch.pop(0)
        lane = pid % lanes
        running.append({"lane": lane, "row": counters[lane], "state": "pass1"})
        counters[lane] += 1

    while waiting_to_launch and len(running) < resident:
        launch()
    for _ in range(max_steps):
        if not running:
            return "ok" if all(f == lanes for f in finished) else "WRONG"
        cta = rnd.choice(running)
        if cta["row"] >= n_rows:
            running.remove(cta)
            if waiting_to_launch:
                launch()
        elif cta["state"] == "pass1":  # publish, then claim the lane's next row
            published.add((cta["row"], cta["lane"]))
            cta["next"] = counters[cta["lane"]]
            counters[cta["lane"]] += 1
            cta["state"] = "wait"
        elif cta["state"] == "wait":
            if all((cta["row"], k) in published for k in range(lanes)):
                cta["state"] = "pass2"
        else:
            finished[cta["row"]] += 1
            cta["row"], cta["state"] = cta["next"], "pass1"
    return "DEADLOCK"


if __name__ == "__main__":
    for shape in ((128256, 4, 8), (128256, 8, 8), (262144, 8, 8), (100000, 4, 8)):
        lo, hi = coverage(*shape)
        print(f"coverage V={shape[0]} lanes={shape[1]} warps={shape[2]}: each class {lo}..{hi} times")
        assert lo == hi == 1
    for n_rows, lanes, grid, resident in ((100, 4, 16, 16), (100, 4, 16, 4), (57, 8, 64, 8), (200, 8, 792, 660),
                                          (33, 4, 8, 5)):
        results = {simulate(n_rows, lanes, grid, resident, seed) for seed in range(5)}
        print(f"{n_rows} rows, {lanes} lanes, grid {grid}, {resident} resident: {sorted(results)}")
        assert results == {"ok"}
    result = simulate(7, 4, 8, 3, 0, max_steps=10**5)
    print(f"7 rows, 4 lanes, 3 resident (fewer than lanes): {result}")
    assert result == "DEADLOCK"
