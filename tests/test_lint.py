"""The linter runs with the tests: ``ruff check`` (pinned in the test extra, configured in pyproject.toml) on
the package, the tests and the benchmarks, so a change that fails it fails CI."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_finds_nothing():
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    assert ruff is not None, "ruff is not installed (pip install -e '.[test]')"
    done = subprocess.run([ruff, "check", "--no-cache", "p2ptrain", "tests", "benchmarks"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]


def test_no_formatter_markers_without_a_formatter():
    # no formatter runs on this code (the lines are wrapped by hand, up to the linter's 120 columns), so a
    # formatter's markers would only say something untrue
    marker = "fmt" + ": "  # spelled apart, so this file holds none
    found = [f"{path.relative_to(ROOT)}:{n}" for top in ("p2ptrain", "tests", "benchmarks", "agent", "bootstrap", "examples")
             for path in sorted((ROOT / top).rglob("*.py"))
             for n, line in enumerate(path.read_text().splitlines(), 1) if f"# {marker}" in line]
    assert not found, found[:20]
