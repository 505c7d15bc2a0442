"""scripts/test.sh's progress lines (scripts/pytest_progress.py): one per finished test file under
pytest-xdist, and pytest's summary still the last line. Run on a small generated suite."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow

SUITE = {
    "test_a.py": "def test_one():\n    pass\n\ndef test_two():\n    pass\n\ndef test_bad():\n    assert 1 == 2\n",
    "test_b.py": "import pytest\n\ndef test_ok():\n    pass\n\n@pytest.mark.skip(reason='x')\ndef test_skipped():\n    pass\n",
}


def run_suite(tmp_path: Path, workers: str) -> list[str]:
    for name, body in SUITE.items():
        (tmp_path / name).write_text(body, encoding="utf-8")
    (tmp_path / "pytest.ini").write_text("[pytest]\n", encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "scripts.pytest_progress", "-p", "no:cacheprovider",
                           "-n", workers, "-c", str(tmp_path / "pytest.ini"), "--rootdir", str(tmp_path),
                           str(tmp_path)], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr  # one test fails on purpose
    return proc.stdout.splitlines()


def test_a_line_per_file_under_xdist(tmp_path):
    lines = run_suite(tmp_path, "2")
    a = [line for line in lines if line.startswith("test_a.py: ")]
    b = [line for line in lines if line.startswith("test_b.py: ")]
    assert len(a) == 1 and len(b) == 1, lines
    assert re.fullmatch(r"test_a\.py: 2 passed, 1 failed  \[ *\d+% of 5 tests, \d+:\d\d\]", a[0]), a[0]
    assert re.fullmatch(r"test_b\.py: 1 passed, 1 skipped  \[ *\d+% of 5 tests, \d+:\d\d\]", b[0]), b[0]
    last = max(a[0], b[0], key=lines.index)  # the file that finished last ends the suite
    assert "[100% of 5 tests" in last
    assert re.fullmatch(r"=+ 1 failed, 3 passed, 1 skipped in [\d.]+s =+", lines[-1]), lines[-1]


def test_silent_without_xdist(tmp_path):
    lines = run_suite(tmp_path, "0")
    assert not [line for line in lines if "% of 5 tests" in line]
    assert re.fullmatch(r"=+ 1 failed, 3 passed, 1 skipped in [\d.]+s =+", lines[-1]), lines[-1]
