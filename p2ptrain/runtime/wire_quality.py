"""What a lossy wire costs in quality, and what the runtime's settings buy in step time, side by side.

    from p2ptrain.runtime.config import TrainConfig
    from p2ptrain.runtime.wire_quality import compare_wires
    report = compare_wires(TrainConfig(steps=200, stages=2, replicas=2, global_batch_size=16, num_threads=1))
    for row in report["wires"]:
        print(row["wire"], row["final_loss"], row["final_loss_vs_fp32"])

Every run is the real runtime (``worker_launcher.train_distributed``: S × D worker processes on loopback) on the
same seed, data and plan, so the losses differ only by what the wire dropped. Besides the losses, each row
gives the bytes one step puts on the wire per kind (``step_wire_bytes``). ``delta_coding_error`` measures
the premise of AQ-SGD's activation delta coding on this data (see ``wire``'s docstring).

``compare_step_times`` trains the same run with several (wire, schedule, overlap) settings on an emulated
network (``worker.LinkMatrices``), in interleaved rounds, and reports each setting's median step time.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from p2ptrain.model.data import inputs_and_targets, micro_batches, shard_of
from p2ptrain.model.loss import micro_batch_loss
from p2ptrain.model.stage import build_stage
from p2ptrain.planning import parameter_count
from p2ptrain.runtime.config import TrainConfig
from p2ptrain.runtime.reference import build_data
from p2ptrain.runtime.wire import Codec, message_bytes, wire_bytes, wire_format

if TYPE_CHECKING:
    from p2ptrain.runtime.worker import LinkMatrices


def step_wire_bytes(cfg: TrainConfig) -> dict[str, int]:
    """Bytes one step sends, over the whole run, per tensor kind (headers aside): activations and their
    gradients over every pipeline boundary of every pipeline, and the sharded all-reduce of every stage's
    group (each member sends (n−1)/n of its gradients in the reduce-scatter and as much in the all-gather);
    with DiLoCo (``sync = "diloco"``) the all-reduce of a round's pseudo-gradients spread over its H steps."""
    fmt = wire_format(cfg.wire)
    shape = cfg.shape
    act_shape = (cfg.micro_batch_size, shape.seq_len, shape.boundary_width)
    boundaries = (cfg.stages - 1) * cfg.replicas * cfg.micro_batches
    n = cfg.replicas
    per_stage = parameter_count(shape) / cfg.stages
    shard = per_stage / n if n > 1 else 0
    all_reduce = 2 * n * (n - 1) * wire_bytes(fmt.gradient.name, round(shard)) * cfg.stages
    if cfg.sync == "diloco":
        all_reduce /= cfg.diloco.inner_steps
    return {
        "activation": boundaries * message_bytes(fmt.activation.name, act_shape),
        "activation_grad": boundaries * message_bytes(fmt.activation_grad.name, act_shape),
        "all_reduce": int(all_reduce),
    }


def compare_wires(cfg: TrainConfig, wires: Sequence[str] = ("fp32", "bf16", "int8", "int4"),
                  last_k: int = 10, workdir: str | None = None) -> dict:
    """Train ``cfg`` once per wire (distributed: ``cfg.stages`` × ``cfg.replicas`` workers); the final loss,
    the mean of the last ``last_k`` losses, each relative to fp32's, and the wire bytes per step."""
    from p2ptrain.runtime.worker_launcher import train_distributed

    if not cfg.is_distributed:
        raise ValueError("compare_wires needs a distributed plan (stages × replicas > 1)")
    rows = []
    for wire in wires:
        run = dataclasses.replace(cfg, wire=wire)
        result = train_distributed(run, workdir=f"{workdir}/{wire}" if workdir else None)
        rows.append({"wire": wire, "losses": result.losses, "final_loss": result.losses[-1],
                     "last_mean_loss": statistics.fmean(result.losses[-last_k:]),
                     "step_time_s": statistics.median(result.step_time_s),
                     "replicas_identical": result.replicas_identical, "step_wire_bytes": step_wire_bytes(run)})
    base = next((r for r in rows if r["wire"] == "fp32"), None)
    for row in rows:
        if base is not None:
            row["final_loss_vs_fp32"] = row["final_loss"] / base["final_loss"] - 1
            row["last_mean_loss_vs_fp32"] = row["last_mean_loss"] / base["last_mean_loss"] - 1
    config = {k: v for k, v in cfg.to_dict().items() if k != "wire"}
    return {"config": config, "last_k": last_k, "wires": rows}


