"""``p2ptrain train``: train locally and print the loss of every step.

    p2ptrain train                               # tiny preset, built-in corpus, a few seconds on a CPU
    p2ptrain train --model small --steps 200 --data notes/ --device cuda
    p2ptrain train --config train.toml --steps 50 --json > run.json
    p2ptrain train --data data/corpus --model small --steps 200 --eval-every 50 --save ckpt/

Flags override the ``--config`` file, which overrides the defaults (``p2ptrain.runtime.config``). With no
parallel flags this is single-process training, the reference of docs/design.md's exactness contract.
``--json`` prints one JSON document on stdout (per-step lines then go to stderr)::

    {"model": "tiny", "device": "cpu", "num_parameters": 436864,
     "losses": [5.598, ...], "step_time_s": [0.061, ...], "config": {...},
     "val_losses": [[50, 4.1], ...], "data_id": "bpe-8000:…", "tokens_per_s": 5120.3, "mfu": 0.021,
     "throughput": {"tokens_per_s": …, "model_tflops": …, "mfu": …, "peak_tflops": …, "peak_source": …}}

Throughput counts the trained tokens over the steps' wall time (evaluation excluded); MFU is against the
device's data-sheet peak at the run's precision, else its measured matmul throughput
(``p2ptrain.runtime.throughput``). ``--save DIR`` writes the trained model as a checkpoint
(``p2ptrain.runtime.checkpoint``) that ``p2ptrain export`` and ``p2ptrain generate`` read.
"""

from __future__ import annotations

import json
import os

import click

from p2ptrain.cli.config_options import Flag, OptionTable, merge
from p2ptrain.cli.optimizer_options import RECIPES_HELP, optimizer_flags, sync_flags
from p2ptrain.runtime.config import TrainConfig

OPTIONS = OptionTable(TrainConfig, [
    Flag("--config", param="config_path", type=click.Path(dir_okay=False), help="TOML file of TrainConfig keys."),
    "model", "subspace", "steps", Flag("--batch-size", "global_batch_size"), "micro_batches", "seq_len",
    *optimizer_flags(),
    "init_from", "seed", "data", "device", Flag("--threads", "num_threads"), "precision", "activation_checkpointing",
    "compile", "eval_every",
    Flag("--save", param="save_dir", type=click.Path(file_okay=False),
         help="Single-process: write the trained model as a checkpoint here (for export, generate)."),
    "wire", "schedule", "overlap",
    Flag(None, "stages", type=click.IntRange(min=1), help="Pipeline stages (distributed runtime)."),
    "replicas",
    *sync_flags(),
    Flag("--simulate-replicas", type=click.IntRange(min=1),
         help="Train in this one process as D replicas would (the reference of --replicas D; with --sync diloco, D "
              "models trained one after another)."),
    Flag("--plan", param="plan_path", type=click.Path(dir_okay=False),
         help="A plan JSON (p2ptrain plan --json): its stages, replicas and which device holds what."),
    Flag("--cluster", param="cluster_path", type=click.Path(dir_okay=False),
         help="With --plan: emulate this cluster file's links between the workers."),
    Flag("--scenario", help="With --plan: emulate this paper network's links (scaled to the plan's devices)."),
    Flag("--time-scale", type=click.FloatRange(min=0, min_open=True), default=1.0, show_default=True,
         help="Emulation: the network's seconds x this (alpha' = alpha x scale, beta' = beta x size factor / scale)."),
    Flag("--size-factor", type=click.FloatRange(min=0, min_open=True), default=1.0, show_default=True,
         help="Emulation: this run's bytes per message over the network's (see docs/design.md)."),
    Flag("--workdir", type=click.Path(file_okay=False), default_text="a temporary dir",
         help="With --stages/--replicas: keep worker specs, logs and progress files here."),
    Flag("--json", param="as_json", is_flag=True, help="Print one JSON document on stdout."),
])


