"""What the served end of a probe stream times of it (``ServedSamples``): the figure of the link at that end too
(``probe.served_estimate``), so that one measurement gives both ends of a pair theirs."""

from __future__ import annotations

from p2ptrain.net.transport.messages import Stamp
from p2ptrain.net.transport.pacing import clock_domain

MAX_SERVED_SAMPLES = 256  # probes of one stream the served end keeps (a measurement sends 10-30)


class ServedSamples:
    """What the served end of a probe stream timed (``TensorServicer.rpc_probe``), so that one measurement gives
    both ends of a pair their figure (``served_estimate``): per probe its size and when it was in, on our clock
    (after its emulated arrival), and the prober's stamp of when it sent it where that is on our clock too (one
    machine). At most ``MAX_SERVED_SAMPLES``; a stream that pulled bytes back (an access probe, several flows at
    once) gives none."""

    def __init__(self) -> None:
        self.samples: list[tuple[int, float, float | None]] = []
        self.pulls = False

    def add(self, nbytes: int, in_s: float, sent: Stamp | None, reply_bytes: int) -> None:
        self.pulls = self.pulls or reply_bytes > 0
        if len(self.samples) < MAX_SERVED_SAMPLES:
            self.samples.append((nbytes, in_s, sent.time_s if sent is not None and sent.clock == clock_domain() else None))
