"""Members that misbehave, for the tests of untrusted peers (not a test module).

    python rogue_member.py swallow CONFIG
    python rogue_member.py swallow_and_halt CONFIG
    python rogue_member.py claim_and_swallow CONFIG
    python rogue_member.py boast_compute CONFIG

Each runs the real agent, with a real identity and real streams. ``swallow`` claims what no device has
(9 PFLOP/s, 8000 GB, and in its links row 0.01 ms and 900 Gbit/s to everyone) and, once a plan gives it a
stage, never trains: it takes the tensors sent to it and answers nothing, and it never halts. It answers
pings (its transport does), so heartbeats alone never call it dead. ``swallow_and_halt`` claims nothing
special and swallows tensors the same way, but halts once another peer published a halted heartbeat for
its epoch (blaming nobody; a spare's that says which copies it keeps counts too, so it often halts at the
epoch's start, long before the others' calls time out), so it is never left out for not halting: it takes
up every plan that names it. Its heartbeat answers never say it trains, so its peers find it a no-show
within seconds. ``claim_and_swallow`` is the same, but its heartbeat answers say it trains the epoch (waiting
on nobody, having sent nothing): found once its peers' first messages went out long enough ago. ``boast_compute`` trains honestly but publishes a calibration ``BOAST`` (1000) times
faster than its device measured: far beyond what load does to an honest peer's speed (CI saw 11x).
"""

from __future__ import annotations

import dataclasses
import sys

from p2ptrain.agent.agent import Agent
from p2ptrain.agent.config import AgentConfig
from p2ptrain.agent.epoch import EpochOutcome
from p2ptrain.cli import configure_logging
from p2ptrain.config import config_from_dict, read_toml
from p2ptrain.errors import ProtocolError
from p2ptrain.lifecycle import StopSignal
from p2ptrain.net.dht.records import LinkMeasurement, LinksRecord, ProgressRecord
from p2ptrain.net.transport.status import TRAIN, PeerStatus

BOAST = 1000.0


class Swallower(Agent):
    def _publish_peer_record(self, profile, compute=None) -> None:
        publish_links = self.dht.publish_links

        def boast(record: LinksRecord) -> bool:
            peers = record.resolve(self._membership.ids)
            return publish_links(LinksRecord.from_peers({p: LinkMeasurement(0.01, 900.0) for p in peers}))

        self.dht.publish_links = boast
        super()._publish_peer_record(dataclasses.replace(profile, tflops=9000.0, memory_gb=8000.0), compute)

    def _follow(self, plan, device) -> EpochOutcome:
        self._following = plan
        self._admit_senders(self._membership, plan)
        self._note_waiting(f"rogue: given epoch {plan.epoch}; taking tensors and answering nothing")
        self.stop.wait()
        return EpochOutcome(False, 0)


class CooperativeSwallower(Agent):
    def _follow(self, plan, device) -> EpochOutcome:
        self._following = plan
        self._admit_senders(self._membership, plan)
        self._note_waiting(f"rogue: given epoch {plan.epoch}; taking tensors, answering nothing, halting when told")
        while not self.stop.wait(self.config.membership.poll_s):
            try:
                progress = self.dht.read_progress()
            except ProtocolError:
                continue
            if any(r.epoch == plan.epoch and r.halted for p, r in progress.items() if p != self.peer_id):
                self.heartbeat.flush(ProgressRecord(plan.epoch, plan.start_step, None, 0.0, halted=True))
                return EpochOutcome(False, 0, halted=True)
        return EpochOutcome(False, 0)


class ClaimingSwallower(CooperativeSwallower):
    def _follow(self, plan, device) -> EpochOutcome:
        self.transport.status = PeerStatus(TRAIN, plan.epoch, plan.start_step)
        return super()._follow(plan, device)


class ComputeBoaster(Agent):
    def _calibrate(self, device):
        c = super()._calibrate(device)
        return dataclasses.replace(c, layer_s=tuple(t / BOAST for t in c.layer_s),
                                   embed_s=tuple(t / BOAST for t in c.embed_s), head_s=tuple(t / BOAST for t in c.head_s),
                                   update_s_per_mparam=c.update_s_per_mparam / BOAST)


def main(mode: str, config_path: str) -> None:
    configure_logging(1)
    config = config_from_dict(AgentConfig, read_toml(config_path))
    with StopSignal() as stop:
        {"swallow": Swallower, "swallow_and_halt": CooperativeSwallower, "claim_and_swallow": ClaimingSwallower,
     "boast_compute": ComputeBoaster}[mode](config, stop).run()


if __name__ == "__main__":
    main(*sys.argv[1:])
