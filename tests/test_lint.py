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
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
