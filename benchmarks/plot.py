"""Draw the README's plots from a benchmark result file written by benchmarks/bench.py.

    python3 benchmarks/plot.py benchmarks/h200.json                # PNGs into benchmarks/, named h200_*.png
    python3 benchmarks/plot.py benchmarks/h200.json --out-dir /tmp --prefix try [--time wall]

Times are the kernels' own (GPU time, `gpu_ms`: torch.profiler's kernel durations summed) unless
`--time wall` (do_bench's wall time, which on a slow host is mostly Python for the small ops); a peer
with no time of the kind asked for is left out rather than compared on the other kind.

Plots (forward+backward, bf16; one line or bar per peer; missing peers and failed cells are left out):
  <prefix>_rms_norm_sweep.png       time vs hidden size at fixed bytes (16384x4096 elements), with the floor
  <prefix>_cross_entropy_sweep.png  time vs vocabulary size (8192 tokens), with the floor
  <prefix>_flce_memory.png          fused linear CE peak memory beyond inputs and grads, vs tokens and vs vocab
  <prefix>_main_table.png           the README table's cases as time relative to HF eager (lower is better)
  <prefix>_e2e.png                  training tokens/s and peak memory per peer, per model

matplotlib is a benchmark-only tool, not a dependency of autopatch: it is on the GPU image; here
`.venv/bin/python -m pip install matplotlib`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

PEER_STYLE = {  # name: (label, colour, marker)
    "hf_eager": ("HF eager", "#7f7f7f", "o"),
    "torch_compile": ("torch.compile", "#1f77b4", "s"),
    "liger": ("Liger-Kernel", "#ff7f0e", "^"),
    "cutce": ("Cut-CE (approx. grads)", "#9467bd", "v"),
    "cutce_exact": ("Cut-CE (exact)", "#8c564b", "D"),
    "ours": ("autopatch (ours)", "#d62728", "*"),
    "ours_compile": ("ours + torch.compile", "#e377c2", "P"),
}
MODE = "fwdbwd"
TIME_KEYS = {"gpu": "gpu_ms", "wall": "ms"}  # --time: which of a cell's times the plots draw
TIME_WORDS = {"gpu": "GPU time", "wall": "wall time"}


def _label(peer):
    return PEER_STYLE.get(peer, (peer, None, "o"))[0]


def _ok_ms(entry, peer, time="gpu", mode=MODE):
    """The peer's fwd+bwd time of the kind `time` ("gpu" or "wall") in ms, or None (failed, or not measured)."""
    r = entry.get("peers", {}).get(peer, {})
    if r.get("status") != "ok":
        return None
    return r.get("modes", {}).get(mode, {}).get(TIME_KEYS[time])


def _ok_mib(entry, peer, mode=MODE):
    r = entry.get("peers", {}).get(peer, {})
    if r.get("status") != "ok":
        return None
    return r.get("modes", {}).get(mode, {}).get("peak_mib")


def _klabel(x):
    return f"{x // 1024}k" if x % 1024 == 0 else str(x)


def _plain_log_y(ax):
    from matplotlib.ticker import FuncFormatter

    fmt = FuncFormatter(lambda v, _: f"{v:g}")
    ax.yaxis.set_major_formatter(fmt)
    ax.yaxis.set_minor_formatter(fmt)


def _tagged(data, tag):
    return [k for k in data.get("kernels", []) if tag in k.get("tags", []) and "peers" in k]


def _peers(entries):
    seen = []
    for p in PEER_STYLE:
        if any(p in e.get("peers", {}) for e in entries):
            seen.append(p)
    return seen


def _title(data, what):
    m = data.get("meta", {})
    return f"{what}\n{m.get('gpu') or m.get('device')}, torch {m.get('torch')}, triton {m.get('triton')}, {str(m.get('date_utc', ''))[:10]}"


