"""What a peer says about itself when pinged: the liveness protocol's payload (pure; no I/O).

Heartbeats are separate from data: a small ``rpc_ping`` on the transport answers at once from the
transport's event loop, whatever the training thread is doing, with the answerer's ``PeerStatus``. A ping
that gets no answer says the peer is dead or cut off (``churn.liveness`` decides when); an answer says
where the peer is, so a failure one trainer noticed spreads to the others in one ping round instead of
one data deadline.

States: ``idle`` (no epoch being trained: waiting for a plan, a spare, or done), ``take`` (taking up epoch
``epoch``: it read the plan and checks it; a trainer leaves this state for ``train`` or, refusing the plan, for
what it said before), ``train`` (training epoch
``epoch``, ``step`` steps done), ``fail`` (stopped epoch ``epoch`` because a call or a peer failed: the
others of that epoch should stop waiting for it), ``halt`` (stopped epoch ``epoch`` at a re-plan point,
cleanly: nothing to propagate).

Two more fields say where a trainer's epoch stands inside a step, filled in by the transport as it answers:
``sent``, the training messages (``STUCK_KINDS``) of epoch ``epoch`` its receivers accepted, and ``waits``, the
peer its oldest call of that epoch still in flight waits on ("" when none: it computes, or idles). A trainer
that says it trains, waits on nobody and has sent nothing while its peers' first messages went out long ago
never takes its stage up (``churn.liveness.StallWatch``).

Two more say what the peer read of the run, so that the others read the records only when they changed:
``plan``, the epoch of the newest plan it knows of, published as leader or read (-1: none; left out of the answer
then), and ``peers``, a 32-bit digest of the peer records it read last (``peers_digest``; -1: none). A follower
reads the plan records when a peer it pings knows of a newer plan than it read (``leadership.following``), and
the peer records when its leader's digest is not its own (``agent.membership_reader``): a plan and a join reach
the run through the heartbeats, not through n reads a second. And ``refused``, the epoch of the newest plan the peer
refused (-1: none; left out then): a member that waits for a plan's checkers' word (``leadership.checkers``) checks
the plan itself as soon as a checker it pings says it refused a plan of that epoch, not after ``plan.time_budget_s``.
And ``search``, the whole seconds the peer's own search of the run's first plan has run so far, or took (-1: it made
none; left out then; at most ``MAX_SEARCH_S``): a member that is no checker gives a leader late with its first plan as
long as its checkers say their searches of the same records take (``leadership.watching``), instead of searching too.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass

IDLE, TAKE, TRAIN, FAIL, HALT = "idle", "take", "train", "fail", "halt"
STATES = (IDLE, TAKE, TRAIN, FAIL, HALT)
MAX_STATUS_BYTES = 320
MAX_COUNTER = 2**53
MAX_PEER_CHARS = 128
MAX_DIGEST = 2**32 - 1
MAX_SEARCH_S = 86_400  # a day: no search of a plan is longer


class Announced:
    """What this peer says in its ping answers of what it read of the run (``PeerStatus.plan``, ``peers``):
    written by the agent's threads (one attribute each), read by the transport's loop as it answers."""

    def __init__(self) -> None:
        self.plan = self.peers = self.refused = self.search = -1

    def on(self, status: PeerStatus) -> PeerStatus:
        if self.plan < 0 and self.peers < 0 and self.refused < 0 and self.search < 0:
            return status
        return dataclasses.replace(status, plan=self.plan, peers=self.peers, refused=self.refused, search=self.search)


def peers_digest(records: Mapping[str, object]) -> int:
    """A 32-bit digest of peer records by peer ID (each with ``encode()``): equal for equal reads."""
    h = hashlib.blake2b(digest_size=4)
    for peer in sorted(records):
        h.update(peer.encode())
        h.update(records[peer].encode())  # type: ignore[attr-defined]
    return int.from_bytes(h.digest(), "big")


@dataclass(frozen=True)
class PeerStatus:
    state: str = IDLE
    epoch: int = 0
    step: int = 0
    sent: int = 0  # training messages of ``epoch`` accepted by their receivers
    waits: str = ""  # the peer our oldest call of ``epoch`` in flight waits on ("": none)
    plan: int = -1  # the epoch of the newest plan this peer knows of (-1: none)
    peers: int = -1  # a digest of the peer records it read last (``peers_digest``; -1: none)
    refused: int = -1  # the epoch of the newest plan this peer refused (-1: none)
    search: int = -1  # seconds its own search of the run's first plan has run, or took (-1: none)

    def __post_init__(self) -> None:
        if self.state not in STATES:
            raise ValueError(f"status state {self.state!r} is not one of {', '.join(STATES)}")
        if not isinstance(self.waits, str) or len(self.waits) > MAX_PEER_CHARS:
            raise ValueError(f"status waits must be a peer ID of at most {MAX_PEER_CHARS} characters")
        for name in ("epoch", "step", "sent"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_COUNTER:
                raise ValueError(f"status {name} must be an integer in 0..{MAX_COUNTER}, got {value!r}")
        for name, high in (("plan", MAX_COUNTER), ("peers", MAX_DIGEST), ("refused", MAX_COUNTER), ("search", MAX_SEARCH_S)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not -1 <= value <= high:
                raise ValueError(f"status {name} must be an integer in -1..{high}, got {value!r}")

    def encode(self) -> bytes:
        fields = {"state": self.state, "epoch": self.epoch, "step": self.step, "sent": self.sent, "waits": self.waits}
        fields.update((name, getattr(self, name)) for name in ("plan", "peers", "refused", "search")
                      if getattr(self, name) >= 0)
        return json.dumps(fields, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, data: bytes) -> PeerStatus:
        """The status in a ping reply; ValueError (one line) for anything malformed."""
        if len(data) > MAX_STATUS_BYTES:
            raise ValueError(f"status of {len(data)} bytes exceeds {MAX_STATUS_BYTES}")
        try:
            m = json.loads(data)
        except (UnicodeDecodeError, ValueError):
            raise ValueError("status is not JSON") from None
        if not isinstance(m, dict):
            raise ValueError("status is not a JSON object")
        try:
            return cls(m.get("state"), m.get("epoch"), m.get("step"), m.get("sent", 0), m.get("waits", ""),
                       m.get("plan", -1), m.get("peers", -1), m.get("refused", -1), m.get("search", -1))
        except TypeError:
            raise ValueError("status has the wrong fields") from None
