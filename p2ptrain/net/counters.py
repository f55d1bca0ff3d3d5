"""Counters of one agent's calls by kind (``Counters``): the DHT's (``dht.counters``) and the transport's
control traffic (``transport.counters``), written as the ``dht_traffic`` event."""

from __future__ import annotations

import threading
from typing import ClassVar


class Counters:
    """Totals of ``FIELDS`` per kind since start; thread-safe. ``seconds`` fields are rounded to milliseconds in
    ``snapshot``, the others are integers."""

    FIELDS: ClassVar[tuple[str, ...]] = ()

    def __init__(self) -> None:
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
