"""Quarantine: a peer that failed an epoch stays out of the next plans for a while (the leader's; pure).

A failure re-plan names its likely causes (``Replan.culprits``): trainers that died, trainers that neither
trained nor halted within ``churn.halt_timeout_s`` (the leader never waits on a peer's own cooperation
longer than that), and peers a halted trainer blamed for its failed call. Each is left out of the plans for
``quarantine_s``, doubled at every repeat up to ``quarantine_max_s``, so a peer that keeps failing runs
costs the run one failed epoch, then fewer and fewer; a peer that failed once (an honest transient
failure: a reboot, a lost connection) comes back as a joiner when its back-off ends. Repeats are forgotten
after ``quarantine_max_s`` without a failure.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable


class Quarantine:
    def __init__(self, base_s: float, max_s: float, clock: Callable[[], float] = time.monotonic):
        self.base_s = base_s
        self.max_s = max_s
        self.clock = clock
        self._until: dict[str, float] = {}
        self._strikes: dict[str, tuple[int, float]] = {}  # peer -> (failures, when the last one was)

    def add(self, peer: str) -> float:
        """Quarantine ``peer``; returns its back-off in seconds."""
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
