"""The optimizer and synchronisation flags ``train``, ``swarm`` and ``agent`` share, and the presets' recipes for
``--help``."""

from __future__ import annotations

from collections.abc import Callable

import click

from p2ptrain.model.hyperparams import RECIPES, described
from p2ptrain.model.lr_schedule import SCHEDULE_KINDS
from p2ptrain.model.outer import SYNC_MODES, DiLoCoConfig

NAMES = ("lr", "lr_schedule", "warmup_steps", "min_lr", "clip")

RECIPES_HELP = ("\b\nOptimizer recipes, where [optimizer] and the flags say nothing (p2ptrain.model.hyperparams):\n"
                + "\n".join(f"  {described(model)}" for model in RECIPES))


def optimizer_options(command: Callable) -> Callable:
    """Add ``--lr``, ``--lr-schedule``, ``--warmup-steps``, ``--min-lr`` and ``--clip`` to ``command``."""
    options = [
        click.option("--lr", type=click.FloatRange(min=0, min_open=True),
                     help="Peak AdamW learning rate.  [default: the preset's]"),
        click.option("--lr-schedule", type=click.Choice(list(SCHEDULE_KINDS)),
                     help="Learning-rate schedule after the warm-up (p2ptrain.model.lr_schedule).  "
                          "[default: the preset's, cosine]"),
        click.option("--warmup-steps", type=click.IntRange(min=0),
                     help="Linear warm-up updates.  [default: the preset's share of the run]"),
        click.option("--min-lr", type=click.FloatRange(min=0),
                     help="The floor cosine, linear and wsd decay to.  [default: a tenth of the peak]"),
        click.option("--clip", type=click.FloatRange(min=0),
                     help="Clip the gradients' global norm over all stages to this (0: off).  [default: 1.0]"),
    ]
    for option in reversed(options):
        command = option(command)
    return command


INIT_FROM_HELP = ("Start from these weights: a Hugging Face folder (GPT2LMHeadModel or LlamaForCausalLM safetensors "
                  "and config.json) or a p2ptrain checkpoint of any shape of the preset's family (the preset gives the recipe).  [default: drawn "
                  "from --seed]")


def optimizer_flags(values: dict[str, object]) -> dict[str, object]:
    """The ``[optimizer]`` keys the flags among ``values`` (a command's keyword arguments) set."""
    return {name: values[name] for name in NAMES if values.get(name) is not None}


SYNC_NAMES = {"inner_steps": "inner_steps", "outer_lr": "outer_lr", "outer_momentum": "outer_momentum",
              "outer_overlap": "overlap", "outer_overlap_steps": "overlap_steps",
              "outer_fragments": "fragments"}  # keyword -> [train.diloco] key


def sync_options(command: Callable) -> Callable:
    """Add ``--sync``, ``--inner-steps``, ``--outer-lr``, ``--outer-momentum``, ``--outer-overlap``,
    ``--outer-overlap-steps`` and ``--outer-fragments`` to ``command``."""
    options = [
        click.option("--sync", type=click.Choice(list(SYNC_MODES)),
                     help="Data-parallel synchronisation: every step, or DiLoCo rounds (p2ptrain.model.outer).  "
                          "[default: every-step]"),
        click.option("--inner-steps", type=click.IntRange(min=1),
                     help=f"DiLoCo: inner steps per round (H).  [default: {DiLoCoConfig.inner_steps}]"),
        click.option("--outer-lr", type=click.FloatRange(min=0, min_open=True),
                     help=f"DiLoCo: the outer Nesterov step's learning rate.  [default: {DiLoCoConfig.outer_lr}]"),
        click.option("--outer-momentum", type=click.FloatRange(min=0, max=1, max_open=True),
                     help=f"DiLoCo: the outer momentum.  [default: {DiLoCoConfig.outer_momentum}]"),
        click.option("--outer-overlap/--no-outer-overlap", "outer_overlap", default=None,
                     help="DiLoCo: run each round's all-reduce beside the next round, each replica starting it from "
                          "its own outer step (p2ptrain.model.outer).  [default: off]"),
        click.option("--outer-overlap-steps", "outer_overlap_steps", type=click.IntRange(min=0),
                     help="DiLoCo with --outer-overlap: the steps of the next round the all-reduce runs beside before "
                          "its mean corrects the replicas (0: the whole round).  [default: 0]"),
        click.option("--outer-fragments", "outer_fragments", type=click.IntRange(min=1),
                     help="DiLoCo: split the parameters into this many fragments (block i in i mod F) whose rounds "
                          "are staggered by H / F steps, each all-reduce carrying 1/F of them (Streaming DiLoCo).  "
                          "[default: 1]"),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def diloco_flags(values: dict[str, object]) -> dict[str, object]:
    """The ``[train.diloco]`` keys the flags among ``values`` (a command's keyword arguments) set."""
    return {key: values[name] for name, key in SYNC_NAMES.items() if values.get(name) is not None}
