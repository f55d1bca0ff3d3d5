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

from p2ptrain.agent.config import STRATEGIES
from p2ptrain.cli.bootstrap import _split
from p2ptrain.cli.optimizer_options import (
    INIT_FROM_HELP,
    RECIPES_HELP,
    diloco_flags,
    optimizer_flags,
    optimizer_options,
    sync_options,
)
from p2ptrain.cli.stage_count import StageCount
from p2ptrain.planning.model_shapes import MODEL_PRESETS
from p2ptrain.runtime.wire import WIRE_FORMATS


@click.command(name="agent", epilog=RECIPES_HELP)
@click.option("--config", "config_path", type=click.Path(dir_okay=False), help="TOML config (flags override it).")
@click.option("--initial-peers", multiple=True, help="The bootstrap's address line (full multiaddrs with /p2p/).")
@click.option("--run", "run_id", help="Run name shared by every agent of the run.  [default: demo]")
@click.option("--stages", type=StageCount(),
              help="Pipeline stages; auto: the leader of the run's first plan chooses (within [train] min_stages .. "
                   "max_stages), every later plan keeps it.  [default: 1]")
@click.option("--expect", type=click.IntRange(min=1), help="Plan once this many peers are live.")
@click.option("--join-deadline-s", type=click.FloatRange(min=0, min_open=True),
              help="... or this many seconds after start, with at least --min-peers live.")
@click.option("--min-peers", type=click.IntRange(min=1), help="Fewest peers to plan with at the join deadline.")
@click.option("--model", type=click.Choice(list(MODEL_PRESETS)), help="Model preset.  [default: tiny]")
@click.option("--steps", type=click.IntRange(min=1), help="Optimizer steps.  [default: 10]")
@click.option("--batch-size", type=click.IntRange(min=1), help="Global batch, in sequences.  [default: 16]")
@click.option("--micro-batches", type=click.IntRange(min=1), help="Micro-batches per replica.  [default: 2]")
@click.option("--wire", type=click.Choice(list(WIRE_FORMATS)),
              help="How tensors travel between agents (fp32 is exact; every agent of a run must agree).  [default: fp32]")
@click.option("--schedule", type=click.Choice(["gpipe", "1f1b"]), help="Pipeline schedule.  [default: gpipe]")
@click.option("--seed", type=click.IntRange(min=0), help="Seed of parameters and batches.  [default: 0]")
@click.option("--data", "data_path", help="Training data: text, or a prepared dataset; every agent of a run needs the same.")
@click.option("--precision", type=click.Choice(["fp32", "bf16", "fp16"]),
              help="Compute precision (autocast; fp32 is exact).  [default: fp32]")
@click.option("--compile/--no-compile", "compile_blocks", default=None,
              help="torch.compile each transformer block (not bit for bit eager; every agent of a run must "
                   "agree).  [default: off]")
@click.option("--device", type=click.Choice(["cpu", "cuda", "auto"]), help="Where to train.  [default: auto]")
@click.option("--threads", type=click.IntRange(min=1), help="CPU threads for torch.  [default: torch's]")
@click.option("--plan", "strategy", type=click.Choice(list(STRATEGIES)),
              help="The leader's strategy (baselines for comparison).  [default: scheduled]")
@click.option("--identity", type=click.Path(dir_okay=False), help="Identity file: a stable peer ID (created if missing).")
@click.option("--host-maddrs", multiple=True, help="Listen on these multiaddrs, e.g. /ip4/0.0.0.0/tcp/31338.")
@click.option("--announce-maddrs", multiple=True, help="Public multiaddrs to advertise (behind NAT).")
@click.option("--reachability", type=click.Choice(["auto", "public", "private"]),
              help="private: behind NAT with no open port (reachable through relays); public: reachable, relays "
                   "for others.  [default: auto]")
@click.option("--relay", "relays", multiple=True,
              help="Relay to be reached through when private (full multiaddr).  [default: the initial peers]")
@click.option("--join-token", help="This peer's join token for a closed run (from the organiser).")
@click.option("--region", help="Where this device is (free text shown in plans).")
@click.option("--events-file", type=click.Path(dir_okay=False), help="Append one JSON line per event here.")
@optimizer_options
@sync_options
@click.option("--init-from", type=click.Path(file_okay=False), help=INIT_FROM_HELP)
def command(config_path: str | None, initial_peers: tuple[str, ...], run_id: str | None, stages: int | str | None,
            expect: int | None, join_deadline_s: float | None, min_peers: int | None, model: str | None,
            steps: int | None, batch_size: int | None, micro_batches: int | None, wire: str | None,
            schedule: str | None, seed: int | None, data_path: str | None, precision: str | None,
            compile_blocks: bool | None, device: str | None, threads: int | None, strategy: str | None,
            identity: str | None,
            host_maddrs: tuple[str, ...], announce_maddrs: tuple[str, ...], reachability: str | None,
            relays: tuple[str, ...], join_token: str | None, region: str | None,
            events_file: str | None, init_from: str | None, sync: str | None, **optimizer: object) -> None:
    """Join a run through --initial-peers, profile, elect a leader, plan and train."""
    from p2ptrain.config import config_from_dict, read_toml

    data = read_toml(config_path) if config_path else {}
    flags = {
        ("run",): run_id, ("initial_peers",): list(_split(initial_peers)) or None, ("region",): region,
        ("events_file",): events_file, ("train", "stages"): stages, ("train", "model"): model,
        ("train", "steps"): steps, ("train", "global_batch_size"): batch_size,
        ("train", "micro_batches"): micro_batches, ("train", "wire"): wire, ("train", "schedule"): schedule,
        ("train", "seed"): seed, ("train", "device"): device, ("train", "data"): data_path,
        ("train", "precision"): precision, ("train", "compile"): compile_blocks,
        ("train", "num_threads"): threads, ("membership", "expect"): expect,
        ("membership", "join_deadline_s"): join_deadline_s, ("membership", "min_peers"): min_peers,
        ("plan", "strategy"): strategy, ("dht", "identity_path"): identity,
        ("dht", "host_maddrs"): list(_split(host_maddrs)) or None,
        ("dht", "announce_maddrs"): list(_split(announce_maddrs)) or None,
        ("dht", "relay", "reachability"): reachability, ("dht", "relay", "relays"): list(_split(relays)) or None,
        ("dht", "admission", "token"): join_token,
        ("train", "init_from"): str(Path(init_from).resolve()) if init_from else None,
        ("train", "sync"): sync,
        **{("train", "optimizer", name): value for name, value in optimizer_flags(optimizer).items()},
        **{("train", "diloco", name): value for name, value in diloco_flags(optimizer).items()},
    }
    for path, value in flags.items():
        if value is not None:
            table = data
            for name in path[:-1]:
                table = table.setdefault(name, {})
            table[path[-1]] = value
    from p2ptrain.agent.config import AgentConfig

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
