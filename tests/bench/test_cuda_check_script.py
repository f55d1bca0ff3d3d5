"""benchmarks/cuda_check.sh runs only where a GPU is lent, so nothing else would notice it rot: every
``python3 -m p2ptrain`` command in it must still parse (its flags exist, its choices are valid), and the
pytest files it names must exist. Parsing only: no command is run."""

from __future__ import annotations

import re
import shlex
import subprocess
import warnings
from pathlib import Path

import click
import pytest

from p2ptrain.cli import main

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "cuda_check.sh"
# the script's loop variables and paths, as one of its iterations has them
VALUES = {"$DEVICE": "cuda", "$precision": "bf16", "$wire": "int8", "$OUT_DIR": "out", "$WORK": "work"}


def _commands(text: str) -> list[list[str]]:
    lines = text.replace("\\\n", " ").splitlines()
    commands = []
    for line in lines:
        if "python3 -m p2ptrain " not in line or line.lstrip().startswith("#"):
            continue
        for name, value in VALUES.items():
            line = line.replace(name, value)
        words = shlex.split(line.split("python3 -m p2ptrain ", 1)[1])
        commands.append(words)
    return commands


def _parse(args: list[str]) -> click.Command:
    """Parse ``args`` as ``p2ptrain`` would, down to the leaf command, without invoking anything."""
    command: click.Command = main
    ctx = main.make_context("p2ptrain", list(args))
    while isinstance(command, click.Group):
        _, command, rest = command.resolve_command(ctx, _unparsed(ctx))
        ctx = command.make_context(command.name, rest, parent=ctx)
    return command


def _unparsed(ctx: click.Context) -> list[str]:
    """What a group's context left for its subcommand (Click 8.2 deprecates ``protected_args``, 9 drops it)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return [*getattr(ctx, "protected_args", []), *ctx.args]


def test_the_scripts_commands_parse_and_its_test_files_exist():
    text = SCRIPT.read_text()
    commands = _commands(text)
    names = sorted({" ".join(c[:2]) if c[0] == "bench" else c[0] for c in commands})
    assert names == ["bench runtime", "swarm", "train"], names
    for args in commands:
        _parse(args)  # a renamed flag or an invalid choice raises click.UsageError naming it
    tests = re.findall(r"tests/[\w/]+\.py", text)
    assert tests and all((REPO / t).is_file() for t in tests), tests


@pytest.mark.parametrize("args, named", [
    (["swarm", "--agents", "4", "--no-such-flag"], "--no-such-flag"),
    (["swarm", "--wire", "int3"], "int3"),
    (["bench", "runtime", "--sizes", "1", "--repeat", "100"], "--repeat"),
])
def test_what_no_longer_parses_is_caught(args, named):
    with pytest.raises(click.UsageError, match=re.escape(named)):
        _parse(args)


def test_the_script_is_valid_bash():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True, timeout=30)
