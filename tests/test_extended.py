"""Scenario modes out of the default run (marker ``extended``, pyproject's addopts) name the cheaper tests that
check the same property, and those tests exist: a mode leaves CI only where something cheaper stays."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _extended_marks() -> list[tuple[str, list[str]]]:
    """(where, covered_by) of every ``pytest.mark.extended(...)`` under tests/."""
    found = []
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "pytest.mark.extended":
                names = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
                found.append((f"{path.relative_to(ROOT)}:{node.lineno}", names))
    return found


def test_every_extended_mode_names_existing_tests_that_stay_in_the_default_run():
    marks = _extended_marks()
    assert marks, "no extended marks found: the parser is broken or the marker gone"
    for where, covered_by in marks:
        assert covered_by, f"{where}: an extended mode must name the tests that cover its property"
        for name in covered_by:
            file, _, function = name.partition("::")
            source = ROOT / file
            assert source.is_file() and f"def {function}(" in source.read_text(), f"{where}: no test {name}"
            assert "pytest.mark.extended" not in _decorators_of(source, function), f"{where}: {name} is extended too"


def _decorators_of(path: Path, function: str) -> str:
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.FunctionDef) and node.name == function:
            return " ".join(ast.unparse(d) for d in node.decorator_list)
    return ""
