"""A link emulator and a pacer that keep what a transport asked of them: the arrival times it computed, the
stamps it honoured and the arrivals it reported. Tests assert on these (the emulator's arithmetic), not on how
long the machine took, which load changes.

    monkeypatch.setattr("p2ptrain.net.transport.endpoint.Pacer", RecordingPacer)  # every transport's pacer
    sender = make_transport(emulator=RecordingEmulator())
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass

from p2ptrain.net.transport.emulation import LinkEmulator, Reservation
from p2ptrain.net.transport.messages import Stamp
from p2ptrain.net.transport.pacing import Pacer

_LATE_S = contextvars.ContextVar("late_s", default=0.0)  # the last wait's lateness, per task


@dataclass(frozen=True)
class Booked:
    """One message booked on a shaped link: to whom, how many bytes, and the slot it got."""

    peer: str
    size_bytes: int
    slot: Reservation


class RecordingEmulator(LinkEmulator):
    """A link emulator on the machine's monotonic clock (as a transport needs) that keeps every slot it booked."""

    def __init__(self):
        super().__init__()
        self.booked: list[Booked] = []

    def reserve(self, peer: str, size_bytes: int) -> Reservation | None:
        slot = super().reserve(peer, size_bytes)
        if slot is not None:
            self.booked.append(Booked(str(peer), size_bytes, slot))
        return slot

    def to(self, peer: object) -> list[Booked]:
        return [b for b in self.booked if b.peer == str(peer)]


@dataclass(frozen=True)
class Held:
    """A message held until its stamp: the stamp's time (None: no stamp), when the hold began and when it ended,
    ``late_s`` after the wait the stamp asked for (a late wake-up played by a subclass; 0 here)."""

    stamp_s: float | None
    entered_s: float
    returned_s: float
    late_s: float


@dataclass(frozen=True)
class Report:
    """An arrival the replier reported for a probe: its stamp, when its last bytes were read, what it said."""

    stamp_s: float | None
    read_s: float
    reported_s: float


class RecordingPacer(Pacer):
    """A transport's pacer that keeps every wait it was asked for (``waits``, target times), every hold of an
    incoming message (``holds``) and every arrival it reported for a probe (``reports``). All are appended on
    the transport's loop; read them once the calls that made them are done."""

    def __init__(self):
        super().__init__()
        self.waits: list[float] = []
        self.holds: list[Held] = []
        self.reports: list[Report] = []

    async def sleep_until(self, when_s: float) -> None:
        self.waits.append(when_s)
        late_s = self.lateness()
        _LATE_S.set(late_s)
        await super().sleep_until(when_s + late_s)

    def lateness(self) -> float:
        """How late the next wait ends on purpose (a subclass plays a busy machine); none here."""
        return 0.0

    async def hold(self, stamp: Stamp | None, limit_s: float) -> None:
        entered_s = self.clock()
        _LATE_S.set(0.0)  # stays 0 when the stamp is not on our clock: no wait, so no late wake-up
        await super().hold(stamp, limit_s)
        self.holds.append(Held(None if stamp is None else stamp.time_s, entered_s, self.clock(), _LATE_S.get()))

    def arrived_s(self, stamp: Stamp | None, read_s: float) -> float:
        reported_s = super().arrived_s(stamp, read_s)
        self.reports.append(Report(None if stamp is None else stamp.time_s, read_s, reported_s))
        return reported_s
