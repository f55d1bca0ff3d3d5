"""``p2ptrain bootstrap``: run a DHT-only peer that agents join through.

    p2ptrain bootstrap --host-maddrs /ip4/0.0.0.0/tcp/31337 --identity bootstrap.id --announce-file maddrs.txt

Prints its full multiaddrs (ending in /p2p/<peer ID>) on one stdout line, logs to stderr, and runs until
SIGTERM or SIGINT, then stops the DHT and p2pd and exits 0. Flags override the ``--config`` TOML file
(see bootstrap/bootstrap.example.toml).
"""

from __future__ import annotations

import dataclasses
import re
import sys

import click

from p2ptrain.config import load_toml
from p2ptrain.errors import ProtocolError


def _split(values: tuple[str, ...]) -> tuple[str, ...]:
    """Flags may be repeated or hold several addresses separated by spaces or commas (a pasted line)."""
    return tuple(item for value in values for item in re.split(r"[\s,]+", value) if item)


@click.command(name="bootstrap")
@click.option("--host-maddrs", multiple=True, help="Listen on these multiaddrs, e.g. /ip4/0.0.0.0/tcp/31337.")
@click.option(
    "--announce-maddrs", multiple=True, help="Public multiaddrs to advertise (behind NAT/port forwarding)."
)
@click.option(
    "--initial-peers", multiple=True, help="Other bootstrap peers to join (full multiaddrs with /p2p/)."
)
@click.option(
    "--identity",
    type=click.Path(dir_okay=False),
    help="Identity file for a stable peer ID (created if missing).",
)
@click.option(
    "--announce-file", type=click.Path(dir_okay=False), help="Also write the multiaddr line to this file."
)
@click.option(
    "--run-id", "run_ids", multiple=True, help="Check records of this run at admission (repeatable)."
)
@click.option(
    "--reachability", type=click.Choice(["auto", "public", "private"]),
    help="public: relay for agents behind NAT (the default); private: this bootstrap is itself behind NAT.",
)
@click.option("--no-relay-service", is_flag=True, help="Do not relay for agents behind NAT.")
@click.option(
    "--config", "config_path", type=click.Path(dir_okay=False), help="TOML config (flags override it)."
)
def command(
    host_maddrs: tuple[str, ...],
    announce_maddrs: tuple[str, ...],
    initial_peers: tuple[str, ...],
    identity: str | None,
    announce_file: str | None,
    run_ids: tuple[str, ...],
    reachability: str | None,
    no_relay_service: bool,
    config_path: str | None,
) -> None:
    """Run a DHT-only bootstrap peer and print its multiaddrs on one line."""
    from p2ptrain.lifecycle import StopSignal
    from p2ptrain.net.dht.bootstrap import BootstrapConfig, serve_bootstrap

    config = load_toml(BootstrapConfig, config_path) if config_path else BootstrapConfig()
    dht_overrides = {
        name: value
        for name, value in (
            ("host_maddrs", _split(host_maddrs)),
            ("announce_maddrs", _split(announce_maddrs)),
            ("initial_peers", _split(initial_peers)),
            ("identity_path", identity),
        )
        if value
    }
    overrides = {
        name: value for name, value in (("announce_file", announce_file), ("run_ids", run_ids)) if value
    }
    relay = config.dht.relay
    if reachability or no_relay_service:
        relay = dataclasses.replace(relay, reachability=reachability or relay.reachability,
                                    serve=relay.serve and not no_relay_service)
    config = dataclasses.replace(
        config, dht=dataclasses.replace(config.dht, relay=relay, **dht_overrides), **overrides
    )

    def print_maddrs(maddrs: list[str]) -> None:
        click.echo(" ".join(maddrs))
        sys.stdout.flush()

    try:
        with StopSignal() as stop:
            serve_bootstrap(config, stop, on_ready=print_maddrs)
    except ProtocolError as e:
        raise click.ClickException(str(e)) from None
