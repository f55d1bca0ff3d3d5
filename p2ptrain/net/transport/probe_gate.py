"""One link measurement through a peer at a time: its own, or one it serves.

A probe times how fast bytes cross a path, so anything else crossing the same line at that moment is counted
as the path's slowness. The worst of it is two peers measuring each other at once: a home's uplink then
carries its own probe's transfers and the acknowledgements of the other's, a stream of them at a few percent
of the other's rate: 1 Gbit/s into a home makes ~25 Mbit/s of acknowledgements, all of a 24 Mbit/s uplink,
and that home's probe of the same peer measured 13 Mbit/s (the NAT test, once in many runs). A peer served a
probe while measuring one of its own has the same problem on whichever line the two share; so does a peer
served two probes at once (its downlink carries both).

So a peer takes part in one measurement at a time (``ProbeGate``). Its prober holds the gate while it measures
(``acquire``, waiting for a probe it serves to end; while it waits no new one is served, so it is not starved),
and its servicer serves a probe stream only while nothing holds it (``try_serve``): a probe stream that opens
while the peer measures, waits to, or already serves one, is refused at its first message with the code
``busy`` (``messages.Refusal.BUSY``), before any bulk transfer. The prober told ``busy`` measures that peer
again shortly (``agent.links``): two peers that start on each other at the same moment both hear it, and
their random pauses part them. A stream served longer than ``max_serve_s`` (a probe's deadline) no longer
holds the gate: a peer that opens one and leaves it idle delays our own measurements that long at most.
"""

from __future__ import annotations

import itertools
import threading
import time

MAX_SERVE_S = 60.0  # ``ProbeConfig.deadline_s``: no measurement of us takes longer


class ProbeGate:
    """Whether this peer is in a link measurement, measuring (its prober) or measured (its servicer).

    Thread-safe: the prober runs in its own thread, the servicer in the transport's loop (``try_serve`` and
    ``served`` never block)."""

    def __init__(self, max_serve_s: float = MAX_SERVE_S, clock=time.monotonic) -> None:
        self.max_serve_s, self._clock = max_serve_s, clock
        self._changed = threading.Condition()
        self._measuring = False
        self._waiting = 0  # our measurements waiting for a probe we serve to end
        self._serving: dict[int, float] = {}  # probe streams served: when each began
        self._tokens = itertools.count()

    def try_serve(self) -> int | None:
        """Take the gate to serve one probe stream: a token for ``served``; None (refuse it: busy) when anything
        holds the gate or waits for it."""
        with self._changed:
            if self._measuring or self._waiting or self._held_s() is not None:
                return None
            token = next(self._tokens)
            self._serving[token] = self._clock()
            return token

    def served(self, token: int) -> None:
        """The probe stream ``try_serve`` let in with ``token`` has ended."""
        with self._changed:
            self._serving.pop(token, None)
            self._changed.notify_all()

    def acquire(self, timeout_s: float) -> bool:
        """Take the gate for one of our measurements, waiting up to ``timeout_s`` for a probe we serve to end;
        False when it did not (call ``release`` only after True)."""
        until_s = self._clock() + timeout_s
        with self._changed:
            self._waiting += 1
            try:
                while self._measuring or (held_s := self._held_s()) is not None:
                    left_s = until_s - self._clock()
                    if left_s <= 0:
                        self._changed.notify_all()
                        return False
                    self._changed.wait(left_s if self._measuring else min(left_s, held_s))
                self._measuring = True
                return True
            finally:
                self._waiting -= 1

    def _held_s(self) -> float | None:
        """How long the probes we serve still hold the gate (None: they do not); call with the lock held."""
        now = self._clock()
        left = [began + self.max_serve_s - now for began in self._serving.values()]
        left = [s for s in left if s > 0]
        return max(left) if left else None

    def release(self) -> None:
        with self._changed:
            self._measuring = False
            self._changed.notify_all()

    @property
    def busy(self) -> bool:
        with self._changed:
            return bool(self._measuring or self._waiting or self._held_s() is not None)
