"""Flags made from config keys (``p2ptrain.cli.config_options``): every option of ``train``, ``swarm`` and
``agent`` sets a config key or is one of the few without; a key with ``option(...)`` becomes a flag of its
type, bounds, help and default; the two ways with defaults."""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass, field
from typing import Literal

import click
import pytest
from click.testing import CliRunner

from p2ptrain.cli.config_options import Flag, OptionTable, build, key_field, merge
from p2ptrain.cli.stage_count import StageCount
from p2ptrain.config import _coerce, option

# the options that set no config key: the command's body reads them (a file, what to print, where to work)
NO_KEY = {
    "train": {"--config", "--save", "--simulate-replicas", "--plan", "--cluster", "--scenario", "--time-scale",
              "--size-factor", "--workdir", "--json"},
    "swarm": {"--json"},
    "agent": {"--config"},
}
SAMPLES = {"AGENT@STEP": "1@2", "AGENT@STEP:SECONDS": "1@2:0.5", "N@STEP": "1@2"}


def _sample(option: click.Option) -> list[str]:
    """Arguments that give ``option`` a value other than none."""
    name, kind = option.opts[0], option.type
    if option.is_flag:
        return [option.secondary_opts[0] if option.secondary_opts else name]
    if option.metavar in SAMPLES:
        value = SAMPLES[option.metavar]
    elif isinstance(kind, click.Choice):
        value = kind.choices[-1]
    elif isinstance(kind, StageCount):
        value = "2"
    elif isinstance(kind, click.IntRange | click.FloatRange):
        low = kind.min if kind.min is not None else 0
        value = str((low + kind.max) / 2 if kind.max is not None else low + 1)
        value = str(int(float(value))) if isinstance(kind, click.IntRange) else value
    elif isinstance(kind, click.Path):
        value = "somewhere"
    else:
        value = "/ip4/127.0.0.1/tcp/1" if option.multiple else "text"
    return [name, value]


@pytest.mark.parametrize("name", sorted(NO_KEY))
def test_every_option_sets_a_config_key_or_is_one_of_the_few_without(name):
    module = importlib.import_module(f"p2ptrain.cli.{name}")
    table: OptionTable = module.OPTIONS
    options = [p for p in module.command.params if isinstance(p, click.Option)]
    assert [o.name for o in options] == [row.param for row in table.rows], "an option added past the table"
    assert {row.name for row in table.rows if row.flag.key is None} == NO_KEY[name]
    for opt, row in zip(options, table.rows, strict=True):
        if row.flag.key is None:
            continue
        _, hint = key_field(table.root, row.flag.key)  # the key exists in the command's config tree
        args = _sample(opt)
        ctx = module.command.make_context(name, args)
        value = table.tree(ctx.params)
        for part in row.flag.key.split("."):
            value = value[part]
        assert value is not None, f"{args} set nothing"
        if name != "swarm":  # their bodies build the config with config_from_dict: the value has the key's type
            _coerce(hint, value, row.flag.key)


def test_the_tables_flags_say_what_their_keys_say():
    from p2ptrain.cli.agent import OPTIONS as AGENT
    from p2ptrain.cli.train import OPTIONS as TRAIN

    steps = {row.name: row for row in TRAIN.rows}["--steps"]
    assert steps.kwargs["help"] == "Optimizer steps.  [default: 10]" and steps.kwargs["type"].min == 1
    stages = {row.name: row for row in AGENT.rows}["--stages"]
    assert isinstance(stages.kwargs["type"], StageCount) and stages.flag.key == "train.stages"


@dataclass(frozen=True)
class Inner:
    rate: float = option(0.5, "A rate.", min=0, max=1)


@dataclass(frozen=True)
class Toy:
    steps: int = option(3, "Steps.", min=1)
    mode: Literal["a", "b"] = option("a", "A mode.")
    fast: bool = option(False, "Go fast.")
    names: tuple[str, ...] = option((), "Names.")
    file: str | None = option(None, "A file.", path="file", default_text="none at all")
    inner: Inner = field(default_factory=Inner)
    bare: int = 7  # no option(): a table that names it must give its Flag a help


def _command(table: OptionTable) -> click.Command:
    @click.command()
    @table.add
    def command(**params: object) -> None:
        click.echo(json.dumps(table.tree(params)))

    return command


def _run(command: click.Command, *args: str):
    return CliRunner().invoke(command, list(args))


def test_a_key_with_option_becomes_a_flag_of_its_type_bounds_help_and_default():
    table = OptionTable(Toy, ["steps", "mode", "fast", "names", "file", "inner.rate", Flag("--count", "bare", help="N.")])
    command = _command(table)
    text = " ".join(_run(command, "--help").output.split())
    for said in ("--steps INTEGER RANGE Steps. [default: 3] [x>=1]", "--mode [a|b] A mode. [default: a]",
                 "--fast / --no-fast Go fast. [default: off]", "--names TEXT Names.",
                 "--file FILE A file. [default: none at all]", "--rate FLOAT RANGE A rate. [default: 0.5] [0<=x<=1]",
                 "--count INTEGER N. [default: 7]"):
        assert said in text
    assert json.loads(_run(command).output) == {}  # flags over a file: none given, none set
    given = _run(command, "--steps", "2", "--fast", "--names", "x", "--names", "y", "--rate", "0.25", "--count", "1")
    assert json.loads(given.output) == {"steps": 2, "fast": True, "names": ["x", "y"], "inner": {"rate": 0.25},
                                        "bare": 1}
    bad = _run(command, "--steps", "0")
    assert bad.exit_code == 2 and "0 is not in the range x>=1" in bad.output
    assert build(Toy, json.loads(given.output) | {"names": ("x",)}) == Toy(steps=2, fast=True, names=("x",),
                                                                          inner=Inner(0.25), bare=1)


def test_with_click_defaults_click_holds_the_keys_defaults():
    table = OptionTable(Toy, ["steps", "mode", "fast", Flag("--quick", "fast"), "inner.rate",
                              Flag(None, "file", click_default=False)], click_defaults=True)
    rows = {row.name: row for row in table.rows}
    assert rows["--steps"].kwargs["default"] == 3 and rows["--steps"].kwargs["show_default"]
    assert rows["--quick"].kwargs["is_flag"] and "default" not in rows["--quick"].kwargs  # a lone flag: off
    assert "default" not in rows["--file"].kwargs and rows["--file"].kwargs["help"] == "A file.  [default: none at all]"
    assert json.loads(_run(_command(table)).output) == {"steps": 3, "mode": "a", "fast": False, "inner": {"rate": 0.5}}


def test_a_key_without_help_or_type_is_refused_naming_it():
    with pytest.raises(TypeError, match="key bare has no help"):
        OptionTable(Toy, ["bare"])
    with pytest.raises(TypeError, match="Toy has no key nope"):
        OptionTable(Toy, ["nope"])
    with pytest.raises(TypeError, match="two flags for parameter"):
        OptionTable(Toy, ["steps", Flag("--steps", "inner.rate")])


def test_flags_go_over_the_file_table_by_table():
    assert merge({"steps": 1, "optimizer": {"lr": 1.0, "beta1": 0.8}}, {"optimizer": {"lr": 2.0}}) == {
        "steps": 1, "optimizer": {"lr": 2.0, "beta1": 0.8}}
