"""Keeps this peer's own DHT records alive: each is re-stored before it expires until replaced or withdrawn.

A DHT cannot delete: a record lives until its expiration, so every record is stored with a TTL and the
owner re-stores it every ``period_s(kind)`` (a fraction of the TTL). One daemon thread sleeps on a
condition variable until the next record is due. A failed store (ours or a re-store) is logged and tried again
after a back-off that doubles with each failure in a row from ``retry_s`` (``retry.backoff_s``, jittered), never
later than a period: a DHT that does not answer in time is a loaded one, and a crowd retrying every few seconds
kept it so (a 64-agent swarm on two cores: 157 of one agent's 158 stores of its links row timed out). A record
published while its store fails is still the one re-stored (not the older one it replaces). Stores of one kind are serialised (``publish`` and refreshes take the kind's lock), and a
refresh re-checks under that lock that its record is still the current one, so a refresh of an old
record can never land after, and overwrite, a newer one.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from p2ptrain.net.dht.keys import RecordKind
from p2ptrain.net.dht.records import Record
from p2ptrain.net.dht.retry import backoff_s

logger = logging.getLogger(__name__)


@dataclass
class _Tracked:
    record: Record
    due: float  # time.monotonic() of the next re-store
    failures: int = 0  # stores of it that failed in a row


class Refresher:
    def __init__(
        self,
        store: Callable[[RecordKind, Record], bool],
        period_s: Callable[[RecordKind], float],
        retry_s: float = 5.0,
    ):
        self._store, self._period_s, self._retry_s = store, period_s, retry_s
        self._locks = {kind: threading.Lock() for kind in RecordKind}
        self._tracked: dict[RecordKind, _Tracked] = {}
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopped = False

    def publish(self, record: Record, refresh: bool) -> bool:
        """Store ``record`` now; with ``refresh``, keep re-storing it until replaced or withdrawn."""
        kind = record.kind
        with self._locks[kind]:
            stored = False
            try:
                stored = self._store(kind, record)
            finally:  # a store that raised (timed out) is tried again after the back-off too
                with self._cond:
                    if refresh:
                        old = self._tracked.get(kind)
                        tracked = _Tracked(record, 0.0, 0 if stored else (old.failures if old else 0) + 1)
                        tracked.due = self._next_due(kind, tracked.failures)
                        self._tracked[kind] = tracked
                        self._cond.notify_all()
                    else:
                        self._tracked.pop(kind, None)
        return stored

    def withdraw(self, kind: RecordKind) -> None:
        with self._cond:
            self._tracked.pop(kind, None)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="p2ptrain-dht-refresh", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _next_due(self, kind: RecordKind, failures: int) -> float:
        """When to store a record of ``kind`` again after ``failures`` failed stores in a row (0: it was stored)."""
        period_s = self._period_s(kind)
        return time.monotonic() + (min(period_s, backoff_s(failures, self._retry_s)) if failures else period_s)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stopped:
                    now = time.monotonic()
                    due = [(kind, t.record) for kind, t in self._tracked.items() if t.due <= now]
                    if due:
                        break
                    next_due = min((t.due for t in self._tracked.values()), default=None)
                    self._cond.wait(None if next_due is None else next_due - now)
                if self._stopped:
                    return
            for kind, record in due:
                self._refresh(kind, record)

    def _refresh(self, kind: RecordKind, record: Record) -> None:
        with self._locks[kind]:
            with self._cond:
                tracked = self._tracked.get(kind)
                if self._stopped or tracked is None or tracked.record is not record:
                    return  # replaced or withdrawn meanwhile
            try:
                stored = self._store(kind, record)
            except Exception as e:  # a failed refresh is retried; it must never kill the thread
                logger.warning(
                    "refreshing our %s record failed (%s: %s); retrying", kind.value, type(e).__name__, e
                )
                stored = False
            with self._cond:
                if self._tracked.get(kind) is tracked:
                    tracked.failures = 0 if stored else tracked.failures + 1
                    tracked.due = self._next_due(kind, tracked.failures)
