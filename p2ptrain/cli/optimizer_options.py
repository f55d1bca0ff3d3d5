"""The optimizer and synchronisation flags ``train``, ``swarm`` and ``agent`` share (rows of their option tables,
``config_options``), and the presets' recipes for ``--help``.

They only override: click holds no default for them, and a flag not given leaves its key to the config file
or the preset's recipe, in every command.
"""

from __future__ import annotations

from p2ptrain.cli.config_options import Flag
from p2ptrain.model.hyperparams import RECIPES, described

RECIPES_HELP = ("\b\nOptimizer recipes, where [optimizer] and the flags say nothing (p2ptrain.model.hyperparams):\n"
                + "\n".join(f"  {described(model)}" for model in RECIPES))


def optimizer_flags(prefix: str = "") -> list[Flag]:
    """``--lr``, ``--lr-schedule``, ``--warmup-steps``, ``--min-lr`` and ``--clip``: keys of the optimizer table of
    the training table at ``prefix`` (``""``: the root's, ``"train."``: the agent's)."""
    return [Flag(None, f"{prefix}optimizer.{name}", click_default=False)
            for name in ("lr", "lr_schedule", "warmup_steps", "min_lr", "clip")]


def sync_flags(prefix: str = "") -> list[Flag]:
    """``--sync``, ``--inner-steps``, ``--outer-lr``, ``--outer-momentum``, ``--outer-overlap``,
    ``--outer-overlap-steps`` and ``--outer-fragments``: ``sync`` and the DiLoCo table of the training table at
    ``prefix``."""
    diloco = f"{prefix}diloco."
    return [Flag(name, key, click_default=False) for name, key in (
        (None, f"{prefix}sync"), (None, f"{diloco}inner_steps"), (None, f"{diloco}outer_lr"),
        (None, f"{diloco}outer_momentum"), ("--outer-overlap/--no-outer-overlap", f"{diloco}overlap"),
        ("--outer-overlap-steps", f"{diloco}overlap_steps"), ("--outer-fragments", f"{diloco}fragments"))]
