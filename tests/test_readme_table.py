"""The README's performance table is exactly what benchmarks/readme_table.py makes from the committed
results file it names: no figure in the README that no file holds."""

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
    path = re.search(r"From \[(benchmarks/results/[^\]]+\.json)\]", block).group(1)
    assert (ROOT / path).is_file()
    import json

    expected = mod.render(json.loads((ROOT / path).read_text()), path)
    assert block == expected.strip(), "README table is stale: run benchmarks/readme_table.py RESULTS --update README.md"
    assert "| RMSNorm 16384×4096 |" in block and "Qwen3-0.6B" in block


def test_update_replaces_only_the_block():
    mod = _script()
    text = f"head\n{mod.BEGIN}\nold\n{mod.END}\ntail\n"
    assert mod.update(text, "new") == f"head\n{mod.BEGIN}\nnew\n{mod.END}\ntail\n"
