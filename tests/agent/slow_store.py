"""An agent as shipped whose first peer-record stores time out for real (for the tests; not a test module).

    python slow_store.py CONFIG         its first two stores of its peer record time out
    python slow_store.py plan CONFIG    the first store of a plan it leads times out (its peer record's do not)

A DHT loaded by a crowd starting at once answers a store later than ``[dht] request_timeout_s`` (32 agents on 2
cores: a store timed out at 105 s, and the agent exited). Here the agent's own DHT node waits 0.1 ms for the
first two stores of its peer record (or the first of its plan), so the real call to the real DHT process times out (``SwarmDHT._result``:
``PeerTimeoutError``) whatever the machine; everything else is the agent as shipped.
"""

from __future__ import annotations

import dataclasses
import sys

from p2ptrain.agent.agent import Agent
from p2ptrain.agent.config import AgentConfig
from p2ptrain.cli import configure_logging
from p2ptrain.config import config_from_dict, read_toml
from p2ptrain.lifecycle import StopSignal

TIMED_OUT = 2


def timing_out(dht, publish, times: int):
    """``publish`` (a method of ``dht``) whose first ``times`` calls time out for real."""
    tries = []

    def first_stores_time_out(record):
        tries.append(record)
        real = dht.config
        if len(tries) <= times:
            dht.config = dataclasses.replace(real, request_timeout_s=1e-4)
        try:
            return publish(record)
        finally:
            dht.config = real

    return first_stores_time_out


class SlowPlanStore(Agent):
    """Its first store of a plan times out (the leader's first plan, when it leads)."""

    def _publish_peer_record(self, profile, compute=None) -> None:
        if not getattr(self, "_slow_plans", False):  # at start, before any plan
            self._slow_plans = True
            self.dht.publish_plan = timing_out(self.dht, self.dht.publish_plan, 1)
        super()._publish_peer_record(profile, compute)


class SlowStore(Agent):
    """Its first ``TIMED_OUT`` stores of its peer record time out."""

    def _publish_peer_record(self, profile, compute=None) -> None:
        dht, publish = self.dht, self.dht.publish_peer
        if not getattr(self, "_slow_peers", False):
            self._slow_peers = True
            dht.publish_peer = timing_out(dht, publish, TIMED_OUT)
        try:
            super()._publish_peer_record(profile, compute)
        finally:
            dht.publish_peer = publish


def main(*args: str) -> None:
    what, config_path = ("plan", args[1]) if args[0] == "plan" else ("peer", args[0])
    configure_logging(1)
    config = config_from_dict(AgentConfig, read_toml(config_path))
    with StopSignal() as stop:
        result = (SlowPlanStore if what == "plan" else SlowStore)(config, stop).run()
    sys.exit(0 if result.finished else 1)


if __name__ == "__main__":
    main(*sys.argv[1:])