@click.command(
    name="train",
    help="Train locally and print the loss of every step. With no parallel flags: one process, the "
    "reference every plan must reproduce. Flags override --config, which overrides the defaults.",
    epilog=RECIPES_HELP,
)
@OPTIONS.add
def command(config_path: str | None, plan_path: str | None, cluster_path: str | None, scenario: str | None,
            time_scale: float, size_factor: float, workdir: str | None, save_dir: str | None,
            simulate_replicas: int | None, as_json: bool, **params: object) -> None:
    from p2ptrain.config import config_from_dict, read_toml

    tree = read_toml(config_path) if config_path else {}
    flags = OPTIONS.tree(params)  # the keys the flags set
    stages, replicas = params["stages"], params["replicas"]
    links = None
    if plan_path is not None:
        from p2ptrain.runtime.plan_file import load_plan_file

        plan = load_plan_file(plan_path)
        for name, value in (("stages", stages), ("replicas", replicas)):
            if value is not None and value != getattr(plan, name):
                raise ValueError(f"--{name} {value} disagrees with the plan's {getattr(plan, name)} {name}")
        flags.update(stages=plan.stages, replicas=plan.replicas, layers=plan.layers)
        links = _emulated_links(plan, cluster_path, scenario, time_scale, size_factor)
    elif cluster_path is not None or scenario is not None:
        raise ValueError("--cluster and --scenario go with --plan (which device each worker plays)")
    if simulate_replicas is not None:
        if replicas is not None or stages is not None or plan_path is not None:
            raise ValueError("--simulate-replicas trains in one process: leave out --stages, --replicas and --plan")
        flags["replicas"] = simulate_replicas
    # one tree, validated once: the preset's recipe fills what the file and the flags leave out of [optimizer]
    cfg = config_from_dict(TrainConfig, merge(tree, flags))  # a ConfigError is one line, exit 2
    if cfg.stages_auto:
        raise ValueError('stages = "auto" is for agents (the run\'s leader chooses); p2ptrain train needs a number '
                         "of stages (--stages)")
    if cfg.deterministic:  # cuBLAS reads this when CUDA starts; without it matmuls may not repeat bit for bit
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

    from p2ptrain.runtime.reference import StepReport, train_reference

    def print_step(report: StepReport) -> None:
        val = "" if report.val_loss is None else f"  val_loss {report.val_loss:.4f}"
        click.echo(
            f"step {report.step + 1}/{cfg.steps}  loss {report.loss:.4f}{val}  time {report.step_time_s:.3f} s",
            err=as_json,
        )

    if save_dir is not None and cfg.is_distributed and simulate_replicas is None:
        raise ValueError("--save goes with single-process training (agents write checkpoints with [checkpoint])")
    if cfg.is_distributed and simulate_replicas is None:
        _train_distributed(cfg, workdir, as_json, print_step, links)
        return
    result = train_reference(cfg, on_step=print_step)
    if save_dir is not None:
        from p2ptrain.runtime.checkpoint import PARAM, save_stage

        tensors = {PARAM + name: tensor for name, tensor in result.state.items()}
        save_stage(save_dir, cfg.steps, 0, 1, cfg.model, cfg.seed, tensors, cfg.shape)
        click.echo(f"saved the model after step {cfg.steps} to {save_dir}", err=True)
    _report(cfg, result, as_json, {"device": result.device, "num_parameters": result.num_parameters},
            f"{cfg.model} ({result.num_parameters:,} parameters) on {result.device}")


def _report(cfg, result, as_json: bool, fields: dict, what: str, suffix: str = "", num_devices: int = 1) -> None:
    """One JSON document (losses, step times, config, throughput and ``fields``), or summary lines."""
    from p2ptrain.model.data import data_identity
    from p2ptrain.runtime.throughput import throughput

    tokens = cfg.global_batch_size * cfg.shape.seq_len * len(result.losses)
    speed = throughput(cfg.shape, tokens, sum(result.step_time_s), _peak(cfg), num_devices)
    val_losses = [list(v) for v in getattr(result, "val_losses", [])]
    if as_json:
        document = {"model": cfg.model, **fields, "losses": result.losses, "step_time_s": result.step_time_s,
                    "val_losses": val_losses, "data_id": data_identity(cfg.data),
                    "tokens_per_s": speed.to_json()["tokens_per_s"], "mfu": speed.to_json()["mfu"],
                    "throughput": speed.to_json(), "config": cfg.to_dict()}
        click.echo(json.dumps(document))
    else:
        val = f", validation loss {val_losses[-1][1]:.4f}" if val_losses else ""
        click.echo(f"trained {what}: loss {result.losses[0]:.4f} -> {result.losses[-1]:.4f}{val} in "
                   f"{sum(result.step_time_s):.1f} s{suffix}")
        click.echo(f"throughput: {speed.line()}")


