"""An honest agent that leads too slowly for its run (for the tests; not a test module).

    python late_leader.py CONFIG    as shipped, but it holds its first plan back until CONFIG.go exists

The test opens the gate once the other agents passed it over and another peer published the run's first
plan: it then publishes its own plan, which nobody follows. Everything else is the agent as shipped: what it
does next (step aside, see the run finish without it, exit) is the product's.
"""

from __future__ import annotations

import sys
from pathlib import Path

from p2ptrain.agent.agent import Agent
from p2ptrain.agent.config import AgentConfig
from p2ptrain.agent.leadership.leader import Leader
from p2ptrain.cli import configure_logging
from p2ptrain.config import config_from_dict, read_toml
from p2ptrain.lifecycle import StopSignal


class LateLeading(Leader):
    gate: Path

    def lead(self, membership) -> None:
        if self._planning is not None and self._planning.future.done() and not self.gate.exists():
            self._note_waiting("late leader: holding the first plan back")
            return
        super().lead(membership)


class LateLeader(Agent):
    _leading_class = LateLeading


def main(config_path: str) -> None:
    configure_logging(1)
    config = config_from_dict(AgentConfig, read_toml(config_path))
    LateLeading.gate = Path(config_path + ".go")
    with StopSignal() as stop:
        LateLeader(config, stop).run()


if __name__ == "__main__":
    main(*sys.argv[1:])
