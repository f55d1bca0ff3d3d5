"""An agent as shipped that joins its run once a gate file exists (for the tests; not a test module).

    python gated_agent.py CONFIG    publishes its peer record once CONFIG.go exists

What makes a process slow to join (its imports, the device profile, a calibration, its DHT node and p2pd)
happens before the gate: the test decides when the run sees a joiner, to within a DHT read, on a machine
however busy. Everything after is the agent as shipped.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from p2ptrain.agent.agent import Agent
from p2ptrain.agent.config import AgentConfig
from p2ptrain.cli import configure_logging
from p2ptrain.config import config_from_dict, read_toml
from p2ptrain.lifecycle import StopSignal

GATE_TIMEOUT_S = 300.0


class GatedAgent(Agent):
    gate: Path

    def _publish_peer_record(self, profile, compute=None) -> None:
        deadline = time.monotonic() + GATE_TIMEOUT_S
        while not self.gate.exists():
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.gate} did not appear within {GATE_TIMEOUT_S:.0f} s")
            if self.stop.wait(0.1):
                return
        super()._publish_peer_record(profile, compute)


def main(config_path: str) -> None:
    configure_logging(1)
    config = config_from_dict(AgentConfig, read_toml(config_path))
    with StopSignal() as stop:
        agent = GatedAgent(config, stop)
        agent.gate = Path(config_path + ".go")
        agent.run()


if __name__ == "__main__":
    main(*sys.argv[1:])
