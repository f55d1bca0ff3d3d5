"""docs/design.md's option tables of ``p2ptrain train``, ``swarm`` and ``agent``, rendered from the commands'
option tables (``config_options``): a flag's help, type and default are said once, next to its config key.

    python -m p2ptrain.cli.doc_tables --write    # rewrite the three tables in docs/design.md
    python -m p2ptrain.cli.doc_tables            # exit 1, naming the tables that differ

tests/test_design_doc.py fails while a table on the page differs from the rendered one. The prose around
each table is the page's own.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

import click

from p2ptrain.cli.config_options import OptionTable, Row

COMMANDS = ("train", "swarm", "agent")
DOC = Path(__file__).resolve().parents[2] / "docs" / "design.md"
NOTE = "<!-- generated from the config keys' help: python -m p2ptrain.cli.doc_tables --write -->"


def option_table(command: str) -> OptionTable:
    return importlib.import_module(f"p2ptrain.cli.{command}").OPTIONS


def render(command: str) -> str:
    """The markdown table of ``p2ptrain <command>``'s options: option, config key (commands that read
    ``--config``), default (— : none; the file's value or the config's default applies) and meaning."""
    table = option_table(command)
    keys = any(flag.name == "--config" for flag in table.flags)
    head = ["option", "config key", "default", "meaning"] if keys else ["option", "default", "meaning"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in table.rows:
        metavar = row.kwargs.get("metavar")
        cells = [f"`{row.name}{' ' + metavar if metavar else ''}`"]
        if keys:
            cells.append(f"`{row.flag.key}`" if row.flag.key else "—")
        cells += [_default(row), _meaning(row)]
        lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return "\n".join(lines)


def _default(row: Row) -> str:
    if row.default is None:
        flag = row.kwargs.get("is_flag") or "/" in row.name
        return "off" if flag and row.kwargs.get("default") is None else "—"
    return f"`{row.default}`" if row.literal and row.default not in ("on", "off") else row.default


def _meaning(row: Row) -> str:
    meaning, kind = row.meaning, row.kwargs.get("type")
    if isinstance(kind, click.Choice):
        meaning += f" One of {', '.join(f'`{c}`' for c in kind.choices)}."
    if row.kwargs.get("multiple") and "repeatable" not in meaning:
        meaning += " Repeatable."
    return meaning


def _table_span(lines: list[str], command: str) -> tuple[int, int]:
    """The lines [start, end) of the first table in the section of ``p2ptrain <command>`` (its note included)."""
    heading = f"#### `p2ptrain {command}`"
    if heading not in lines:
        raise ValueError(f"docs/design.md has no heading {heading!r}")
    i = lines.index(heading) + 1
    while i < len(lines) and not lines[i].startswith("|"):
        if lines[i].startswith("#"):
            raise ValueError(f"the section {heading!r} of docs/design.md has no table")
        i += 1
    start = i - 1 if lines[i - 1] == NOTE else i
    end = i
    while end < len(lines) and lines[end].startswith("|"):
        end += 1
    return start, end


def table_on_page(page: str, command: str) -> str:
    """The option table of ``p2ptrain <command>`` as the page has it."""
    lines = page.splitlines()
    start, end = _table_span(lines, command)
    return "\n".join(line for line in lines[start:end] if line != NOTE)


def rewritten(page: str) -> str:
    """``page`` with the three option tables rendered afresh (each below a note that says how)."""
    lines = page.splitlines()
    for command in COMMANDS:
        start, end = _table_span(lines, command)
        lines[start:end] = [NOTE, *render(command).splitlines()]
    return "\n".join(lines) + ("\n" if page.endswith("\n") else "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m p2ptrain.cli.doc_tables", description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="rewrite the tables in the page")
    parser.add_argument("--doc", type=Path, default=DOC, help="the page (default: docs/design.md)")
    args = parser.parse_args(argv)
    page = args.doc.read_text()
    if args.write:
        args.doc.write_text(rewritten(page))
        return 0
    stale = [c for c in COMMANDS if table_on_page(page, c) != render(c)]
    for command in stale:
        print(f"{args.doc}: the option table of p2ptrain {command} differs from its flags; run "
              "python -m p2ptrain.cli.doc_tables --write", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
