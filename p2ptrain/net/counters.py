"""Counters of one agent's calls by kind (``Counters``): the DHT's (``dht.counters``) and the transport's
control traffic (``transport.counters``), written as the ``dht_traffic`` event."""

from __future__ import annotations

import threading
import time
from typing import ClassVar


class Counters:
    """Totals of ``FIELDS`` per kind since start; thread-safe. ``seconds`` fields are rounded to milliseconds in
    ``snapshot``, the others are integers."""

    FIELDS: ClassVar[tuple[str, ...]] = ()

    def __init__(self) -> None:
        self.started = time.monotonic()
        self._lock = threading.Lock()
        self._by_kind: dict[str, dict[str, float]] = {}

    def _add(self, kind: str, amounts: dict[str, float]) -> None:
        with self._lock:
            row = self._by_kind.setdefault(kind, dict.fromkeys(self.FIELDS, 0))
            for name, amount in amounts.items():
                row[name] += amount

    def snapshot(self) -> dict[str, dict[str, float]]:
        """{kind: {field: total}}."""
        with self._lock:
            return {kind: {k: round(v, 3) if k == "seconds" else int(v) for k, v in row.items()}
                    for kind, row in sorted(self._by_kind.items())}


def traffic_per_minute(dht: Counters, control: Counters) -> tuple[int, int, int]:
    """An agent's control plane a minute since its DHT counters started: its DHT calls (stores and reads), their kB (values
    sent, entries received), and its control traffic's kB (pings and probes, sent and received): the order of
    ``ProgressRecord.traffic`` (``records.TRAFFIC_FIELDS``)."""
    per_min = 60.0 / max(time.monotonic() - dht.started, 1.0)
    kinds, controls = dht.snapshot().values(), control.snapshot().values()
    calls = sum(k.get("stores", 0) + k.get("reads", 0) for k in kinds)
    dht_bytes = sum(k.get("store_bytes", 0) + k.get("read_bytes", 0) for k in kinds)
    control_bytes = sum(c.get("bytes", 0) for c in controls)
    return round(calls * per_min), round(dht_bytes / 1e3 * per_min), round(control_bytes / 1e3 * per_min)
