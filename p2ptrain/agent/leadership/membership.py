"""Who is in the run: the live peers, from the verified peer records an agent reads, and when to plan.

A peer is *live* while it has an unexpired, verified peer record (``SwarmDHT.read_peers`` drops invalid,
unsigned and expired entries with a log line) of our protocol version (``records.AGENT_PROTOCOL_VERSION``)
that trains our data with our run settings (its record's ``data``, the tokenizer and content digest, and
``settings``, ``leadership.settings``; ``refusal`` says when the run is another: several live peers agree on
other data or settings, more than share ours). The bootstrap publishes no peer record, so it is never a
member. The view is sorted by peer ID, the election order: ``leader`` is the lowest in standing
(``leadership.standing``). Pure bookkeeping, no I/O: the agent feeds it what it reads.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from p2ptrain.agent.config import MembershipConfig
from p2ptrain.agent.leadership.election import membership_digest
from p2ptrain.agent.leadership.settings import described
from p2ptrain.agent.leadership.standing import Standing
from p2ptrain.net.dht.records import AGENT_PROTOCOL_VERSION, PeerRecord

logger = logging.getLogger(__name__)

MAJORITY_OF_OTHERS = 2  # other live peers that must agree on another run before an agent refuses to take part


@dataclass(frozen=True)
class Membership:
    """The live peers (sorted by peer ID) with their records; with ``standing``, who may lead
    (``leadership.standing``: the lowest live peer in standing), else the lowest live peer leads."""

    peers: Mapping[str, PeerRecord]
    standing: Standing | None = field(default=None, compare=False)

    @property
    def ids(self) -> tuple[str, ...]:
        return tuple(sorted(self.peers))

    @property
    def leader(self) -> str | None:
        if self.standing is not None:
            return self.standing.leader(self.peers)
        return min(self.peers, default=None)

    def without(self, *peer_ids: str) -> Membership:
        """This view less ``peer_ids`` (the same standing)."""
        return Membership({p: r for p, r in self.peers.items() if p not in peer_ids}, self.standing)

    def __len__(self) -> int:
        return len(self.peers)

    def __contains__(self, peer_id: object) -> bool:
        return peer_id in self.peers

    @property
    def digest(self) -> str:
        return membership_digest(self.peers) if self.peers else "-"


class MembershipTracker:
    """Turns successive reads of the peer records into membership views, logging joins and leaves.

    ``data`` and ``settings``: what this agent trains (its dataset's identity, ``model.data.data_identity``,
    and its run settings, ``settings.identity``); a peer whose record says otherwise is not a member of our
    run. Who is wrong is decided by numbers, never by one peer's word (``refusal``)."""

    def __init__(self, me: str, clock: Callable[[], float] = time.monotonic, data: str = "", settings: str = ""):
        self.me = me
        self.clock = clock
        self.data = data
        self.settings = settings
        self.other_data: dict[str, str] = {}  # peers left out because they train other data: their data
        self.others: dict[str, tuple[str, str]] = {}  # live peers of another run now: their (data, settings)
        self.first_seen: dict[str, float] = {}
        self._current: dict[str, PeerRecord] = {}
        self._refused: set[str] = set()
        self._noted: set[tuple[str, str, str]] = set()

    def update(self, records: Mapping[str, PeerRecord]) -> Membership:
        live, others = {}, {}
        for peer_id, record in records.items():
            if record.protocol_version != AGENT_PROTOCOL_VERSION:
                if peer_id not in self._refused:
                    self._refused.add(peer_id)
                    logger.warning(
                        "ignoring peer %s: it speaks protocol %d (p2ptrain %s), we speak %d; upgrade one of us",
                        peer_id, record.protocol_version, record.p2ptrain_version, AGENT_PROTOCOL_VERSION,
                    )
                continue
            if (record.data, record.settings) != (self.data, self.settings):
                if (peer_id, record.data, record.settings) not in self._noted:
                    self._noted.add((peer_id, record.data, record.settings))
                    logger.warning("ignoring peer %s: %s", peer_id, self._difference(record.data, record.settings))
                if record.data != self.data:
                    self.other_data[peer_id] = record.data
                others[peer_id] = (record.data, record.settings)
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
        self._current, self.others = live, others
        return Membership(dict(sorted(live.items())))

    def refusal(self) -> str | None:
        """Why this agent cannot take part (one line), or None: at least ``MAJORITY_OF_OTHERS`` other live peers
        agree on a dataset or settings other than ours, and they outnumber the live peers that share ours. One
        peer's claim is never enough (a rogue that says the run trains other data); we keep training with
        those who share ours."""
        counts: dict[tuple[str, str], int] = {}
        for theirs in self.others.values():
            counts[theirs] = counts.get(theirs, 0) + 1
        ours = len(self._current.keys() - {self.me})
        run, n = max(counts.items(), key=lambda item: item[1], default=(None, 0))
        if run is None or n < MAJORITY_OF_OTHERS or n <= ours:
            return None
        data, settings = run
        hint = ("give it the run's prepared dataset (p2ptrain data info shows a dataset's id)" if data != self.data
                else "set them in its [train] config as the run's agent config does")
        return f"{n} live peers agree that {self._difference(data, settings)}: {hint}"

    def _difference(self, data: str, settings: str) -> str:
        parts = []
        if data != self.data:
            parts.append(f"this run trains data {data or '(unsaid)'} but this agent's is {self.data or '(unsaid)'}")
        if settings != self.settings:
            parts.append(f"this run trains with {described(settings, self.settings)} but this agent's settings "
                         f"are {described(self.settings, settings)}")
        return "; ".join(parts)

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
