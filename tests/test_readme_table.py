"""The README's performance tables are exactly what benchmarks/readme_table.py makes from the committed
results files they name: no figure in the README that no file holds."""

import importlib.util
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location("readme_table", ROOT / "benchmarks" / "readme_table.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_readme_table_is_regenerated_from_the_committed_results_file():
    mod = _script()
    readme = (ROOT / "README.md").read_text()
    block = readme.split(mod.BEGIN)[1].split(mod.END)[0].strip()
    paths = re.findall(r"From \[(benchmarks/results/[^\]]+\.json)\]", block)
    assert paths and all((ROOT / p).is_file() for p in paths)
    import json

    expected = mod.render_all([(json.loads((ROOT / p).read_text()), p) for p in paths])
    assert block == expected.strip(), "README table is stale: run benchmarks/readme_table.py RESULTS... --update README.md"
    assert "| RMSNorm 16384×4096 |" in block and "Qwen3-0.6B" in block
    assert "Qwen3-30B-A3B" in block and "grouped-GEMM floor" in block
    assert "Qwen2.5-VL-3B" in block and "FUSED_KERNELS=all" in block
    assert "| SFT, Qwen3-0.6B (4×4096 tokens) |" in block and "TRL + Liger" in block


def test_update_replaces_only_the_block():
    mod = _script()
    text = f"head\n{mod.BEGIN}\nold\n{mod.END}\ntail\n"
    assert mod.update(text, "new") == f"head\n{mod.BEGIN}\nnew\n{mod.END}\ntail\n"


def test_trl_rows_that_never_settled_get_no_ratio():
    mod = _script()

    def run(peer, steps):
        return {"trainer": "sft", "model": "qwen3_0.6b", "peer": peer, "status": "ok", "batch": 4, "seq": 4096,
                "tokens_per_s": 16384 / (sorted(steps)[len(steps) // 2] * 1e-3), "peak_gib": 5.5, "step_ms": steps}

    steady = {"trl": [run("trl", [430, 432]), run("trl_liger", [290, 291]), run("trl_ours", [240, 242])]}
    assert "| 1.2" in mod.trl_table(steady)[2] and "†" not in "".join(mod.trl_table(steady))
    falling = {"trl": [run("trl", [430, 432]), run("trl_liger", [420, 450, 288]), run("trl_ours", [240, 242])]}
    table = mod.trl_table(falling)
    assert table[2].endswith("| – |") and "5.5 GiB †" in table[2] and table[-1].startswith("† ")


def test_footnotes_name_only_what_the_table_shows():
    """A kernel row kept from an earlier run gets its ‡ only when the table shows it; training steps from
    another commit than the kernels' are named above their table."""
    mod = _script()
    name = mod.KERNEL_ROWS[0][0]

    def case(case_name, **extra):
        ok = {"status": "ok", "modes": {mod.MODE: {"gpu_ms": 1.0, "ms": 1.2, "peak_mib": 1, "gpu_frac_ceiling": 0.9}}}
        return dict(case=case_name, peers={"ours": ok, "liger": ok}, **extra)

    meta = {"gpu": "G", "torch": "t", "triton": "tr", "transformers": "tf", "git_commit": "new1", "date_utc": "2026-12-04"}
    ceil = {"copy_gbps": 4000, "matmul_tflops": 600}
    hidden = {"meta": meta, "ceilings": ceil, "kernels": [case(name), case("not shown", git_commit="old1")], "e2e": []}
    text = mod.render(hidden, "r.json")
    assert "‡" not in text and "old1" not in text
    kept = dict(hidden, kernels=[case(name, git_commit="old1")],
                e2e=[{"model": "m", "peer": "ours", "status": "ok", "git_commit": "old2"}])
    text = mod.render(kept, "r.json")
    assert " ‡ |" in text and "commit old1: this run's time budget" in text
    assert "Training steps from the run on commit old2." in text
