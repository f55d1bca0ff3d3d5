"""Who is in the run: the live peers, from the verified peer records an agent reads, and when to plan.

A peer is *live* while it has an unexpired, verified peer record (``SwarmDHT.read_peers`` drops invalid,
unsigned and expired entries with a log line) of our protocol version (``records.AGENT_PROTOCOL_VERSION``)
that trains our data (its record's ``data``, the tokenizer and content digest; ``refusal`` says when the run
trains other data). The bootstrap publishes no peer record, so it is never a member. The view is sorted by peer ID, the election order: ``leader`` is the
lowest. Pure bookkeeping, no I/O: the agent feeds it what it reads.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from p2ptrain.agent.config import MembershipConfig
from p2ptrain.agent.leadership.election import membership_digest
from p2ptrain.net.dht.records import AGENT_PROTOCOL_VERSION, PeerRecord

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Membership:
    """The live peers (sorted by peer ID) with their records."""

    peers: Mapping[str, PeerRecord]

    @property
    def ids(self) -> tuple[str, ...]:
        return tuple(sorted(self.peers))

    @property
    def leader(self) -> str | None:
        return min(self.peers, default=None)

    def __len__(self) -> int:
        return len(self.peers)

    def __contains__(self, peer_id: object) -> bool:
        return peer_id in self.peers

    @property
    def digest(self) -> str:
        return membership_digest(self.peers) if self.peers else "-"


class MembershipTracker:
    """Turns successive reads of the peer records into membership views, logging joins and leaves."""

    def __init__(self, me: str, clock: Callable[[], float] = time.monotonic, data: str = ""):
        self.me = me
        self.clock = clock
        self.data = data
        self.other_data: dict[str, str] = {}  # peers left out because they train other data: their data
        self.first_seen: dict[str, float] = {}
        self._current: dict[str, PeerRecord] = {}
        self._refused: set[str] = set()

    def update(self, records: Mapping[str, PeerRecord]) -> Membership:
        live = {}
        for peer_id, record in records.items():
            if record.protocol_version != AGENT_PROTOCOL_VERSION:
                if peer_id not in self._refused:
                    self._refused.add(peer_id)
                    logger.warning(
                        "ignoring peer %s: it speaks protocol %d (p2ptrain %s), we speak %d; upgrade one of us",
                        peer_id, record.protocol_version, record.p2ptrain_version, AGENT_PROTOCOL_VERSION,
                    )  # fmt: skip
                continue
            if record.data != self.data:
                if peer_id not in self.other_data:
                    logger.warning("ignoring peer %s: it trains data %s, we train %s", peer_id,
                                   record.data or "(unsaid)", self.data or "(unsaid)")
                self.other_data[peer_id] = record.data
                continue
            live[peer_id] = record
        now = self.clock()
        for peer_id in live.keys() - self._current.keys():
            self.first_seen.setdefault(peer_id, now)
            if peer_id != self.me:
                record = live[peer_id]
                logger.info("peer %s joined (%s%s, %.2f TFLOP/s)", peer_id, record.device_name,
                            f", {record.region}" if record.region else "", record.tflops)
        for peer_id in self._current.keys() - live.keys():
            self.first_seen.pop(peer_id, None)
            logger.info("peer %s left (its peer record expired)", peer_id)
        self._current = live
        return Membership(dict(sorted(live.items())))

    def refusal(self, plan_signers: Iterable[str]) -> str | None:
        """Why this agent cannot take part (one line), or None: the run's plans are all signed by peers that
        train other data, so the run trains that data, not ours."""
        signers = set(plan_signers)
        theirs = sorted({self.other_data[s] for s in signers if s in self.other_data})
        if not theirs or signers - self.other_data.keys():
            return None
        return (f"this run trains data {', '.join(theirs)} but this agent's is {self.data or '(unsaid)'}: give it "
                "the run's prepared dataset (p2ptrain data info shows a dataset's id)")

    def known_for_s(self, peer_id: str) -> float:
        """How long ``peer_id`` has been live in our view (0 if it is not)."""
        seen = self.first_seen.get(peer_id)
        return 0.0 if seen is None else self.clock() - seen


def plan_trigger(membership: Membership, config: MembershipConfig, waited_s: float) -> str | None:
    """Why the leader may plan now ("4 of 4 expected peers", "join deadline passed with 3 peers"), or None."""
    n = len(membership)
    if config.expect is not None and n >= config.expect:
        return f"{n} of {config.expect} expected peers are live"
    if config.join_deadline_s is not None and waited_s >= config.join_deadline_s and n >= config.min_peers:
        return f"the join deadline of {config.join_deadline_s:.0f} s passed with {n} peers"
    return None
