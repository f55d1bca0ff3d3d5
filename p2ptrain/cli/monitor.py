"""``p2ptrain monitor``: watch a run in a browser: a DHT-only peer that serves a live page of its records.

    p2ptrain monitor --initial-peers /ip4/203.0.113.7/tcp/31337/p2p/Qm... --run demo --port 8080
    p2ptrain monitor --initial-peers "$(cat maddrs.txt)" --run demo --host 0.0.0.0 --tokens-per-step 16384
    p2ptrain monitor --initial-peers "$(cat maddrs.txt)" --run demo --tensorboard runs/demo   # and TensorBoard

Prints the page's URL on one stdout line; the page is at ``/``, the JSON at ``/api/state``, Prometheus
metrics at ``/metrics``. Logs to stderr, runs until SIGTERM or SIGINT. It never joins the run: it publishes
nothing, so it is never a member and never leads.
"""

from __future__ import annotations

import dataclasses
import sys

import click

from p2ptrain.cli.bootstrap import _split
from p2ptrain.errors import ProtocolError


@click.command(name="monitor")
@click.option("--initial-peers", multiple=True, required=True,
              help="Peers of the run to join through, e.g. the bootstrap's line (full multiaddrs with /p2p/).")
@click.option("--run", "run_id", required=True, help="The run to watch (its DHT keys).")
@click.option("--port", type=click.IntRange(0, 65535), default=8080, show_default=True,
              help="HTTP port (0: any free port; the printed URL says which).")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to serve on; 0.0.0.0 shows the page to other machines.")
@click.option("--poll", "poll_s", type=click.FloatRange(min=0, min_open=True), default=2.0, show_default=True,
              help="Seconds between reads of the run's records.")
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
def command(initial_peers: tuple[str, ...], run_id: str, port: int, host: str, poll_s: float,
            tokens_per_step: int | None, time_scale: float | None, size_factor: float | None,
            announce_file: str | None, server_mode: bool, tensorboard_dir: str | None) -> None:  # fmt: skip
    """Serve a live web page, a JSON API and Prometheus metrics of a run."""
    from p2ptrain.monitor.server import MonitorConfig, serve_monitor
    from p2ptrain.net.lifecycle import StopSignal

    base = MonitorConfig(run=run_id)
    config = dataclasses.replace(
        base, dht=dataclasses.replace(base.dht, initial_peers=_split(initial_peers), client_mode=not server_mode),
        host=host, port=port, poll_s=poll_s, tokens_per_step=tokens_per_step, time_scale=time_scale,
        size_factor=size_factor, announce_file=announce_file, tensorboard_dir=tensorboard_dir,
    )  # fmt: skip

    def print_url(url: str) -> None:
        click.echo(url)
        sys.stdout.flush()

    try:
        with StopSignal() as stop:
            serve_monitor(config, stop, on_ready=print_url)
    except ProtocolError as e:
        raise click.ClickException(str(e)) from None
