"""What one agent's DHT calls cost (``DHTCounters``): ``SwarmDHT`` counts each store and read it makes."""

from __future__ import annotations

import threading
from typing import Any

from p2ptrain.net.dht.keys import RecordKind


class DHTCounters:
    """What one agent's DHT calls cost, by record kind: stores and reads, their bytes (values sent; entries
    received), their failures (a timeout, no replica that accepted, the DHT process gone) and their seconds.
    Thread-safe; ``snapshot`` is cumulative since start (the ``dht_traffic`` event, the swarm's summary)."""

    FIELDS = ("stores", "store_bytes", "store_failures", "reads", "read_bytes", "read_failures", "seconds")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_kind: dict[str, dict[str, float]] = {}

    def add(self, kind: RecordKind, **amounts: float) -> None:
        with self._lock:
            row = self._by_kind.setdefault(kind.value, dict.fromkeys(self.FIELDS, 0))
            for name, amount in amounts.items():
                row[name] += amount

    def snapshot(self) -> dict[str, dict[str, float]]:
        """{kind: {field: total}}, with ``seconds`` rounded to milliseconds."""
        with self._lock:
            return {kind: {k: round(v, 3) if k == "seconds" else int(v) for k, v in row.items()}
                    for kind, row in sorted(self._by_kind.items())}


def entry_bytes(found: Any) -> int:
    """The bytes of the entries a read returned (each subkey's value; 0 for none or a plain value)."""
    value = getattr(found, "value", None)
    if not isinstance(value, dict):
        return 0
    return sum(len(entry.value) for entry in value.values() if isinstance(getattr(entry, "value", None), bytes))
