"""The README's performance tables, made from the results files.

    python benchmarks/readme_table.py benchmarks/results/h200-torch2.11-triton3.6.json \
        benchmarks/results/h200-torch2.11-triton3.6-moe.json \
        benchmarks/results/h200-torch2.11-triton3.6-vlm.json \
        benchmarks/results/h200-torch2.11-triton3.6-trl.json                  # print
    ... --update README.md                                                     # into the README

With --update the text between the README's `<!-- perf-table:begin -->` and `<!-- perf-table:end -->`
lines is replaced; tests/test_readme_table.py checks that the committed README holds exactly what this
script makes from the committed results file, so the README never shows a number no file holds.

Kernel rows (forward + backward, bf16): our GPU time (the kernels' own durations, torch.profiler), the
fastest peer's GPU time, their ratio, our fraction of the ceiling measured in the same run (copy
bandwidth for memory-bound ops, bf16 matmul for the fused linear cross entropy), then the do_bench wall
time and our peak memory beyond inputs and gradients. Training-step rows: tokens/s and peak GiB per peer.
Further files, each row with the commit of its run, add their tables: the MoE one (bench_moe.py's experts
block, bench_e2e.py's MoE models), the vision-language one (bench_e2e.py's image-text models) and the
TRL one (bench_trl.py's SFT, DPO and GRPO steps).
"""

from __future__ import annotations

import argparse
import json
import sys

BEGIN, END = "<!-- perf-table:begin -->", "<!-- perf-table:end -->"
MODE = "fwdbwd"

# The headline cases, in the order shown: (case name in the results file, label in the README).
KERNEL_ROWS = (
    ("rms_norm 16384x4096", "RMSNorm 16384×4096"),
    ("rms_norm 65536x1024", "RMSNorm 65536×1024"),
    ("rms_norm 4096x16384", "RMSNorm 4096×16384"),
    ("rms_norm 1024x65536", "RMSNorm 1024×65536"),
    ("layer_norm 16384x4096", "LayerNorm 16384×4096 (weight, bias)"),
    ("layer_norm 65536x1024", "LayerNorm 65536×1024"),
    ("layer_norm 4096x16384", "LayerNorm 4096×16384"),
    ("rope 4x32/8x4096x128", "RoPE q 4×32×4096×128, k 8 heads"),
    ("swiglu 16384x14336", "SwiGLU 16384×14336"),
    ("cross_entropy 8192x32000", "Cross entropy 8192×32000"),
    ("cross_entropy 8192x128256", "Cross entropy 8192×128256"),
    ("cross_entropy 8192x262144", "Cross entropy 8192×262144"),
    ("flce 8192x4096->128256", "Fused linear CE 8192×4096 → 128256"),
    ("flce 16384x2304->262144", "Fused linear CE 16384×2304 → 262144"),
)
PEER_NAMES = {"hf_eager": "HF eager", "torch_compile": "torch.compile", "liger": "Liger", "cutce": "Cut-CE",
              "cutce_exact": "Cut-CE exact", "ours": "autopatch", "ours_compile": "autopatch + compile",
              "ours_env": "autopatch (FUSED_KERNELS=all)", "ours_keep_input": "autopatch, memory trade-offs off"}
NOT_PEERS = ("ours", "host_floor")  # host_floor launches empty kernels: what Python costs any eager op
E2E_PEERS = ("hf_eager", "torch_compile", "liger", "ours", "ours_env", "ours_keep_input", "ours_compile")
E2E_MODELS = {"qwen3_0.6b": "Qwen3-0.6B", "llama3_8b_4layers": "Llama-3-8B, 4 layers"}
MOE_MODELS = {"qwen3_moe_30b_a3b_6layers": "Qwen3-30B-A3B, 6 layers",
              "deepseek_v3_6layers": "DeepSeek-V3 style, 6 layers"}
