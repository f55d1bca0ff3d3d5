"""The link prober: a background thread measuring α and β to every peer, publishing this agent's row.

In rounds: each round measures the link to every peer it was given (``set_peers``), in a random order
(so that two agents rarely probe each other at the same moment, which would queue each one's replies
behind the other's bulk transfers), with ``net.probe.measure_link`` over the transport, so link emulation
applies. Estimates are smoothed across rounds (``LinkTable``, an EWMA); a peer enters the published row
(``LinksRecord``, key ``{run}.links``) once it has been measured ``min_rounds`` times with samples that
agreed (``LinkEstimate.agreed``), or, on a machine too busy for that, after one more measurement as a best
guess (it is replaced once an agreed one comes). The row is
re-published whenever it changes. A failed measurement is logged and retried next round.

A round measures only the peers that are due: not yet measured well enough (``min_rounds`` agreed
measurements, or one more than that as a best guess), or last measured ``refresh_s`` ago. A swarm whose
links are known idles instead of probing without end: on a home uplink each probe's transfers would
compete with everything else, and on one machine the probes of a waiting swarm took a core.

``pause()`` stops probing (training traffic must not queue behind probes on the same links): a
measurement in progress ends after its current round trip, without a result; ``resume()`` starts again (a
later membership change needs fresh rows).
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Iterable

from p2ptrain.agent.config import LinksConfig
from p2ptrain.errors import ProtocolError
from p2ptrain.net.dht.node import SwarmDHT
from p2ptrain.net.dht.record_base import MAX_BANDWIDTH_GBPS, MAX_LATENCY_MS
from p2ptrain.net.dht.records import LinkMeasurement, LinksRecord
from p2ptrain.net.transport.endpoint import Transport
from p2ptrain.net.transport.probe import LinkTable, measure_link

logger = logging.getLogger(__name__)

MIN_BANDWIDTH_GBPS = 1e-6  # 1 kbit/s: the least we publish (a record's bandwidth must be positive)


class LinkProber:
    def __init__(
        self,
        transport: Transport,
        dht: SwarmDHT,
        config: LinksConfig,
        on_publish: Callable[[dict[str, LinkMeasurement]], None] | None = None,
        rng: random.Random | None = None,
    ):
        self.transport, self.dht, self.config = transport, dht, config
        self.table = LinkTable(config.ewma_weight)
        self.rounds: dict[str, int] = {}  # measurements per peer whose samples agreed
        self.attempts: dict[str, int] = {}  # measurements per peer, agreed or not
        self.measured_at: dict[str, float] = {}  # when each peer was last measured (monotonic)
        self._on_publish = on_publish
        self._rng = rng or random.Random()
        self._peers: tuple[str, ...] = ()
        self._published: dict[str, LinkMeasurement] | None = None
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._paused = False
        self._measuring = False
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="p2ptrain-link-prober", daemon=True)

    def start(self) -> LinkProber:
        self._thread.start()
        return self

    def set_peers(self, peers: Iterable[str]) -> None:
        """The peers to measure from the next round on (peers no longer given are dropped from the row)."""
        peers = tuple(sorted(set(peers)))
        with self._wake:
            if peers != self._peers:
                self._peers = peers
                self._wake.notify_all()

    def pause(self, timeout_s: float = 0.0) -> None:
        """Stop probing; wait up to ``timeout_s`` for a measurement in progress to end."""
        with self._wake:
            self._paused = True
            self._wake.wait_for(lambda: not self._measuring, timeout=timeout_s)

    def resume(self) -> None:
        with self._wake:
            self._paused = False
            self._wake.notify_all()

    def stop(self, timeout_s: float) -> None:
        with self._wake:
            self._stopped = True
            self._wake.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def row(self) -> dict[str, LinkMeasurement]:
        """What we publish: the smoothed estimate of every current peer measured well enough (module docstring),
        within what a record can say (loopback on a busy machine once measured 1.7 Tbit/s; the record's bound,
        1000 Gbit/s, is published for it, not an error that ends the agent)."""
        with self._lock:
            peers = self._peers
        estimates = self.table.snapshot()
        return {
            p: LinkMeasurement(min(max(estimates[p].latency_ms, 0.0), MAX_LATENCY_MS),
                               min(max(estimates[p].bandwidth_gbps, MIN_BANDWIDTH_GBPS), MAX_BANDWIDTH_GBPS))
            for p in peers
            if p in estimates and self._enough(p)
        }

    def _enough(self, peer: str) -> bool:
        """Measured well enough to publish: ``min_rounds`` agreed measurements, or one more as a best guess."""
        return self.rounds.get(peer, 0) >= self.config.min_rounds or self.attempts.get(peer, 0) > self.config.min_rounds

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._stopped and (self._paused or not self._due()):
                    self._wake.wait(self._until_due())
                if self._stopped:
                    return
                peers = self._due()
            self._rng.shuffle(peers)
            for peer in peers:
                if not self._measure(peer):
                    return
                self._publish()
            with self._wake:
                self._wake.wait_for(lambda: self._stopped, timeout=self.config.round_pause_s)

    def _due(self) -> list[str]:
        """The peers this round measures (module docstring); call with the lock held."""
        now = time.monotonic()
        return [p for p in self._peers if self._settled_at(p) is None or now >= self._settled_at(p)]

    def _settled_at(self, peer: str) -> float | None:
        """When ``peer`` is due again, None while it still needs measuring."""
        return self.measured_at[peer] + self.config.refresh_s if self._enough(peer) and peer in self.measured_at else None

    def _until_due(self) -> float | None:
        """Seconds until the next peer is due (None: none is, or we are paused, until woken)."""
        if self._paused or not self._peers:
            return None
        return max(0.0, min(self._settled_at(p) or 0.0 for p in self._peers) - time.monotonic())

    def _measure(self, peer: str) -> bool:
        """Measure one link unless stopped, paused or the peer is gone; False once stopped."""
        with self._lock:
            if self._stopped:
                return False
            if self._paused or peer not in self._peers:
                return True
            self._measuring = True
        try:
            estimate = measure_link(self.transport, peer, self.config.probe, stop=self._interrupted)
        except Exception as e:  # a peer that left, a timeout, the transport shutting down: never kill the thread
            with self._lock:
                if self._stopped:
                    return False
            logger.warning("measuring the link to peer %s failed (%s: %s); retrying next round",
                           peer, type(e).__name__, e, exc_info=logger.isEnabledFor(logging.DEBUG))
            return True
        finally:
            with self._wake:
                self._measuring = False
                self._wake.notify_all()
        if estimate is None:  # paused or stopped midway
            return True
        self.table.update(peer, estimate)
        self.measured_at[peer] = time.monotonic()
        self.attempts[peer] = self.attempts.get(peer, 0) + 1
        if estimate.agreed:
            self.rounds[peer] = self.rounds.get(peer, 0) + 1
        return True

    def _interrupted(self) -> bool:
        return self._paused or self._stopped  # read without the lock: a flag, re-read before every round trip

    def _publish(self) -> None:
        row = self.row()
        if row == self._published:
            return
        try:
            self.dht.publish_links(LinksRecord.from_peers(row))
        except ProtocolError as e:
            logger.warning("publishing our links row failed: %s; retrying after the next measurement", e)
            return
        self._published = row
        logger.info("published links to %d peers", len(row))
        if self._on_publish is not None:
            self._on_publish(row)