def sweep_plot(plt, data, tag, xkey, xlabel, what, path, time="gpu"):
    entries = sorted(_tagged(data, tag), key=lambda e: e["params"][xkey])
    if not entries:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    xs = [e["params"][xkey] for e in entries]
    for peer in _peers(entries):
        pts = [(x, _ok_ms(e, peer, time)) for x, e in zip(xs, entries)]
        pts = [(x, y) for x, y in pts if y is not None]
        if pts:
            label, colour, marker = PEER_STYLE.get(peer, (peer, None, "o"))
            ax.plot(*zip(*pts), marker=marker, color=colour, label=label, lw=2.5 if peer == "ours" else 1.5)
    floors = [(x, e.get("floor", {}).get(MODE, {}).get("ms")) for x, e in zip(xs, entries)]
    floors = [(x, y) for x, y in floors if y]
    if floors:
        ax.plot(*zip(*floors), "k--", lw=1, label="memory floor (copy ceiling)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    _plain_log_y(ax)
    ax.set_xticks(xs)
    ax.set_xticklabels([_klabel(x) for x in xs])
    ax.set_xlabel(xlabel)
    ax.set_ylabel(f"forward + backward, {TIME_WORDS[time]}, ms (log)")
    ax.set_title(_title(data, f"{what} ({TIME_WORDS[time]})"), fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path


def flce_memory_plot(plt, data, path):
    panels = [("sweep_flce_tokens", "tokens", "tokens (hidden 4096, vocab 128256)"),
              ("sweep_flce_vocab", "vocab", "vocabulary (8192 tokens, hidden 4096)")]
    if not any(_tagged(data, t) for t, _, _ in panels):
        return None
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    for ax, (tag, key, xlabel) in zip(axes, panels):
        entries = sorted(_tagged(data, tag), key=lambda e: e["params"][key])
        xs = [e["params"][key] for e in entries]
        for peer in _peers(entries):
            pts = [(x, _ok_mib(e, peer)) for x, e in zip(xs, entries)]
            pts = [(x, max(y, 1.0)) for x, y in pts if y is not None]
            if pts:
                label, colour, marker = PEER_STYLE.get(peer, (peer, None, "o"))
                ax.plot(*zip(*pts), marker=marker, color=colour, label=label, lw=2.5 if peer == "ours" else 1.5)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        if xs:
            ax.set_xticks(xs)
            ax.set_xticklabels([_klabel(x) for x in xs])
        ax.set_xlabel(xlabel)
        ax.set_ylabel("peak MiB beyond inputs and grads (log)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(_title(data, "Fused linear cross entropy, forward + backward memory"), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path


def _short_case(name):
    return (name.replace("cross_entropy", "CE").replace("rms_norm", "RMSNorm").replace("swiglu", "SwiGLU")
            .replace("rope ", "RoPE ").replace("flce", "FLCE"))


def main_table_plot(plt, data, path, time="gpu"):
    entries = [k for k in data.get("kernels", []) if "peers" in k and ({"main", "scale"} & set(k.get("tags", [])))]
    entries = [e for e in entries if _ok_ms(e, "hf_eager", time)]
    if not entries:
        return None
    peers = [p for p in _peers(entries) if p != "hf_eager"]
    fig, ax = plt.subplots(figsize=(max(8, 1.1 * len(entries)), 5))
    width = 0.8 / max(1, len(peers))
    for i, peer in enumerate(peers):
        xs, ys = [], []
        for j, e in enumerate(entries):
            t = _ok_ms(e, peer, time)
            if t is not None:
                xs.append(j + (i - (len(peers) - 1) / 2) * width)
                ys.append(t / _ok_ms(e, "hf_eager", time))
        label, colour, _ = PEER_STYLE.get(peer, (peer, None, "o"))
        ax.bar(xs, ys, width=width, color=colour, label=label, edgecolor="black" if peer == "ours" else None)
    for j, e in enumerate(entries):
        floor = e.get("floor", {}).get(MODE, {}).get("ms")
        if floor:
            ax.hlines(floor / _ok_ms(e, "hf_eager", time), j - 0.45, j + 0.45, colors="k", linestyles="--", lw=1)
    ax.axhline(1.0, color="#7f7f7f", lw=1)
    ax.set_yscale("log")
    ax.set_xticks(range(len(entries)))
    ax.set_xticklabels([_short_case(e["case"]).replace(" ", "\n", 1) for e in entries], fontsize=7, rotation=15)
    ax.set_ylabel(f"{TIME_WORDS[time]} / HF eager's (log; lower is better)")
    ax.set_title(_title(data, f"Forward + backward, bf16, {TIME_WORDS[time]} relative to HF eager (dashed: floor)"),
                 fontsize=10)
    ax.grid(True, axis="y", which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path


def e2e_plot(plt, data, path):
    runs = [r for r in data.get("e2e", []) if r.get("status") == "ok"]
    if not runs:
        return None
    models = []
    for r in runs:
        if r["model"] not in models:
            models.append(r["model"])
    peers = [p for p in PEER_STYLE if any(r["peer"] == p for r in runs)]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    width = 0.8 / max(1, len(peers))
    for ax, key, ylabel in ((axes[0], "tokens_per_s", "training tokens/s (thousands)"),
                            (axes[1], "peak_gib", "peak GPU memory, GiB")):
        for i, peer in enumerate(peers):
            xs, ys = [], []
            for j, m in enumerate(models):
                r = next((r for r in runs if r["model"] == m and r["peer"] == peer), None)
                if r is not None and r.get(key) is not None:
                    xs.append(j + (i - (len(peers) - 1) / 2) * width)
                    ys.append(r[key] / 1e3 if key == "tokens_per_s" else r[key])
            label, colour, _ = PEER_STYLE.get(peer, (peer, None, "o"))
            ax.bar(xs, ys, width=width, color=colour, label=label, edgecolor="black" if peer.startswith("ours") else None)
        ax.set_xticks(range(len(models)))
        ax.set_xticklabels(models, fontsize=8)
        ax.set_ylabel(ylabel)
        ax.grid(True, axis="y", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(_title(data, "Training step (AdamW, sdpa, bf16)"), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Plot a benchmarks/bench.py result file.")
    ap.add_argument("json", help="result file, e.g. benchmarks/h200.json")
    ap.add_argument("--out-dir", default=None, help="default: the JSON file's folder")
    ap.add_argument("--prefix", default=None, help="default: the JSON file's name without .json")
    ap.add_argument("--time", choices=tuple(TIME_KEYS), default="gpu",
                    help="gpu: the kernels' own durations (default); wall: do_bench's wall time")
    a = ap.parse_args(argv)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot.py needs matplotlib (benchmark-only): python -m pip install matplotlib", file=sys.stderr)
        return 2
    with open(a.json) as f:
        data = json.load(f)
    out_dir = a.out_dir or os.path.dirname(os.path.abspath(a.json))
    prefix = a.prefix or os.path.splitext(os.path.basename(a.json))[0]
    os.makedirs(out_dir, exist_ok=True)

    def p(name):
        return os.path.join(out_dir, f"{prefix}_{name}.png")

    made = [
        sweep_plot(plt, data, "sweep_rms_norm", "hidden", "hidden size (rows x hidden = 2^26 elements, 128 MiB in bf16)",
                   "RMSNorm forward + backward, bf16, fixed bytes", p("rms_norm_sweep"), a.time),
        sweep_plot(plt, data, "sweep_cross_entropy", "vocab", "vocabulary size (8192 tokens)",
                   "Cross entropy forward + backward, bf16", p("cross_entropy_sweep"), a.time),
        flce_memory_plot(plt, data, p("flce_memory")),
        main_table_plot(plt, data, p("main_table"), a.time),
        e2e_plot(plt, data, p("e2e")),
    ]
    for m in made:
        if m:
            print(m)
    if not any(made):
        print("plot.py: nothing to plot in this file", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