VLM_MODELS = {"qwen2_5_vl_3b": "Qwen2.5-VL-3B", "gemma3_4b": "Gemma-3-4B"}
TRL_MODELS = {"qwen3_0.6b": "Qwen3-0.6B", "llama3_2_3b": "Llama-3.2-3B"}
TRL_TRAINERS = {"sft": "SFT", "dpo": "DPO", "grpo": "GRPO"}
MOE_BLOCKS = {"qwen3_moe": "Qwen3-30B-A3B experts", "deepseek_v3": "DeepSeek-V3-style experts"}


def _mode(case: dict, peer: str):
    entry = case["peers"].get(peer, {})
    return entry.get("modes", {}).get(MODE) if entry.get("status") == "ok" else None


def _from_earlier_run(case: dict, meta: dict) -> bool:
    """A kernel row kept whole from another commit's run than the file's (it carries its own git_commit)."""
    return case.get("git_commit", meta.get("git_commit")) != meta.get("git_commit")


def kernel_table(results: dict) -> list[str]:
    cases = {c["case"]: c for c in results["kernels"]}
    lines = ["| case | autopatch GPU ms | best peer GPU ms | ratio | % of ceiling | autopatch wall ms / peak MiB |",
             "|---|---|---|---|---|---|"]
    for name, label in KERNEL_ROWS:
        case = cases.get(name)
        ours = _mode(case, "ours") if case else None
        if ours is None:
            continue
        others = [(m["gpu_ms"], p) for p in case["peers"] if p not in NOT_PEERS
                  for m in [_mode(case, p)] if m and m.get("gpu_ms")]
        best_ms, best = min(others)
        ceiling = ours.get("gpu_frac_ceiling")
        mine, theirs = f"{ours['gpu_ms']:.3f}", f"{best_ms:.3f}"
        if ours["gpu_ms"] <= best_ms:  # the faster of the two in bold
            mine = f"**{mine}**"
        else:
            theirs = f"**{theirs}**"
        if _from_earlier_run(case, results["meta"]):
            label += " ‡"  # render's footnote names its commit
        lines.append(f"| {label} | {mine} | {theirs} ({PEER_NAMES.get(best, best)}) | "
                     f"{ours['gpu_ms'] / best_ms:.2f} | {100 * ceiling:.0f} % | "
                     f"{ours['ms']:.3f} / {ours['peak_mib']:.0f} |")
    return lines


def _step_cell(run: dict) -> str:
    """A training step's cell: tokens/s and peak memory."""
    return f"{run['tokens_per_s'] / 1000:.1f}k tok/s, {run['peak_gib']:.1f} GiB"


def e2e_table(results: dict, models: dict = E2E_MODELS) -> list[str]:
    runs = {(r["model"], r["peer"]): r for r in results.get("e2e", []) if r.get("status") in ("ok", "oom")}
    peers = [p for p in E2E_PEERS if any(key[1] == p for key in runs)]
    lines = ["| training step | " + " | ".join(PEER_NAMES[p] for p in peers) + " |",
             "|---|" + "---|" * len(peers)]
    for model, label in models.items():
        cells = []
        for p in peers:
            r = runs.get((model, p))
            cells.append("–" if r is None else "out of memory" if r["status"] == "oom" else _step_cell(r))
        if any(c not in ("–", "out of memory") for c in cells):
            r0 = next(runs[(model, p)] for p in peers if (model, p) in runs and runs[(model, p)]["status"] == "ok")
            lines.append(f"| {label} ({r0['batch']}×{r0['seq']} tokens) | " + " | ".join(cells) + " |")
    return lines


