"""The link prober: a background thread measuring α and β to this agent's partners, publishing its row.

Its peers are given (``set_peers``): the membership reader hands it this agent's partners in the run's
probe graph and its neighbours in the plan it follows (``leadership.probe_set``); the planner estimates the
other links (``planning.estimated``). In rounds: each round measures the link to every peer given, in a random order
(so that two agents rarely probe each other at the same moment), with ``transport.probe.measure_link`` over
the transport, so link emulation applies. A peer serves one probe at a time, none from the peer it measures,
and none while it measures its own line (``net.transport.probe_gate``): a peer that cannot serve ours says
``busy`` (a peer that measures us right now we leave for later ourselves, rather than wait for it: the other
peers of the round first), and the round ends with a pause
of 0.1-1 s (``BUSY_PAUSE_S``, random: two agents that start on each other at once part) instead of
``round_pause_s``, after which that peer is measured again; the access measurement likewise. Estimates are smoothed across rounds (``LinkTable``, an EWMA); a peer enters the published row
(``LinksRecord``, key ``{run}.links``) once it has been measured ``min_rounds`` times with samples that
agreed (``LinkEstimate.agreed``), or, on a machine too busy for that, after one more measurement as a best
guess (it is replaced once an agreed one comes). The row is
re-published whenever it changes, by a thread of its own (the prober measures on while a store is under way; only
the newest row waiting is stored; a failed store is tried again once the row changes, or after a back-off from
``PUBLISH_RETRY_S`` that doubles with each failure in a row, ``net.dht.retry.backoff_s``), under a higher version (``LinksRecord.version``) with the version each peer
first appeared in (``since``: a plan names the version its leader planned with). A failed measurement is logged
and retried next round.

A round measures only the peers that are due: not yet measured well enough (``min_rounds`` agreed
measurements, or one more than that as a best guess), or last measured ``refresh_s`` ago. A swarm whose
links are known idles instead of probing without end: on a home uplink each probe's transfers would
compete with everything else, and on one machine the probes of a waiting swarm took a core.

Once every current peer's link is measured well enough, and at least ``links.access.min_peers`` are, the prober
measures this agent's own line (``net.transport.access_probe``: several flows at once against each alone)
over the fastest of them, unless told not to (``measure_access``: the agent turns it off when the line is
declared or emulated). Again after ``links.access.refresh_s``; after ``links.access.retry_s`` when it failed, or
when a direction not yet known came out disturbed (a busy moment; at most ``retries`` times in a row); or sooner
when more peers came than the last measurement had (up to ``links.access.max_peers``). The first one goes before the row that
covers every peer is published: the leader plans once every row covers the others, and should know our line
by then (a peer busy in another measurement: again after its pause, ``_first_access``). A direction it finds replaces the one
known; an unknown one leaves it (it only says that this measurement could not tell). ``on_access`` gets the
known capacities (bytes/s) whenever they change.

Once the row covers every peer, the log says where the prober's time went since it last did (``spent``:
measuring, refused by busy peers, waiting for probes we served, pausing after a busy round, publishing, our
own line): the link phase a first plan waits for, taken apart.

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
from p2ptrain.errors import MessageRejected, ProtocolError
from p2ptrain.net.dht.node import SwarmDHT
from p2ptrain.net.dht.record_base import MAX_BANDWIDTH_GBPS, MAX_LATENCY_MS
from p2ptrain.net.dht.records import LinkMeasurement, LinksRecord
from p2ptrain.net.dht.retry import backoff_s
from p2ptrain.net.transport.access_probe import Direction, measure_access
from p2ptrain.net.transport.endpoint import Transport
from p2ptrain.net.transport.messages import Refusal
from p2ptrain.net.transport.probe import LinkTable, measure_link
from p2ptrain.net.transport.probe_gate import EVERY_PEER, ProbeGate

logger = logging.getLogger(__name__)

BUSY_PAUSE_S = (0.1, 1.0)  # a round that met a peer in another measurement ends with a pause drawn from this
GATE_WAIT_S = 0.5  # waiting for a probe we serve to end, we look at our pause this often
PUBLISH_RETRY_S = 2.0  # a row whose store failed is stored again after this long, doubling (sooner if it changes)
MIN_BANDWIDTH_GBPS = 1e-6  # 1 kbit/s: the least we publish (a record's bandwidth must be positive)
# what the prober's time goes to (``LinkProber.spent``): measurements that gave a result, attempts a busy peer
# refused, waiting for a probe we serve from the peer to end, storing the row, measuring our own line, pausing
# after a round that met a busy peer
SPENT = ("measuring", "refused", "gate", "publishing", "access", "paused")


class LinkProber:
    def __init__(
        self,
        transport: Transport,
        dht: SwarmDHT,
        config: LinksConfig,
        on_publish: Callable[[dict[str, LinkMeasurement]], None] | None = None,
        rng: random.Random | None = None,
        on_access: Callable[[dict[Direction, float]], None] | None = None,
    ):
        self.transport, self.dht, self.config = transport, dht, config
        self.table = LinkTable(config.ewma_weight)
        self.rounds: dict[str, int] = {}  # measurements per peer whose samples agreed
        self.attempts: dict[str, int] = {}  # measurements per peer, agreed or not
        self.measured_at: dict[str, float] = {}  # when each peer was last measured (monotonic)
        self._on_publish = on_publish
        self._on_access = on_access
        self.measure_access = config.measure_access
        self.access: dict[Direction, float] = {}  # our line's capacities as measured, bytes/s (absent: unknown)
        self._access_next_s = float("-inf")  # when the line is due to be measured again (monotonic)
        self._access_peers = 0  # peers the last measurement had
        self._access_busy_until_s = float("-inf")  # a peer in another measurement: not again before this
        self._access_retries = 0  # measurements in a row that left a direction not yet known disturbed
        self.access_measurements = 0  # measurements of our line that ended (a direction found or not)
        self._rng = rng or random.Random()
        # which measurements run through us at once (``probe_gate``)
        self._gate = transport.probe_gate if transport is not None else ProbeGate()
        self._busy = False  # a peer this round said it was in another measurement
        self._peers: tuple[str, ...] = ()
        self._published: dict[str, LinkMeasurement] | None = None
        self.version = 0  # our last row's (``LinksRecord.version``)
        self._since: dict[str, int] = {}  # the version of the row each peer of it first appeared in
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._paused = False
        self._measuring = False
        self._stopped = False
        # where the prober's time went since its row last covered every peer (``_account``, ``_said_complete``)
        self.spent: dict[str, float] = dict.fromkeys(SPENT, 0.0)
        self._refusals = 0
        self._spent_lock = threading.Lock()  # the prober's thread and the publisher's both count
        self._complete = False
        self._to_publish: dict[str, LinkMeasurement] | None = None  # the newest row not yet stored (``_publishing``)
        self._thread = threading.Thread(target=self._run, name="p2ptrain-link-prober", daemon=True)
        self._publisher = threading.Thread(target=self._publishing, name="p2ptrain-links-publisher", daemon=True)

    def start(self) -> LinkProber:
        self._thread.start()
        self._publisher.start()
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
        until_s = time.monotonic() + timeout_s
        for thread in (self._thread, self._publisher):
            if thread.is_alive():
                thread.join(max(0.0, until_s - time.monotonic()))

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
                while not self._stopped and (self._paused or not (self._due() or self._access_due())):
                    self._wake.wait(self._until_due())
                if self._stopped:
                    return
                peers = self._due()
            self._busy = False
            self._rng.shuffle(peers)
            for peer in peers:
                if not self._measure(peer):
                    return
                if self.access_measurements == 0 and self._access_due() and not self._first_access():
                    return
                self._publish()
            if self._access_due() and not self._measure_access():
                return
            pause_s = self._rng.uniform(*BUSY_PAUSE_S) if self._busy else self.config.round_pause_s
            began_s = time.monotonic()
            with self._wake:
                self._wake.wait_for(lambda: self._stopped, timeout=pause_s)
            if self._busy:
                self._account("paused", time.monotonic() - began_s)

    def _due(self) -> list[str]:
        """The peers this round measures (module docstring); call with the lock held."""
        now = time.monotonic()
        return [p for p in self._peers if self._settled_at(p) is None or now >= self._settled_at(p)]

    def _settled_at(self, peer: str) -> float | None:
        """When ``peer`` is due again, None while it still needs measuring."""
        return self.measured_at[peer] + self.config.refresh_s if self._enough(peer) and peer in self.measured_at else None

    def _until_due(self) -> float | None:
        """Seconds until the next peer or the access measurement is due (None: nothing is, or we are paused,
        until woken)."""
        if self._paused or not self._peers:
            return None
        next_s = min(self._settled_at(p) or 0.0 for p in self._peers)
        if (access_s := self._access_at()) is not None:
            next_s = min(next_s, access_s)
        return max(0.0, next_s - time.monotonic())

    def _access_ready(self) -> bool:
        """Whether the line may be measured: asked to, every peer measured well enough, enough of them."""
        peers = self._peers
        return (self.measure_access and len(peers) >= self.config.access.min_peers
                and all(self._enough(p) and self.table.get(p) is not None for p in peers))

    def _access_at(self) -> float | None:
        """When the line is due to be measured (monotonic; module docstring), None while it may not be."""
        if not self._access_ready():
            return None
        more = self._access_peers < self.config.access.max_peers and len(self._peers) > self._access_peers
        return max(float("-inf") if more else self._access_next_s, self._access_busy_until_s)

    def _access_due(self) -> bool:
        return (access_s := self._access_at()) is not None and time.monotonic() >= access_s

    def _first_access(self) -> bool:
        """Our line's first measurement, before the row that completes ours is published (the leader plans once
        every row covers the others, and its first plan should have our line): while a peer is busy, again
        after its pause, for up to ``links.access.deadline_s``. False once stopped."""
        until_s = time.monotonic() + self.config.access.deadline_s
        while self._measure_access():
            busy_s = self._access_busy_until_s - time.monotonic()
            if self.access_measurements or busy_s <= 0 or time.monotonic() + busy_s > until_s:
                return True
            with self._wake:
                if self._wake.wait_for(lambda: self._stopped or self._paused, timeout=busy_s):
                    return not self._stopped
        return False

    def _measure_access(self) -> bool:
        """Measure our line unless stopped or paused; False once stopped."""
        with self._lock:
            if self._stopped:
                return False
            if self._paused:
                return True
            self._measuring = True
            peers = self._peers
        estimates = self.table.snapshot()
        paths = {p: estimates[p].bandwidth_gbps * 1e9 / 8 for p in peers if p in estimates}
        gated = False
        began_s = time.monotonic()
        try:
            if not (gated := self._take_gate(EVERY_PEER)):
                return True
            found = measure_access(self.transport, paths, self.config.access, stop=self._interrupted)
        except Exception as e:  # a peer that left, a timeout, the transport shutting down: never kill the thread
            if _busy(e):  # a peer in another measurement: again shortly
                logger.debug("measuring our access link: %s", e)
                self._access_busy_until_s = time.monotonic() + self._rng.uniform(*BUSY_PAUSE_S)
                return True
            with self._lock:
                if self._stopped:
                    return False
            logger.warning("measuring our access link failed (%s: %s); retrying in %.0f s", type(e).__name__, e,
                           self.config.access.retry_s, exc_info=logger.isEnabledFor(logging.DEBUG))
            self._access_next_s = time.monotonic() + self.config.access.retry_s
            return True
        finally:
            self._end_measuring(gated)
            self._account("access", time.monotonic() - began_s)
        if found is None:  # paused or stopped midway: due again once resumed
            return True
        self._access_peers = min(len(paths), self.config.access.max_peers)
        self.access_measurements += 1
        known = dict(self.access)
        known.update({d: e.capacity_bytes_per_s for d, e in found.items() if e.capacity_bytes_per_s is not None})
        disturbed = [d.value for d, e in found.items() if e.disturbed and d not in known]
        if disturbed and self._access_retries < self.config.access.retries:  # a busy moment: not 10 minutes unknown
            self._access_retries += 1
            self._access_next_s = time.monotonic() + self.config.access.retry_s
            logger.info("our %s came out disturbed; measuring again in %.0f s (%d of %d)", " and ".join(disturbed),
                        self.config.access.retry_s, self._access_retries, self.config.access.retries)
        else:
            self._access_retries = 0
            self._access_next_s = time.monotonic() + self.config.access.refresh_s
        if known != self.access:
            self.access = known
            logger.info("our access link as measured: %s", ", ".join(f"{d.value} {v * 8 / 1e6:.2f} Mbit/s"
                                                                     for d, v in known.items()))
            if self._on_access is not None:
                self._on_access(dict(known))
        return True

    def _measure(self, peer: str) -> bool:
        """Measure one link unless stopped, paused or the peer is gone; False once stopped."""
        with self._lock:
            if self._stopped:
                return False
            if self._paused or peer not in self._peers:
                return True
            if self._gate.serves(peer):  # it measures us now: the others first, this one after the round's pause
                self._busy = True
                return True
            self._measuring = True
        gated = False
        began_s = time.monotonic()
        try:
            if not (gated := self._take_gate(peer)):
                return True
            measured_s = time.monotonic()
            self._account("gate", measured_s - began_s)
            estimate = measure_link(self.transport, peer, self.config.probe, stop=self._interrupted)
            self._account("measuring", time.monotonic() - measured_s)
        except Exception as e:  # a peer that left, a timeout, the transport shutting down: never kill the thread
            if _busy(e):  # in another measurement: measured again after a short pause
                logger.debug("measuring the link to peer %s: %s", peer, e)
                self._account("refused", time.monotonic() - measured_s)
                self._busy = True
                return True
            with self._lock:
                if self._stopped:
                    return False
            logger.warning("measuring the link to peer %s failed (%s: %s); retrying next round",
                           peer, type(e).__name__, e, exc_info=logger.isEnabledFor(logging.DEBUG))
            return True
        finally:
            self._end_measuring(gated)
        if estimate is None:  # paused or stopped midway
            return True
        self.table.update(peer, estimate)
        self.measured_at[peer] = time.monotonic()
        self.attempts[peer] = self.attempts.get(peer, 0) + 1
        if estimate.agreed:
            self.rounds[peer] = self.rounds.get(peer, 0) + 1
        return True

    def _take_gate(self, peer: str) -> bool:
        """Wait for the probe gate to measure ``peer`` (``EVERY_PEER``: our line): for a probe we serve from it to
        end; False when paused or stopped first."""
        while not self._interrupted():
            if self._gate.acquire(peer, GATE_WAIT_S):
                return True
        return False

    def _end_measuring(self, gated: bool) -> None:
        if gated:
            self._gate.release()
        with self._wake:
            self._measuring = False
            self._wake.notify_all()

    def _interrupted(self) -> bool:
        return self._paused or self._stopped  # read without the lock: a flag, re-read before every round trip

    def _publish(self) -> None:
        """Hand the row to the publisher thread if it changed: the prober measures on while a store is under way
        (a store into a loaded DHT can take its whole request timeout, 10 s, and 64 agents on two cores saw
        many): only the newest row waiting is stored."""
        row = self.row()
        with self._wake:
            if row != (self._to_publish if self._to_publish is not None else self._published):
                self._to_publish = row
                self._wake.notify_all()

    def _publishing(self) -> None:
        """The publisher thread: stores each newest row handed over (``_publish``), again after a back-off
        (``PUBLISH_RETRY_S``, doubling with each failure in a row) when a store failed and nothing newer came."""
        failures = 0
        while True:
            with self._wake:
                self._wake.wait_for(lambda: self._stopped or self._to_publish is not None)
                if self._stopped:
                    return
                row = self._to_publish
            if row == self._published:
                stored = True
            else:
                stored = self._store(row, failures)
            failures = 0 if stored else failures + 1
            with self._wake:
                if self._to_publish is row and stored:
                    self._to_publish = None
                if not stored:
                    self._wake.wait_for(lambda tried=row: self._stopped or self._to_publish is not tried,
                                        timeout=backoff_s(failures, PUBLISH_RETRY_S))

    def _store(self, row: dict[str, LinkMeasurement], failures: int = 0) -> bool:
        """Store ``row`` under our next version (module docstring); False where the store failed (``failures``:
        how many did before it in a row, for the log)."""
        version = max(self.version + 1, int(time.time()))  # higher than our last, also across restarts
        since = {p: self._since.get(p, version) for p in row}
        began_s = time.monotonic()
        try:
            self.dht.publish_links(LinksRecord.from_peers(row, version, since))
        except ProtocolError as e:
            logger.warning("publishing our links row failed (%d time(s) in a row): %s; retrying after a back-off from "
                           "%.0f s unless it changes first", failures + 1, e, PUBLISH_RETRY_S)
            return False
        finally:
            self._account("publishing", time.monotonic() - began_s)
        self._published, self.version, self._since = row, version, since
        logger.info("published links to %d peers", len(row))
        self._said_complete(row)
        if self._on_publish is not None:
            self._on_publish(row)
        return True

    def _account(self, spent_on: str, seconds: float) -> None:
        with self._spent_lock:
            self.spent[spent_on] += seconds
            self._refusals += spent_on == "refused"

    def _said_complete(self, row: dict[str, LinkMeasurement]) -> None:
        """Once our row covers every current peer: say where the prober's time went since it last did (the link
        phase a first plan waits for), and start counting afresh."""
        with self._lock:
            complete = bool(self._peers) and set(self._peers) <= set(row)
        if complete and not self._complete:
            with self._spent_lock:
                spent, refusals = self.spent, self._refusals
                self.spent, self._refusals = dict.fromkeys(SPENT, 0.0), 0
            logger.info("links to all %d peers measured: %.1f s measuring, %.1f s refused by busy peers (%d times), "
                        "%.1f s waiting for probes we served, %.1f s pausing after them, %.1f s publishing, %.1f s "
                        "on our own line", len(row), spent["measuring"], spent["refused"], refusals,
                        spent["gate"], spent["paused"], spent["publishing"], spent["access"])
        self._complete = complete


def _busy(error: Exception) -> bool:
    """Whether a measurement failed for a peer in another one (``probe_gate``)."""
    return isinstance(error, MessageRejected) and error.code == Refusal.BUSY


def line_to_publish(
    declared_mbps: dict[str, float | None], emulated_bytes_per_s: dict[str, float | None] | None,
    measured_bytes_per_s: dict[Direction, float],
) -> dict[str, float]:
    """Our line as the peer record says it (``uplink_gbps``/``downlink_gbps``, absent: unknown), each direction
    from the first that knows it: what the owner declared (``[links]``, Mbit/s), an emulated device's own
    line (``emulated_bytes_per_s`` not None: we play a device of a network, whose line is the network's, none
    when it has none), what we measured."""
    line = {}
    for key, direction in (("uplink_gbps", Direction.UP), ("downlink_gbps", Direction.DOWN)):
        if declared_mbps.get(key) is not None:
            line[key] = declared_mbps[key] / 1e3
        elif emulated_bytes_per_s is not None:
            if emulated_bytes_per_s.get(key) is not None:
                line[key] = emulated_bytes_per_s[key] * 8 / 1e9
        elif direction in measured_bytes_per_s:
            line[key] = min(max(measured_bytes_per_s[direction] * 8 / 1e9, MIN_BANDWIDTH_GBPS), MAX_BANDWIDTH_GBPS)
    return line
