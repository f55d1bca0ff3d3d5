"""Quarantine: a peer that failed an epoch stays out of the next plans for a while (the leader's; pure).

A failure re-plan names its likely causes (``Replan.culprits``): trainers that died, trainers that neither
trained nor halted within ``churn.halt_timeout_s`` (the leader never waits on a peer's own cooperation
longer than that), and peers a halted trainer blamed for its failed call. Each is left out of the plans for
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

A leader that cannot re-plan yet (too few peers) reads the same failure again at every poll: each failed
epoch costs a peer one strike and one blame, however often it is read.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable


class Quarantine:
    def __init__(self, base_s: float, max_s: float, clock: Callable[[], float] = time.monotonic, *,
                 blame_epochs: int = 2, blame_window_s: float = 900.0):  # fmt: skip
        self.base_s = base_s
        self.max_s = max_s
        self.clock = clock
        self.blame_epochs = blame_epochs
        self.blame_window_s = blame_window_s
        self._until: dict[str, float] = {}
        self._strikes: dict[str, tuple[int, float]] = {}  # peer -> (failures, when the last one was)
        self._blamed: dict[str, dict[int, float]] = {}  # peer -> {epoch it was blamed for: when}
        self._charged: set[tuple[str, int, str]] = set()  # (peer, epoch, "failed" | "blamed") already counted

    def add(self, peer: str, epoch: int) -> float | None:
        """Quarantine ``peer`` for failing epoch ``epoch``; returns its back-off in seconds, or None when that
        epoch's failure already quarantined it (one strike per failed epoch)."""
        if (peer, epoch, "failed") in self._charged:
            return None
        self._charged.add((peer, epoch, "failed"))
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
        blamed for within ``blame_window_s``, or None when this epoch's blame was counted already (a repeat
        report of one epoch counts once). The caller quarantines it (``add``) once that reaches
        ``blame_epochs``; the count then starts over."""
        if (peer, epoch, "blamed") in self._charged:
            return None
        self._charged.add((peer, epoch, "blamed"))
        now = self.clock()
        epochs = {e: t for e, t in self._blamed.get(peer, {}).items() if now - t <= self.blame_window_s}
        epochs.setdefault(epoch, now)
        self._blamed[peer] = epochs
        if len(epochs) >= self.blame_epochs:
            del self._blamed[peer]
        return len(epochs)