def render(results: dict, path: str) -> str:
    meta, ceil = results["meta"], results["ceilings"]
    # "+changes": the device copy's tree differed from its commit; the digest names the library code that ran
    digest = f" (source digest {meta['source_digest']})" if meta.get("source_digest") else ""
    head = (f"{meta['gpu']}, torch {meta['torch']}, triton {meta['triton']}, transformers {meta['transformers']}, "
            f"Liger-Kernel {meta.get('liger_kernel', '–')}, Cut-CE {meta.get('cut_cross_entropy', '–')}; "
            f"commit {meta.get('git_commit', '?')}{digest}, {meta['date_utc'][:10]}. Ceilings measured in the run: copy "
            f"{ceil['copy_gbps']:.0f} GB/s, bf16 matmul {ceil['matmul_tflops']:.0f} TFLOP/s. "
            f"From [{path}]({path}).")
    shown = {name for name, _ in KERNEL_ROWS}
    earlier = sorted({c["git_commit"] for c in results["kernels"]
                      if c["case"] in shown and _from_earlier_run(c, meta)})
    foot = (["", f"‡ the whole row from the run on commit {', '.join(earlier)}: this run's time budget ended before it."]
            if earlier else [])
    steps = [r.get("git_commit", meta.get("git_commit")) for r in results.get("e2e", [])]
    other = sorted({c for c in steps if c != meta.get("git_commit")})
    steps_note = [f"Training steps from the run on commit {', '.join(other)}.", ""] if other else []
    return "\n".join([head, "", *kernel_table(results), *foot, "", *steps_note, *e2e_table(results)])


def experts_table(results: dict) -> list[str]:
    lines = ["| experts block, forward + backward | autopatch ms | HF grouped_mm ms | grouped-GEMM floor ms | "
             "autopatch % of floor | peak MiB beyond inputs: autopatch / HF |", "|---|---|---|---|---|---|"]
    for row in results.get("experts_block", []):
        ours, hf = row["peers"].get("ours", {}), row["peers"].get("hf_grouped_mm", {})
        if "fwd_bwd_ms" not in ours or "fwd_bwd_ms" not in hf:
            continue
        label = f"{MOE_BLOCKS.get(row['shape'], row['shape'])} ({row['tokens']} tokens × {row['k']} of {row['experts']})"
        lines.append(f"| {label} | **{ours['fwd_bwd_ms']:.2f}** | {hf['fwd_bwd_ms']:.2f} | {row['grouped_floor_ms']:.2f} | "
                     f"{100 * row['grouped_floor_ms'] / ours['fwd_bwd_ms']:.0f} % | "
                     f"{ours['peak_beyond_inputs_gib'] * 1024:.0f} / {hf['peak_beyond_inputs_gib'] * 1024:.0f} |")
    return lines


UNSTEADY = 1.15  # slowest / fastest timed step above this: the peer had not reached a steady state


def _steady(run: dict) -> bool:
    steps = run.get("train_ms") or run["step_ms"]
    return max(steps) <= UNSTEADY * min(steps)


def trl_table(results: dict) -> list[str]:
    """TRL trainer steps: tokens/s and peak GiB per peer, and ours over TRL + Liger (the best peer there).
    A run whose timed steps spread more than UNSTEADY is marked †, its ratio not given."""
    lines = ["| TRL 1.16 trainer step | TRL | TRL + Liger (`use_liger_kernel`) | autopatch (FUSED_KERNELS=all) | "
             "autopatch / TRL + Liger |", "|---|---|---|---|---|"]
    runs = {(r["trainer"], r["model"], r["peer"]): r for r in results.get("trl", []) if r.get("status") == "ok"}
    unsteady = False
    for trainer, trainer_label in TRL_TRAINERS.items():
        for model, model_label in TRL_MODELS.items():
            row = [runs.get((trainer, model, p)) for p in ("trl", "trl_liger", "trl_ours")]
            if not any(row):
                continue
            cells = [_step_cell(r) + ("" if _steady(r) else " †") if r else "–" for r in row]
            unsteady |= any(r and not _steady(r) for r in row)
            steady = row[1] and row[2] and _steady(row[1]) and _steady(row[2])
            ratio = f"{row[2]['tokens_per_s'] / row[1]['tokens_per_s']:.2f}×" if steady else "–"
            r0 = next(r for r in row if r)
            lines.append(f"| {trainer_label}, {model_label} ({r0['batch']}×{r0['seq']} tokens) | "
                         + " | ".join(cells) + f" | {ratio} |")
    if unsteady:
        lines += ["", f"† the timed steps of that run spread more than {UNSTEADY:.2f}× (slowest over fastest; GRPO: "
                      "step minus generation): not a steady state, no ratio."]
    return lines


