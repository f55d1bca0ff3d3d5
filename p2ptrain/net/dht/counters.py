"""What one agent's DHT calls cost (``DHTCounters``): ``SwarmDHT`` counts each store and read it makes."""

from __future__ import annotations

from typing import Any

from p2ptrain.net.counters import Counters
from p2ptrain.net.dht.keys import RecordKind


class DHTCounters(Counters):
    """What one agent's DHT calls cost, by record kind: stores and reads, their bytes (values sent; entries
    received), their failures (a timeout, no replica that accepted, the DHT process gone) and their seconds.
    Thread-safe; ``snapshot`` is cumulative since start (the ``dht_traffic`` event, the swarm's summary)."""

    FIELDS = ("stores", "store_bytes", "store_failures", "reads", "read_bytes", "read_failures", "seconds")

    def add(self, kind: RecordKind, **amounts: float) -> None:
        self._add(kind.value, amounts)


def entry_bytes(found: Any) -> int:
    """The bytes of the entries a read returned (each subkey's value; 0 for none or a plain value)."""
    value = getattr(found, "value", None)
    if not isinstance(value, dict):
        return 0
    return sum(len(entry.value) for entry in value.values() if isinstance(getattr(entry, "value", None), bytes))
