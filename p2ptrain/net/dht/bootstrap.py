"""The bootstrap peer: a DHT-only peer that agents join through (``p2ptrain bootstrap``).

It serves DHT requests and publishes no records, so it is never a member of a run and never leads. Give it
a stable identity and a fixed port, so that the line it prints stays valid across restarts (see
``bootstrap/README.md``)::

    p2ptrain bootstrap --host-maddrs /ip4/0.0.0.0/tcp/31337 --identity bootstrap.id --announce-file maddrs.txt
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from p2ptrain.errors import ConfigError
from p2ptrain.lifecycle import StopSignal, service_loop
from p2ptrain.net.dht.keys import check_run_id
from p2ptrain.net.dht.node import DHTConfig, SwarmDHT
from p2ptrain.net.nat.forward import ForwardStats, serve_forwarding
from p2ptrain.net.nat.relay import RelayConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BootstrapConfig:
    # a bootstrap is public and relays for agents behind NAT (bootstrap/README.md says what that costs)
    dht: DHTConfig = field(default_factory=lambda: DHTConfig(relay=RelayConfig(reachability="public")))
    announce_file: str | None = None  # where to write the multiaddr line (atomically); removed on exit
    run_ids: tuple[str, ...] = ()  # runs whose keys this peer checks at admission (optional, recommended)
    status_period_s: float = 60.0  # how often to log the routing table size

    def __post_init__(self) -> None:
        for run_id in self.run_ids:
            try:
                check_run_id(run_id)
            except ValueError as e:
                raise ConfigError(str(e)) from None
        if not self.status_period_s > 0:
            raise ConfigError(f"status_period_s={self.status_period_s} must be positive")


def serve_bootstrap(config: BootstrapConfig, stop: StopSignal, on_ready: Callable[[list[str]], None]) -> None:
    """Run a bootstrap peer until ``stop`` is set; ``on_ready(maddrs)`` is called once it can be joined."""
    with SwarmDHT(None, config.dht, admission_run_ids=config.run_ids) as dht, _Forwarding(dht, config.dht) as fwd:
        maddrs = dht.get_visible_maddrs()
        announce = Path(config.announce_file) if config.announce_file else None
        if announce is not None:
            write_atomically(announce, " ".join(maddrs) + "\n")
        on_ready(maddrs)
        logger.info("bootstrap peer %s serving; stop with SIGTERM or Ctrl-C", dht.peer_id)
        try:
            while not stop.wait(config.status_period_s):
                try:
                    logger.info("routing table: %d peers%s", dht.routing_table_size(), fwd.status())
                except Exception as e:  # a slow status query must not stop the bootstrap
                    logger.warning("status query failed: %s", e)
            logger.info("stopping (%s)", stop.reason)
        finally:
            if announce is not None:
                announce.unlink(missing_ok=True)


class _Forwarding:
    """The bootstrap forwards streams to agents behind NAT (``forward.py``), on a loop thread of its own."""

    def __init__(self, dht: SwarmDHT, config: DHTConfig):
        self.stats: ForwardStats | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._p2p = None
        relay = config.relay
        if not (relay.reachability == "public" and relay.serve and relay.forward):
            return
        self._loop = service_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="p2ptrain-forwarding", daemon=True)
        self._thread.start()

        async def start() -> ForwardStats:
            self._p2p = await dht.hivemind_dht.replicate_p2p()
            return await serve_forwarding(self._p2p, relay.forward_limits())

        try:
            self.stats = asyncio.run_coroutine_threadsafe(start(), self._loop).result(config.startup_timeout_s)
        except BaseException:
            self.close()
            raise

    def status(self) -> str:
        s = self.stats
        if s is None:
            return ""
        return f"; forwarding {s.total} streams now, {s.streams} so far, {s.bytes / 2**20:.1f} MiB"

    def close(self, timeout_s: float = 10.0) -> None:
        loop, self._loop = self._loop, None
        if loop is None:
            return

        async def stop() -> None:
            if self._p2p is not None:
                self._p2p._terminate()  # noqa: SLF001 - a replica: closes its client and listener only
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        try:
            asyncio.run_coroutine_threadsafe(stop(), loop).result(timeout_s)
        except Exception as e:  # shutting down: say it, and stop the loop anyway
            logger.warning("stopping the forwarding loop: %r", e)
        loop.call_soon_threadsafe(loop.stop)
        self._thread.join(timeout_s)
        if not self._thread.is_alive():
            loop.close()

    def __enter__(self) -> _Forwarding:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def write_atomically(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` so that readers see the old file or the whole new one, never a part."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise ConfigError(f"cannot write announce file {path}: {e.strerror}") from None