def step_times(results: dict, models: dict) -> str:
    """One line: each run's median step as the GPU's CUDA events time it and as the host's CPU time."""
    parts = [f"{models[r['model']]} {PEER_NAMES[r['peer']]} {r['step_ms_median']:.0f} / {r['host_cpu_ms_median']:.0f}"
             for r in results.get("e2e", []) if r.get("status") == "ok" and r["model"] in models
             and r.get("host_cpu_ms_median") is not None]
    return "Median step, GPU (CUDA events) / host CPU ms: " + "; ".join(parts) + "."


def render_further(results: dict, path: str) -> str:
    """A further file's tables: the MoE training steps and experts block, the image-text training steps, or
    the TRL trainers' steps."""
    meta = results["meta"]
    commits = sorted({r.get("git_commit", "?") for r in
                      [*results.get("e2e", []), *results.get("experts_block", []), *results.get("trl", [])]})
    if "trl" in results:
        head = (f"TRL {results['trl'][0]['trl']}'s trainers (gradient checkpointing, AdamW fused, bf16; GRPO's "
                f"generation left out of tokens/s), same machine and stack ({meta['gpu']}, torch {meta['torch']}, "
                f"transformers {meta['transformers']}, Liger-Kernel {meta.get('liger_kernel', '–')}); runs on "
                f"commits {', '.join(commits)}. From [{path}]({path}).")
        return "\n".join([head, "", *trl_table(results)])
    models = {r["model"] for r in results.get("e2e", [])}
    what = "Vision-language models" if models & set(VLM_MODELS) else "Mixtures of experts"
    head = (f"{what}, same machine and stack ({meta['gpu']}, torch {meta['torch']}, transformers "
            f"{meta['transformers']}, Liger-Kernel {meta.get('liger_kernel', '–')}); runs on commits "
            f"{', '.join(commits)}, each row's in the file. From [{path}]({path}).")
    if what == "Vision-language models":
        return "\n".join([head, "", *e2e_table(results, VLM_MODELS), "", step_times(results, VLM_MODELS)])
    return "\n".join([head, "", *e2e_table(results, MOE_MODELS), "", *experts_table(results)])


def render_all(files: list[tuple[dict, str]]) -> str:
    """The block for the README: the main results file, then each further file's tables."""
    parts = [render(*files[0])]
    parts += [render_further(results, path) for results, path in files[1:]]
    return "\n\n".join(parts)


def update(readme: str, table: str) -> str:
    if readme.count(BEGIN) != 1 or readme.count(END) != 1 or readme.index(BEGIN) > readme.index(END):
        raise SystemExit(f"readme_table: the README needs one '{BEGIN}' line followed by one '{END}' line")
    head, rest = readme.split(BEGIN)
    _, tail = rest.split(END)
    return f"{head}{BEGIN}\n{table}\n{END}{tail}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="The README's performance tables from the results files.")
    ap.add_argument("results", help="the results JSON written by benchmarks/bench.py")
    ap.add_argument("more", nargs="*", help="further results files: the MoE, vision-language and TRL ones")
    ap.add_argument("--update", metavar="README", help="replace the table block of this file")
    args = ap.parse_args(argv)
    files = []
    for path in [args.results, *args.more]:
        with open(path) as f:
            files.append((json.load(f), path))
    table = render_all(files)
    if args.update:
        with open(args.update) as f:
            text = f.read()
        with open(args.update, "w") as f:
            f.write(update(text, table))
    else:
        sys.stdout.write(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
