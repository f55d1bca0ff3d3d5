"""``p2ptrain monitor``: watch a run in a browser: a DHT-only peer that serves a live page of its records.

    p2ptrain monitor --initial-peers /ip4/203.0.113.7/tcp/31337/p2p/Qm... --run demo --port 8080
    p2ptrain monitor --initial-peers "$(cat maddrs.txt)" --run demo --host 0.0.0.0 --tokens-per-step 16384
    p2ptrain monitor --initial-peers "$(cat maddrs.txt)" --run demo --tensorboard runs/demo   # and TensorBoard

Prints the page's URL on one stdout line; the page is at ``/``, the JSON at ``/api/state``, Prometheus
metrics at ``/metrics``. Logs to stderr, runs until SIGTERM or SIGINT. It never joins the run: it publishes
nothing, so it is never a member and never leads. Flags override the ``--config`` TOML file (the fields of
``MonitorConfig``; ``[dht]`` those of ``DHTConfig``).
"""

from __future__ import annotations

import dataclasses
import sys

import click

from p2ptrain.cli.bootstrap import _split
from p2ptrain.config import load_toml
from p2ptrain.errors import ProtocolError


@click.command(name="monitor")
@click.option("--initial-peers", multiple=True,
              help="Peers of the run to join through, e.g. the bootstrap's line (full multiaddrs with /p2p/).")
@click.option("--run", "run_id", help="The run to watch (its DHT keys).")
@click.option("--port", type=click.IntRange(0, 65535),
              help="HTTP port (0: any free port; the printed URL says which).  [default: 8080]")
@click.option("--host", help="Address to serve on; 0.0.0.0 shows the page to other machines.  [default: 127.0.0.1]")
@click.option("--poll", "poll_s", type=click.FloatRange(min=0, min_open=True),
              help="Seconds between reads of the run's records.  [default: 2]")
@click.option("--tokens-per-step", type=click.IntRange(min=1),
              help="Global batch × sequence length, to show tokens/s.")
@click.option("--time-scale", type=click.FloatRange(min=0, min_open=True),
              help="An emulated network's time scale (p2ptrain swarm sets it).")
@click.option("--size-factor", type=click.FloatRange(min=0, min_open=True),
              help="An emulated network's size factor (p2ptrain swarm sets it).")
@click.option("--announce-file", type=click.Path(dir_okay=False), help="Also write the URL to this file.")
@click.option("--server-mode", is_flag=True, help="Serve DHT requests too (default: client mode, only read).")
@click.option("--tensorboard", "tensorboard_dir", type=click.Path(file_okay=False),
              help="Also write the run's progress as TensorBoard event files here (needs p2ptrain[tensorboard]).")
@click.option("--config", "config_path", type=click.Path(dir_okay=False),
              help="TOML config: MonitorConfig's fields, [dht] its DHTConfig (flags override it).")
def command(initial_peers: tuple[str, ...], run_id: str | None, port: int | None, host: str | None,
            poll_s: float | None, tokens_per_step: int | None, time_scale: float | None,
            size_factor: float | None, announce_file: str | None, server_mode: bool, tensorboard_dir: str | None,
            config_path: str | None) -> None:
    """Serve a live web page, a JSON API and Prometheus metrics of a run."""
    from p2ptrain.errors import ConfigError
    from p2ptrain.lifecycle import StopSignal
    from p2ptrain.monitor.server import MonitorConfig, serve_monitor

    if config_path:
        config = load_toml(MonitorConfig, config_path)
    elif run_id:
        config = MonitorConfig(run=run_id)
    else:
        raise ConfigError("say which run to watch: --run NAME (or run = ... in --config)")
    flags = {"run": run_id, "host": host, "port": port, "poll_s": poll_s, "tokens_per_step": tokens_per_step,
             "time_scale": time_scale, "size_factor": size_factor, "announce_file": announce_file,
             "tensorboard_dir": tensorboard_dir}
    dht = config.dht
    if initial_peers:
        dht = dataclasses.replace(dht, initial_peers=_split(initial_peers))
    if server_mode:
        dht = dataclasses.replace(dht, client_mode=False)
    if not dht.initial_peers:
        raise ConfigError("say whom to join through: --initial-peers MADDR (e.g. the bootstrap's line)")
    config = dataclasses.replace(config, dht=dht, **{k: v for k, v in flags.items() if v is not None})

    def print_url(url: str) -> None:
        click.echo(url)
        sys.stdout.flush()

    try:
        with StopSignal() as stop:
            serve_monitor(config, stop, on_ready=print_url)
    except ProtocolError as e:
        raise click.ClickException(str(e)) from None
