"""What one agent's control traffic on the transport costs (``ControlCounters``): its heartbeat pings and its
link probes (the probe streams' round trips, the access probe's too), by kind.

Training traffic (activations, gradients, states, copies) is not control traffic and is not counted here.
"""

from __future__ import annotations

from p2ptrain.net.counters import Counters

PING, PROBE = "ping", "probe"


class ControlCounters(Counters):
    """Per kind (``PING``, ``PROBE``): ``calls`` (pings sent, probe round trips), ``bytes`` (sent and received,
    payloads), ``failures`` (no answer in time, a refusal, a malformed answer) and ``seconds`` (waiting for
    answers). Thread-safe; ``snapshot`` is cumulative since start (the ``dht_traffic`` event's ``control``)."""

    FIELDS = ("calls", "bytes", "failures", "seconds")

    def add(self, kind: str, **amounts: float) -> None:
        self._add(kind, amounts)
