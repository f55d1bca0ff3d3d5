"""The links rows this peer read lately, by writer and version, so that it checks a plan on the rows its
leader planned with (``PlanRecord.rows``).

A row changes with every measurement its writer publishes (an entry added, a best guess replaced by an agreed
measurement, a link measured again), and a plan's neighbours measure each other once it is out: the rows a
follower reads when it checks a plan are not those its leader read. ``LinksRecord.as_of`` cuts a later row back
to the entries it had, not to the values they had then; a follower that read the very version its leader
planned with checks on that (``RowHistory.as_planned``). Every ``SwarmDHT.read_links`` notes what it read; the
last ``per_peer`` versions of each writer are kept.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

from p2ptrain.net.dht.records import LinksRecord

PER_PEER = 32  # versions kept of each writer's row: more than a row changes in a run's first link phase


class RowHistory:
    """The versioned links rows read, the last ``per_peer`` of each writer (thread-safe)."""

    def __init__(self, per_peer: int = PER_PEER) -> None:
        self.per_peer = per_peer
        self._rows: dict[str, dict[int, LinksRecord]] = {}
        self._lock = threading.Lock()

    def note(self, rows: Mapping[str, LinksRecord]) -> None:
        """Keep ``rows`` (by writer) that name a version."""
        with self._lock:
            for peer, row in rows.items():
                if row.version:
                    held = self._rows.setdefault(peer, {})
                    held[row.version] = row
                    for version in sorted(held)[: max(0, len(held) - self.per_peer)]:
                        del held[version]

    def as_planned(self, peer: str, version: int, latest: LinksRecord | None) -> LinksRecord | None:
        """``peer``'s row as it stood at ``version`` (0: none; a leader that had no row of it): the version itself
        where we read it; else the first later one we hold (or ``latest``), cut back to the entries it had then
        (``LinksRecord.as_of``); else the last earlier one (it lacks entries the leader had; we estimate those
        links, as the leader would have without them)."""
        if latest is not None and not latest.version:  # a writer that names no version: as it is
            return latest
        if version <= 0:
            return None
        with self._lock:
            held = dict(self._rows.get(peer, {}))
        if latest is not None:
            held.setdefault(latest.version, latest)
        if version in held:
            return held[version]
        later = [v for v in held if v > version]
        if later:
            return held[min(later)].as_of(version)
        earlier = [v for v in held if v < version]
        return held[max(earlier)] if earlier else None
