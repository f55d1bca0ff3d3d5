"""``--stages S|auto``: the click type shared by ``p2ptrain plan``, ``agent`` and ``swarm``."""

from __future__ import annotations

import click


class StageCount(click.ParamType):
    """``--stages``: a positive integer, or ``auto`` (the planner, or the run's leader, chooses)."""

    name = "S|auto"

    def convert(self, value, param, ctx):
        if value == "auto":
            return value
        try:
            stages = value if isinstance(value, int) else int(value)
        except ValueError:
            self.fail(f"{value!r} is not a valid integer or 'auto'", param, ctx)
        if stages < 1:
            self.fail(f"{stages} is not a positive number of stages", param, ctx)
        return stages
