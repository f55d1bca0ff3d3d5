"""Quarantine: a peer that failed an epoch stays out of the next plans for a while (the leader's; pure).

A failure re-plan names its likely causes (``Replan.culprits``): trainers that died, trainers that neither
trained nor halted within ``churn.halt_timeout_s`` (the leader never waits on a peer's own cooperation
longer than that; unless they are more than half the trainers: honest peers being the many, such a failure is
the run's, ``churn.replan``), and peers a halted trainer blamed for its failed call. Each is left out of the plans for
``quarantine_s``, doubled at every repeat up to ``quarantine_max_s``, so a peer that keeps failing runs
costs the run one failed epoch, then fewer and fewer; a peer that failed once (an honest transient
failure: a reboot, a lost connection) comes back as a joiner when its back-off ends. Repeats are forgotten
after ``quarantine_max_s`` without a failure.

Blame alone does not make a culprit (timeouts cascade: an honest peer stuck behind a failure is blamed
too), so a member that takes tensors, answers nothing and then halts like everyone else would fail every
epoch it is given. ``blame`` counts the distinct epochs a peer was blamed for: blamed in ``blame_epochs``
of them within ``blame_window_s``, it is quarantined like a culprit (with the same growing back-off). A
peer blamed once (an honest neighbour of a failure) is only counted. The tally is the leader's own: a new
leader starts counting afresh.

Two members that refused each other without evidence (``churn.replan.disputes_of``: word against word) are each
blamed, but counted by *counterpart*, not by epoch: one of the two is lying (or its wire is), and nobody can say
which. ``dispute`` tallies each one's distinct counterparts within ``blame_window_s``, and the leader keeps
every disputed pair apart in its plans (``apart``; ``plan_maker.kept_apart``): a rogue that disputes with
whoever it meets meets someone new and reaches ``blame_epochs`` counterparts, while each honest peer it
disputed with has one. (Counted by epoch, a pair planned together again failed twice, and the honest one was
quarantined with the rogue.) A count is not enough where rogues collude: two of them that disputed with H4 and H5,
then, re-paired, with H3 and H4, give H4 two counterparts as each has. So a peer that reached the count on
disputes alone goes only if it is in every smallest set of liars that puts one at an end of every live dispute
(``explained``; ``churn.cover``): H3 – R1 – H4 – R2 – H5 is explained by {R1, R2} alone. A quarantine explains
the disputes before it (``live_disputes``). Colluders can frame a peer this way only by each disputing with it
and with nobody else: ``blame_epochs`` of them.

A leader that cannot re-plan yet (too few peers) reads the same failure again at every poll: each failed
epoch costs a peer one strike and one blame, however often it is read.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable

from p2ptrain.agent.churn.cover import essential


class Quarantine:
    def __init__(self, base_s: float, max_s: float, clock: Callable[[], float] = time.monotonic, *,
                 blame_epochs: int = 2, blame_window_s: float = 900.0):
        self.base_s = base_s
        self.max_s = max_s
        self.clock = clock
        self.blame_epochs = blame_epochs
        self.blame_window_s = blame_window_s
        self._until: dict[str, float] = {}
        self._strikes: dict[str, tuple[int, float]] = {}  # peer -> (failures, when the last one was)
        self._blamed: dict[str, dict[int, float]] = {}  # peer -> {epoch it was blamed for: when}
        self._charged: set[tuple[str, int, str]] = set()  # (peer, epoch, "failed" | "blamed") already counted
        self._disputes: dict[frozenset[str], dict[int, float]] = {}  # pairs that refused each other: epoch -> when
        self._forgotten: dict[str, float] = {}  # peer -> when its disputes last quarantined it
        self._proven: dict[str, float] = {}  # peer -> when it was quarantined on a proof (``add(proven=True)``)
        self._inherited: dict[frozenset[str], float] = {}  # pairs a predecessor's plan kept apart -> when read

    def add(self, peer: str, epoch: int, proven: bool = False) -> float | None:
        """Quarantine ``peer`` for failing epoch ``epoch``; returns its back-off in seconds, or None when that
        epoch's failure already quarantined it (one strike per failed epoch). ``proven``: on evidence that held
        or the leader's own finding, not on a count: the disputes it had are explained (``counterparts``)."""
        if proven:
            self._proven[peer] = self.clock()
        if (peer, epoch, "failed") in self._charged:
            return None
        self._charged.add((peer, epoch, "failed"))
        self._forget(peer)
        now = self.clock()
        strikes, last = self._strikes.get(peer, (0, now))
        if now - last > self.max_s:
            strikes = 0
        backoff = min(self.max_s, self.base_s * 2**strikes)
        self._strikes[peer] = (strikes + 1, now)
        self._until[peer] = max(self._until.get(peer, 0.0), now + backoff)
        return backoff

    def held(self) -> set[str]:
        now = self.clock()
        for peer in [p for p, until in self._until.items() if until <= now]:
            del self._until[peer]
        return set(self._until)

    def remaining_s(self, peer: str) -> float:
        return max(0.0, self._until.get(peer, 0.0) - self.clock())

    def without(self, peers: Iterable[str]) -> tuple[str, ...]:
        held = self.held()
        return tuple(p for p in peers if p not in held)

    def blame(self, peer: str, epoch: int) -> int | None:
        """Count that ``peer`` was blamed for epoch ``epoch``'s failure; returns the distinct epochs it was
        blamed for within ``blame_window_s`` plus the peers it disputed with (``dispute``), or None when this epoch's blame was counted already (a repeat
        report of one epoch counts once). The caller quarantines it (``add``) once that reaches
        ``blame_epochs``; the count then starts over."""
        if (peer, epoch, "blamed") in self._charged:
            return None
        self._charged.add((peer, epoch, "blamed"))
        now = self.clock()
        epochs = self._blamed_epochs(peer)
        epochs.setdefault(epoch, now)
        self._blamed[peer] = epochs
        count = len(epochs) + len(self.counterparts(peer))
        if count >= self.blame_epochs:
            self._forget(peer)
        return count

    def _blamed_epochs(self, peer: str) -> dict[int, float]:
        now = self.clock()
        return {e: t for e, t in self._blamed.get(peer, {}).items() if now - t <= self.blame_window_s}

    def _forget(self, peer: str) -> None:
        """``peer`` reached the count: its blames and disputes start over (the pairs stay apart)."""
        self._blamed.pop(peer, None)
        self._forgotten[peer] = self.clock()

    def dispute(self, peer: str, other: str, epoch: int) -> int | None:
        """Count that ``peer`` and ``other`` refused each other without evidence in epoch ``epoch``; returns how
        far ``peer`` is toward quarantine, or None when this epoch's dispute of ``peer`` was counted already: the
        distinct peers it disputed with within ``blame_window_s`` plus the epochs it was blamed for (``blame``), or,
        for a pair that disputed again although kept apart was not possible (too few peers to place otherwise), the
        epochs that pair disputed in (both then go, as before). The caller quarantines it (``add``) once that
        reaches ``blame_epochs`` and other peers' disputes do not explain its own (``explained``); its disputes
        are then forgotten (the pairs stay apart, ``apart``)."""
        if (peer, epoch, "blamed") in self._charged:
            return None
        self._charged.add((peer, epoch, "blamed"))
        self.disputed([(peer, other)], epoch)
        return max(len(self.counterparts(peer)) + len(self._blamed_epochs(peer)), self._repeats(peer))

    def disputed(self, pairs: Iterable[tuple[str, str]], epoch: int) -> None:
        """Record that each of ``pairs`` refused each other in epoch ``epoch`` (counting nobody yet): every dispute
        of an epoch is recorded before any of them is counted, so that ``explained`` sees them all."""
        now = self.clock()
        for pair in pairs:
            self._disputes.setdefault(frozenset(pair), {}).setdefault(epoch, now)

    def _repeats(self, peer: str) -> int:
        """The most epochs ``peer`` disputed in with one counterpart since it was last quarantined."""
        since = self._forgotten.get(peer, -math.inf)
        return max((len(self._recent(epochs, since)) for pair, epochs in self._disputes.items() if peer in pair),
                   default=0)

    def explained(self, peer: str) -> bool:
        """Whether the disputes ``peer`` counts are explained without it (``churn.cover``): some smallest set of
        liars that puts one at an end of every live dispute (``live_disputes``) leaves ``peer`` out. Never when
        it was also blamed by epoch, or disputed with one counterpart in ``blame_epochs`` epochs (a pair that
        could not be kept apart: both go)."""
        if self._blamed_epochs(peer) or self._repeats(peer) >= self.blame_epochs:
            return False
        return not essential(self.live_disputes(), peer)

    def live_disputes(self) -> list[tuple[str, str]]:
        """The disputed pairs within ``blame_window_s`` that no quarantine explained yet: a dispute after both
        were last quarantined, with neither quarantined on a proof since."""
        now = self.clock()
        proven = {q for q, t in self._proven.items() if now - t <= self.blame_window_s}
        live = []
        for pair, epochs in self._disputes.items():
            a, b = sorted(pair)
            since = max(self._forgotten.get(a, -math.inf), self._forgotten.get(b, -math.inf))
            if a not in proven and b not in proven and self._recent(epochs, since):
                live.append((a, b))
        return live

    def _recent(self, epochs: dict[int, float], since: float) -> dict[int, float]:
        now = self.clock()
        return {e: t for e, t in epochs.items() if now - t <= self.blame_window_s and t > since}

    def counterparts(self, peer: str) -> set[str]:
        """The peers ``peer`` disputed with within ``blame_window_s`` (since it was last quarantined for it),
        but those quarantined on a proof since: the dispute is explained (two colluders disputing with one
        honest peer, one of them caught on a proof, do not make it two counts)."""
        since, now = self._forgotten.get(peer, -math.inf), self.clock()
        proven = {q for q, t in self._proven.items() if now - t <= self.blame_window_s}
        return {q for pair, epochs in self._disputes.items() if peer in pair and self._recent(epochs, since)
                for q in pair - {peer} if q not in proven}

    def suspects(self) -> set[str]:
        """Peers blamed, in a dispute or quarantined within ``blame_window_s``: the spares, where a plan has some
        (``Leader``), so that a stage is not trained by one of them alone, checked by nobody."""
        now = self.clock()
        recent = {p for p, (_, last) in self._strikes.items() if now - last <= self.blame_window_s}
        return recent | {p for p in self._blamed if self._blamed_epochs(p)} | {
            p for pair in self.apart() for p in pair if self.counterparts(p)}

    def inherit(self, pairs: Iterable[frozenset[str]]) -> None:
        """``pairs`` a predecessor's plan kept apart (``PlanRecord.kept_apart``): kept apart for
        ``blame_window_s`` from when first read, but never counted (a leader's word frames nobody)."""
        now = self.clock()
        for pair in pairs:
            if len(pair) == 2:
                self._inherited.setdefault(frozenset(pair), now)

    def apart(self) -> set[frozenset[str]]:
        """The pairs that disputed within ``blame_window_s``, and those inherited (``inherit``) within it: the
        leader's plans keep each apart."""
        now = self.clock()
        return ({pair for pair, epochs in self._disputes.items() if self._recent(epochs, -math.inf)}
                | {pair for pair, t in self._inherited.items() if now - t <= self.blame_window_s})
