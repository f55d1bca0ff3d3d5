"""Which link measurements may run through a peer at once, so that no probe counts another's traffic as its
path's slowness.

A probe of the path a → b times bytes crossing a's uplink and b's downlink. Two things on those lines distort it
most:

* **A pair measuring each other at once.** A home's uplink then carries its own probe's transfers and the
  acknowledgements of the other's, a stream of them at a few percent of the other's rate: 1 Gbit/s into a home
  makes ~25 Mbit/s of acknowledgements, all of a 24 Mbit/s uplink, and that home's probe of the same peer
  measured 13 Mbit/s (the NAT test, once in many runs).
* **Two probes into one peer at once**: its downlink carries both, and each measures a share of it (two
  probers of a peer with an 8 Mbit/s downlink measured 2.7 and 8.0 Mbit/s).

So a peer serves one probe stream at a time, and none from the peer it is measuring (``ProbeGate.try_serve``);
its own measurement of a peer waits for a probe it serves from that peer to end (``acquire``; while it waits,
no new one from that peer is served, so it is not starved). A measurement of our own line (the access probe:
flows to several peers at once) takes the whole gate: nothing is served while it runs, and it waits for
what is. A probe stream refused is refused at its first message with the code ``busy``
(``messages.Refusal.BUSY``), before any bulk transfer; the prober measures that peer again shortly
(``agent.links``): two peers that start on each other at the same moment both hear it, and their random pauses
part them. A peer may still measure one link while it serves a probe of another (each agent measuring one
peer at a time, as many measurements run at once as without the gate); the acknowledgements of a fast probe
into a slow home then share that home's uplink with its own probe, which the gate does not prevent.

A stream served longer than ``max_serve_s`` (a probe's deadline) no longer holds the gate: a peer that opens
one and leaves it idle delays others' probes of us that long at most.
"""

from __future__ import annotations

import itertools
import threading
import time

MAX_SERVE_S = 60.0  # ``ProbeConfig.deadline_s``: no measurement of us takes longer
EVERY_PEER = "*"  # what ``acquire`` measures for our own line: flows to several peers at once


class ProbeGate:
    """The measurements this peer takes part in: its own (its prober) and those it serves (its servicer).

    Thread-safe: the prober runs in its own thread, the servicer in the transport's loop (``try_serve`` and
    ``served`` never block)."""

    def __init__(self, max_serve_s: float = MAX_SERVE_S, clock=time.monotonic) -> None:
        self.max_serve_s, self._clock = max_serve_s, clock
        self._changed = threading.Condition()
        self._measuring: str | None = None  # the peer our measurement is of (``EVERY_PEER``: our line)
        self._waiting: dict[str, int] = {}  # our measurements waiting for a probe we serve to end, by peer
        self._serving: dict[int, tuple[str, float]] = {}  # probe streams served: their prober, when they began
        self._tokens = itertools.count()

    def try_serve(self, peer: str) -> int | None:
        """Take the gate to serve one probe stream from ``peer``: a token for ``served``; None (refuse it: busy)
        while we serve another, or measure ``peer`` or our line, or wait to."""
        with self._changed:
            held = (self._measuring, *self._waiting)
            if self._held_s() is not None or peer in held or EVERY_PEER in held:
                return None
            token = next(self._tokens)
            self._serving[token] = (peer, self._clock())
            return token

    def served(self, token: int) -> None:
        """The probe stream ``try_serve`` let in with ``token`` has ended."""
        with self._changed:
            self._serving.pop(token, None)
            self._changed.notify_all()

    def acquire(self, peer: str, timeout_s: float) -> bool:
        """Take the gate for our measurement of ``peer`` (``EVERY_PEER``: of our line), waiting up to ``timeout_s``
        for a probe we serve from that peer (from any, for our line) to end; False when it did not (call
        ``release`` only after True)."""
        until_s = self._clock() + timeout_s
        with self._changed:
            self._waiting[peer] = self._waiting.get(peer, 0) + 1
            try:
                while self._measuring is not None or (held_s := self._held_s(peer)) is not None:
                    left_s = until_s - self._clock()
                    if left_s <= 0:
                        return False
                    self._changed.wait(left_s if self._measuring is not None else min(left_s, held_s))
                self._measuring = peer
                return True
            finally:
                self._waiting[peer] -= 1
                if not self._waiting[peer]:
                    del self._waiting[peer]
                self._changed.notify_all()

    def release(self) -> None:
        with self._changed:
            self._measuring = None
            self._changed.notify_all()

    def serves(self, peer: str) -> bool:
        """Whether we serve a probe stream from ``peer`` now (our measurement of it would wait for it to end)."""
        with self._changed:
            return self._held_s(peer) is not None and any(prober == peer for prober, _ in self._serving.values())

    @property
    def busy(self) -> bool:
        """Whether we measure, wait to, or serve a probe."""
        with self._changed:
            return bool(self._measuring is not None or self._waiting or self._held_s() is not None)

    def _held_s(self, peer: str | None = None) -> float | None:
        """How long the probes we serve (from ``peer``; from anyone where None or ``EVERY_PEER``) still hold the
        gate, None where they do not; call with the lock held."""
        now = self._clock()
        left = [began + self.max_serve_s - now for prober, began in self._serving.values()
                if peer in (None, EVERY_PEER, prober)]
        left = [s for s in left if s > 0]
        return max(left) if left else None