def _peak(cfg) -> tuple[float | None, str]:
    """The device's peak for MFU: its data sheet's at the run's precision, else its measured (cached) matmul
    throughput (``p2ptrain.agent.profile``, measured once per device and thread count)."""
    import torch

    from p2ptrain.agent.profile import device_name, profile_device
    from p2ptrain.runtime.reference import resolve_device
    from p2ptrain.runtime.throughput import peak_tflops

    device = resolve_device(cfg.device)
    peak = peak_tflops(device_name(device), cfg.precision, None)
    if peak[0] is not None:
        return peak
    threads = torch.get_num_threads()
    try:
        if cfg.num_threads is not None:
            torch.set_num_threads(cfg.num_threads)
        return peak_tflops("", cfg.precision, profile_device(device).tflops)
    finally:
        torch.set_num_threads(threads)


def _emulated_links(plan, cluster_path, scenario, time_scale, size_factor):
    """The network the workers emulate, or None; one-line errors for inconsistent flags."""
    if cluster_path is not None and scenario is not None:
        raise ValueError("give --cluster or --scenario, not both")
    if cluster_path is None and scenario is None:
        return None
    from p2ptrain.net.transport.emulation import EmulationConfig
    from p2ptrain.planning import load_cluster
    from p2ptrain.planning import scenario as paper_scenario

    devices = plan.stages * plan.replicas
    cluster = load_cluster(cluster_path) if cluster_path else paper_scenario(scenario, devices)
    emulation = EmulationConfig(time_scale=time_scale, size_factor=size_factor)
    click.echo(f"emulating {cluster_path or scenario} ({devices} devices): time scale {time_scale:g}, "
               f"size factor {size_factor:g}", err=True)
    return plan.links(cluster.latency_ms.tolist(), cluster.bandwidth_gbps.tolist(), emulation, cluster.uplink_gbps,
                      cluster.downlink_gbps)


def _train_distributed(cfg, workdir: str | None, as_json: bool, print_step, links=None) -> None:
    """S × D worker processes on loopback (Megatron's rank order), the real runtime."""
    import dataclasses as dc

    from p2ptrain.runtime.worker_launcher import train_distributed

    if cfg.num_threads is None:  # S × D processes share this machine's cores
        cfg = dc.replace(cfg, num_threads=1)
    if cfg.eval_every:
        from p2ptrain.runtime.reference import build_validation

        build_validation(cfg)  # no validation split: one line before any worker starts
    try:
        result = train_distributed(cfg, workdir=workdir, on_step=print_step, links=links,
                                   save_states=bool(cfg.eval_every))
    except (RuntimeError, TimeoutError) as e:  # a worker failed or a deadline passed: one line, exit 1
        raise click.ClickException(str(e).splitlines()[0]) from None
    if cfg.eval_every:
        result.val_losses = [(cfg.steps, _evaluate_final(cfg, result.workdir, keep=workdir is not None))]
        click.echo(f"validation loss after step {cfg.steps}: {result.val_losses[0][1]:.4f}", err=as_json)
    fields = {"stages": cfg.stages, "replicas": cfg.replicas, "replicas_identical": result.replicas_identical,
              "peers": result.peers}
    _report(cfg, result, as_json, fields, f"{cfg.model} on {cfg.stages} stages × {cfg.replicas} replicas",
            "; replicas identical after every step")


def _evaluate_final(cfg, folder: str, keep: bool) -> float:
    """Distributed runs evaluate once, at the end: the stages' final states (replica 0's; replicas are
    identical) put together into the full model, on the validation split."""
    import shutil
    from pathlib import Path

    import torch

    from p2ptrain.model.gpt import GPT
    from p2ptrain.runtime.reference import build_validation, evaluate

    state = {}
    for stage in range(cfg.stages):
        state.update(torch.load(Path(folder) / f"worker-{stage}-0.state.pt"))
    model = GPT(cfg.shape, device="meta").materialize("cpu")
    model.load_state_dict(state)
    loss = evaluate(model.eval(), build_validation(cfg))
    if not keep:
        shutil.rmtree(folder, ignore_errors=True)
    return loss
