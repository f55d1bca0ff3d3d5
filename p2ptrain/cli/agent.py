"""``p2ptrain agent``: join a run, profile, measure links, elect a leader, plan, train.

    p2ptrain agent --initial-peers "$(cat bootstrap.maddrs)" --run demo --stages 2 --expect 4 --steps 100
    p2ptrain agent --config agent.toml --initial-peers "/ip4/203.0.113.7/tcp/31337/p2p/Qm..."

Flags override the ``--config`` TOML file (``agent/agent.example.toml`` lists every key; unknown keys are
refused), which overrides the defaults. Logs go to stderr, one readable line per step. SIGTERM or SIGINT
stop it cleanly (transport, DHT process and p2pd shut down) with exit code 0; it exits 0 once every step
is trained, 1 on a failure (the message says which peer or what to change), 2 on bad input.
"""

from __future__ import annotations

import os
from pathlib import Path

import click

from p2ptrain.agent.config import AgentConfig
from p2ptrain.cli.bootstrap import _split
from p2ptrain.cli.config_options import Flag, OptionTable, merge
from p2ptrain.cli.optimizer_options import RECIPES_HELP, optimizer_flags, sync_flags


def _maddrs(values: tuple[str, ...]) -> list[str] | None:
    return list(_split(values)) or None


OPTIONS = OptionTable(AgentConfig, [
    Flag("--config", param="config_path", type=click.Path(dir_okay=False), help="TOML config (flags override it)."),
    Flag(None, "initial_peers", convert=_maddrs), "run", "train.stages",
    "membership.expect", "membership.join_deadline_s", "membership.min_peers",
    "train.model", Flag(None, "train.subspace", help="Residual stream in a fixed subspace of this rank: stage boundaries "
                        "carry this many values a token (0: off; every agent of a run must agree)."), "train.steps", Flag("--batch-size", "train.global_batch_size"), "train.micro_batches",
    Flag(None, "train.wire", help="How tensors travel between agents (fp32 is exact; every agent of a run must agree)."),
    "train.schedule", "train.seed",
    Flag(None, "train.data", help="Training data: text, or a prepared dataset; every agent of a run needs the same."),
    "train.precision",
    Flag(None, "train.compile",
         help="torch.compile each transformer block (not bit for bit eager; every agent of a run must agree)."),
    "train.device", Flag("--threads", "train.num_threads"), Flag("--plan", "plan.strategy"),
    # the keys of [dht] live in p2ptrain.net: their flags say their help here
    Flag("--identity", "dht.identity_path", type=click.Path(dir_okay=False),
         help="Identity file: a stable peer ID (created if missing)."),
    Flag(None, "dht.host_maddrs", help="Listen on these multiaddrs, e.g. /ip4/0.0.0.0/tcp/31338.", convert=_maddrs),
    Flag(None, "dht.announce_maddrs", help="Public multiaddrs to advertise (behind NAT).", convert=_maddrs),
    Flag(None, "dht.relay.reachability",
         help="private: behind NAT with no open port (reachable through relays); public: reachable, relays for "
              "others."),
    Flag("--relay", "dht.relay.relays", help="Relay to be reached through when private (full multiaddr).",
         default_text="the initial peers", convert=_maddrs),
    Flag("--join-token", "dht.admission.token", help="This peer's join token for a closed run (from the organiser)."),
    "region", "events_file",
    *optimizer_flags("train."), *sync_flags("train."),
    Flag(None, "train.init_from", convert=lambda path: str(Path(path).resolve())),
])


@click.command(name="agent", epilog=RECIPES_HELP)
@OPTIONS.add
def command(config_path: str | None, **params: object) -> None:
    """Join a run through --initial-peers, profile, elect a leader, plan and train."""
    from p2ptrain.config import config_from_dict, read_toml

    data = merge(read_toml(config_path) if config_path else {}, OPTIONS.tree(params))
    config = config_from_dict(AgentConfig, data)  # a ConfigError is one line, exit 2
    if config.train.deterministic:  # cuBLAS reads this when CUDA starts
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

    from p2ptrain.lifecycle import StopSignal

    with StopSignal() as stop:  # before the heavy imports: a signal from now on stops cleanly
        from p2ptrain.agent.agent import Agent
        from p2ptrain.errors import AgentError, ProtocolError

        try:
            Agent(config, stop).run()
        except (AgentError, ProtocolError) as e:
            raise click.ClickException(str(e)) from None
