"""An agent's events as JSON lines in a file: what the local swarm's display and summary read.

One JSON object per line, appended and flushed as it happens (``{"event": "step", "time": ..., ...}``);
a reader only takes complete lines, so it may poll while the agent writes. Kinds an agent writes:
``started``, ``profile``, ``links``, ``plan`` (the leader: cluster, workload, plan document), ``role``,
``step``, ``done``, ``stopped``, ``error``, ``dht_traffic`` (``TrafficReport``).

A ``step`` event says where the step went: ``step_time_s`` (the trainer's step, end to end), ``compute_s``
(its forwards, backwards and update, ``ProgressRecord.compute_s``) and ``compute_cpu_s`` (the training
thread's CPU time in them: less where it waited for a core or the GIL), ``recv_wait_s`` (waiting for the
pipeline's activations and gradients), ``reduce_wait_s`` (for the data-parallel all-reduce after the last
backward), ``send_wait_s`` (for its own sends at the end), and ``between_s`` (the agent's own work since
the step before: keeping the state, heartbeats, copies).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

END_EVENTS = ("done", "stopped")  # an agent's last event


class EventLog:
    """Appends events to ``path``; a no-op without a path. Thread-safe."""

    def __init__(self, path: str | Path | None):
        self.path = Path(path) if path else None
        self._lock = threading.Lock()
        self._end_hooks: list[Callable[[], None]] = []

    def before_end(self, hook: Callable[[], None]) -> None:
        """Call ``hook`` before each ``done`` or ``stopped`` event is written (``TrafficReport``'s last totals)."""
        self._end_hooks.append(hook)

    def write(self, event: str, **fields: Any) -> None:
        if self.path is None:
            return
        if event in END_EVENTS:
            for hook in self._end_hooks:
                hook()
        line = json.dumps({"event": event, "time": time.time(), **fields}, separators=(",", ":")) + "\n"
        with self._lock, self.path.open("a") as f:
            f.write(line)


class TrafficReport:
    """Writes what this agent's DHT calls cost so far (``net.dht.counters.DHTCounters``: per record kind, stores
    and reads with their bytes, failures and seconds) and its control traffic on the transport
    (``net.transport.counters.ControlCounters``: pings and probes) as a ``dht_traffic`` event, every
    ``every_s`` when ``maybe`` is called (each membership poll) and before the agent's last event
    (``EventLog.before_end``)."""

    def __init__(self, events: EventLog, counters: Any, control: Any, every_s: float = 60.0):
        self.events, self.counters, self.control, self.every_s = events, counters, control, every_s
        self._started = self._last = time.monotonic()
        events.before_end(self.final)

    def maybe(self) -> None:
        if time.monotonic() - self._last >= self.every_s:
            self.final()

    def final(self) -> None:
        self._last = time.monotonic()
        self.events.write("dht_traffic", uptime_s=round(self._last - self._started, 3),
                          kinds=self.counters.snapshot(), control=self.control.snapshot())


class EventReader:
    """Reads the complete lines appended to ``path`` since the last call."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._offset = 0
        self.events: list[dict[str, Any]] = []

    def poll(self) -> list[dict[str, Any]]:
        try:
            with self.path.open("rb") as f:
                f.seek(self._offset)
                chunk = f.read()
        except FileNotFoundError:
            return []
        complete = chunk[: chunk.rfind(b"\n") + 1]
        self._offset += len(complete)
        new = [json.loads(line) for line in complete.decode().splitlines() if line.strip()]
        self.events.extend(new)
        return new

    def last(self, event: str) -> dict[str, Any] | None:
        return next((e for e in reversed(self.events) if e["event"] == event), None)

    def all(self, event: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["event"] == event]
