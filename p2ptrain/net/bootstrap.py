"""The bootstrap peer: a DHT-only peer that agents join through (``p2ptrain bootstrap``).

It serves DHT requests and publishes no records, so it is never a member of a run and never leads. Give it
a stable identity and a fixed port, so that the line it prints stays valid across restarts (see
``bootstrap/README.md``)::

    p2ptrain bootstrap --host-maddrs /ip4/0.0.0.0/tcp/31337 --identity bootstrap.id --announce-file maddrs.txt
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from p2ptrain.errors import ConfigError
from p2ptrain.net.dht import DHTConfig, SwarmDHT
from p2ptrain.net.keys import check_run_id
from p2ptrain.net.lifecycle import StopSignal
from p2ptrain.net.relay import RelayConfig

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
    with SwarmDHT(None, config.dht, admission_run_ids=config.run_ids) as dht:
        maddrs = dht.get_visible_maddrs()
        announce = Path(config.announce_file) if config.announce_file else None
        if announce is not None:
            write_atomically(announce, " ".join(maddrs) + "\n")
        on_ready(maddrs)
        logger.info("bootstrap peer %s serving; stop with SIGTERM or Ctrl-C", dht.peer_id)
        try:
            while not stop.wait(config.status_period_s):
                try:
                    logger.info("routing table: %d peers", dht.routing_table_size())
                except Exception as e:  # a slow status query must not stop the bootstrap
                    logger.warning("status query failed: %s", e)
            logger.info("stopping (%s)", stop.reason)
        finally:
            if announce is not None:
                announce.unlink(missing_ok=True)


def write_atomically(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` so that readers see the old file or the whole new one, never a part."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise ConfigError(f"cannot write announce file {path}: {e.strerror}") from None