def delta_coding_error(cfg: TrainConfig, codec_name: str = "int8", steps: int = 20) -> dict[str, float]:
    """Relative error (‖x̂ − x‖ / ‖x‖, mean over steps) of stage 0's output activation sent as it is, and sent
    as AQ-SGD does: the change against the value last sent for the same micro-batch slot (both ends keep the
    reconstruction). Parameters stay fixed, the case most favourable to delta coding."""
    torch.manual_seed(cfg.seed)
    module = build_stage(cfg.shape, 0, max(2, cfg.stages), cfg.seed)
    data = build_data(cfg)
    codec = Codec(codec_name)
    reference = None
    direct, delta = [], []
    with torch.no_grad():
        for step in range(steps):
            tokens = micro_batches(shard_of(data.global_batch(step), 0, cfg.replicas), cfg.micro_batches)[0]
            x = module(inputs_and_targets(tokens)[0])
            direct.append(float((codec.round_trip(x) - x).norm() / x.norm()))
            if reference is not None:
                sent = reference + codec.round_trip(x - reference)
                delta.append(float((sent - x).norm() / x.norm()))
                reference = sent
            else:
                reference = codec.round_trip(x)
    return {"direct": statistics.fmean(direct), "delta": statistics.fmean(delta)}


def codec_errors(cfg: TrainConfig, codecs: Sequence[str], steps: int = 10) -> dict[str, dict[str, float]]:
    """Relative error (‖x̂ − x‖ / ‖x‖, mean over steps) of each codec on what crosses the middle of ``cfg``'s
    model split in two stages, at its initial parameters: the activation and its gradient."""
    torch.manual_seed(cfg.seed)
    first, second = build_stage(cfg.shape, 0, 2, cfg.seed), build_stage(cfg.shape, 1, 2, cfg.seed)
    data = build_data(cfg)
    errors: dict[str, dict[str, list[float]]] = {name: {"activation": [], "activation_grad": []}
                                                 for name in codecs}
    for step in range(steps):
        tokens = micro_batches(shard_of(data.global_batch(step), 0, cfg.replicas), cfg.micro_batches)[0]
        inputs, targets = inputs_and_targets(tokens)
        with torch.no_grad():
            x = first(inputs)
        x.requires_grad_(True)
        micro_batch_loss(second(x), targets, targets.numel()).backward()
        for name in codecs:
            for kind, t in (("activation", x.detach()), ("activation_grad", x.grad)):
                errors[name][kind].append(float((Codec(name).round_trip(t) - t).norm() / t.norm()))
    return {name: {kind: statistics.fmean(v) for kind, v in kinds.items()} for name, kinds in errors.items()}


def compare_step_times(cfg: TrainConfig, settings: Sequence[tuple[str, str, bool]], links: LinkMatrices | None,
                       rounds: int = 2, skip_steps: int = 2) -> list[dict]:
    """Median step time of ``cfg`` under each (wire, schedule, overlap) setting; the settings run one after
    another, ``rounds`` times over (so a machine's slow minute touches each alike); the first ``skip_steps``
    steps of each run (connections warming up) are left out. Rows in the order of ``settings``."""
    from p2ptrain.runtime.worker_launcher import train_distributed

    times: dict[tuple[str, str, bool], list[float]] = {s: [] for s in settings}
    losses: dict[tuple[str, str, bool], float] = {}
    for _ in range(rounds):
        for wire, schedule, overlap in settings:
            run = dataclasses.replace(cfg, wire=wire, schedule=schedule, overlap=overlap)
            result = train_distributed(run, links=links)
            times[(wire, schedule, overlap)] += result.step_time_s[skip_steps:]
            losses[(wire, schedule, overlap)] = result.losses[-1]
    base = statistics.median(times[settings[0]])
    return [{"wire": w, "schedule": sch, "overlap": o, "step_time_s": statistics.median(times[(w, sch, o)]),
             "speedup_vs_first": base / statistics.median(times[(w, sch, o)]), "final_loss": losses[(w, sch, o)]}
            for w, sch, o in settings]
