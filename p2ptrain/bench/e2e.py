"""End to end: the local swarm on one of the paper's emulated networks, trained with the scheduled plan,
Megatron's rank order and a seeded random assignment — same model, data, batch and steps — and for each
the measured step time beside the step time the planner predicted (the ``simulated`` objective).

    p2ptrain bench e2e --scenario worldwide                 # 8 agents, 4 stages × 2 replicas, 8 steps
    p2ptrain bench e2e --scenario spot --agents 4 --stages 2 --steps 3 --json
    python benchmarks/e2e.py                                # all five networks, one table and one chart
    p2ptrain bench e2e --scenario volunteers                # mixed GPUs: compute-aware plan, the paper's, Megatron's
    p2ptrain bench e2e --scenario worldwide --plans scheduled \
        --settings fp32/gpipe/no-overlap,bf16/1f1b/overlap,int8/1f1b/overlap   # the runtime's settings side by side

With ``--settings`` the scheduled plan is also trained once per further setting (wire format / schedule /
overlap, the first is the one the plans above use) and each is reported with its measured and predicted
step time and its loss after the last step; each setting's leader plans with that setting, so its plan may
differ (the table says when it does). Every setting's swarm has the same peers (identity files) as the
plan's; with ``--settings-plan megatron`` the settings train Megatron's placement, by peer-ID order, so every
setting's swarm trains the very same plan: what a setting costs on one plan, apart from what it changes in
the plan (a scheduled plan is made on each swarm's own measurements, whose noise alone moves it).

Mixed GPUs (``volunteers``): each agent also computes as many times slower as its card is than the
fastest (``runtime.compute_speed``), and the plans compared are the compute- and memory-aware plan
(``scheduled``: layer split and assignment together, ``planning.joint``), the paper's communication-only
plan with every stage the same number of layers (``communication_only``) and Megatron's order; each is
predicted at its own layer split on the scheduled swarm's measurements (links and every agent's speed).

How a run replays the paper's regime (docs/design.md "Link emulation"): agent k plays device k of the network
scaled to N devices (``scenarios.scenario``). The global batch is chosen so that this run's c_PP/c_DP is
the paper's (≈ 0.72), and the size factor is this run's c_PP over the paper's (GPT-3 XL) c_PP, so a
transfer takes as long relative to latency as the paper's did. The time scale makes the paper's seconds
emulated seconds: unless given, it is chosen so that Megatron's order takes ``TARGET_STEP_S`` emulated
seconds of communication (the simulated objective on the true network, without compute) times the
compute scale below, which keeps transfers dominant, as they were for GPT-3 XL on these links, and keeps
what a step spends on the CPU (compute, message hand-offs, the pause between steps: what a busy shared
machine slows down) a small part of it, while a step takes a few seconds.

Every plan is made by the swarm's leader on what the agents measured (links by the prober, compute and
per-message cost by calibration, the pause between steps by the leader's own polls), scored by the
simulated objective; its prediction is reported in emulated seconds (comparable with the measured ones)
and in the network's (the paper's) seconds. The measured step time is the period at which the swarm
trains, which is what the simulation predicts: from the times between one step's end and the next's (a
step ends when its last agent ends it; step 1 warms up), the median of each two consecutive ones' mean.
Pipeline stages often end their steps in turn, long and short alternating (measured: 2.2 s and 2.46 s for
a 2.35 s period); the median of single steps then reports whichever of the two is more frequent, while
the mean of two consecutive steps is the period and the median over them still sheds a lone slow step.
The paper's cost model (``dtfm``) of the same plan on the same measurements is reported beside it.

Each card of the emulated world computes on its own; the agents that play them share this machine's
cores. So the world runs in slow motion (``compute_scale``: every device that many times slower than this
machine's core, the time scale alike, ``runtime.compute_speed``) as far as the agents' compute needs to fit
the cores: four agents on two cores at twice the time. At scale 1 there they waited for each other's cores,
which their calibration, taken alone, does not see: the leader predicted int8 steps 15 % short, at 2 10 %,
at 3 7 % (benchmarks/README.md).

The leader predicts from calibrations taken before training; on a loaded CPU the agents then compute
slower than they calibrated, and the more of a step is compute (compressed wires) the more that input
error shows. So each plan is also priced again with the compute each trainer showed while training
(``repriced``: every device's speed scaled by its calibrated over its shown compute per step, the rest of
the leader's inputs unchanged): the objective's own error, apart from its input's (JSON ``repriced_step_s``,
``repriced_error``; the settings table's ``shown`` columns).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import numpy as np

from p2ptrain.bench.e2e_report import PLANS, format_reports, format_settings, write_results
from p2ptrain.lifecycle import logger_levels
from p2ptrain.planning import (
    MIXED_SCENARIOS,
    Cluster,
    Device,
    LayerCosts,
    LayeredWorkload,
    Parts,
    Workload,
    even_layers,
    make_objective,
    megatron_assignment,
)
from p2ptrain.planning.model_shapes import MODEL_PRESETS
from p2ptrain.planning.scenarios import NAMED_SCENARIOS
from p2ptrain.planning.simulated import StepProfile, StepWorkload, step_period
from p2ptrain.runtime.wire import WIRE_FORMATS

logger = logging.getLogger(__name__)

PAPER_PLANS = ("scheduled", "megatron", "random")  # the default on the paper's networks
MIXED_PLANS = ("scheduled", "communication_only", "megatron")  # the default on mixed GPUs
TARGET_STEP_S = 3.0  # emulated seconds of communication Megatron's order takes, when no time scale is given
# every message's deadline in the swarms (the swarm's default is 60 s): the leader starts training as soon as it
# publishes its plan, and on this machine beside other work each follower's check of it (the joint search again,
# 8 agents on 2 cores) took 68-74 s, so the first step's messages timed out and the epoch was aborted
CALL_TIMEOUT_S = 180.0
# the leader's search budget, which the followers also allow it (the swarm's default is 60 s): there every agent
# searches the first plan at once, and the leader's took 70 s of the 70 it was allowed, so it was passed over
PLAN_BUDGET_S = 180.0
# the leader's search, then each follower's own for its cost check (``plan_check``), each up to the budget
STARTUP_TIMEOUT_S = 2 * PLAN_BUDGET_S + 120.0
DEFAULT_OUT = "benchmarks/results"
DEFAULT_SETTING = "fp32/gpipe/overlap"
WIRES, SCHEDULES = WIRE_FORMATS, ("gpipe", "1f1b")
SETTING_FORM = "WIRE/SCHEDULE/overlap|no-overlap[/kK][/diloco-H|/streamed-H][/no-verify|/verify-RATE]"


def parse_setting(setting: str) -> tuple[str, str, bool]:
    """``WIRE/SCHEDULE/overlap|no-overlap[/kK][/diloco-H|/streamed-H][/no-verify|/verify-RATE]`` as (wire,
    schedule, overlap) (``subspace``: K, the model's residual stream in a subspace of that rank; ``sync_every``: H; ``streamed``: DiLoCo's rounds overlapped; ``verified``: the members' work checked,
    as by default, or not: what the checks cost; ``verify_rate``: at another ``[verify] rate``); ValueError (one
    line) otherwise."""
    parts = _without_verify(setting)
    last = setting.strip().split("/")[-1]
    if last.startswith("verify-") and _rate(last) is None:
        raise ValueError(f"--settings: {setting!r}: a verification rate is a number in (0, 1], e.g. verify-0.0625")
    if (len(parts) not in (3, 4) or parts[0] not in WIRES or parts[1] not in SCHEDULES
            or parts[2] not in ("overlap", "no-overlap") or len(parts) == 4 and _rounds(parts[3]) is None):
        raise ValueError(f"--settings: {setting!r} is not {SETTING_FORM} (wire one of {', '.join(WIRES)}, schedule "
                         f"one of {', '.join(SCHEDULES)}, H a positive integer)")
    return parts[0], parts[1], parts[2] == "overlap"


def subspace(setting: str) -> int:
    """A setting's subspace rank K (``/kK``, ``model.subspace``); 0 without one."""
    parse_setting(setting)
    parts = setting.strip().split("/")
    return int(parts[3][1:]) if len(parts) > 3 and _is_rank(parts[3]) else 0


def _is_rank(part: str) -> bool:
    return part.startswith("k") and part[1:].isdigit() and int(part[1:]) > 0


def sync_every(setting: str) -> int:
    """A setting's DiLoCo round length H (``/diloco-H``); 1 (every step) without one."""
    parse_setting(setting)
    parts = _without_verify(setting)
    return _rounds(parts[3]) if len(parts) == 4 else 1


def streamed(setting: str) -> bool:
    """Whether a setting's DiLoCo rounds overlap their all-reduce with the next round (``/streamed-H``)."""
    parse_setting(setting)
    return _without_verify(setting)[-1].startswith("streamed-")


def verified(setting: str) -> bool:
    """Whether a setting's agents check each other's work (``[verify] enabled``; ``/no-verify``: not)."""
    parse_setting(setting)
    return setting.strip().split("/")[-1] != "no-verify"


def verify_rate(setting: str) -> float | None:
    """A setting's ``[verify] rate`` (``/verify-RATE``); None: the default."""
    parse_setting(setting)
    return _rate(setting.strip().split("/")[-1])


def _rate(part: str) -> float | None:
    try:
        rate = float(part.removeprefix("verify-")) if part.startswith("verify-") else None
    except ValueError:
        return None
    return rate if rate is not None and 0 < rate <= 1 else None


def _without_verify(setting: str) -> list[str]:
    """The setting's parts without its verification part nor its subspace part."""
    parts = setting.strip().split("/")
    if len(parts) > 3 and _is_rank(parts[3]):
        parts = parts[:3] + parts[4:]
    return parts[:-1] if len(parts) > 3 and (parts[-1] == "no-verify" or parts[-1].startswith("verify-")) else parts


def _rounds(part: str) -> int | None:
    prefix = "diloco-" if part.startswith("diloco-") else "streamed-"
    h = part.removeprefix(prefix)
    return int(h) if part.startswith(prefix) and h.isdigit() and int(h) >= (2 if prefix == "streamed-" else 1) else None


@dataclass(frozen=True)
class E2EConfig:
    scenario: str
    agents: int = 8
    stages: int = 4
    steps: int = 8
    time_scale: float | None = None  # None: TARGET_STEP_S over Megatron's simulated communication
    micro_batches: int = 2
    model: str = "tiny"
    seed: int = 0  # the model's, the data's, the scheduler's and the random assignment's
    workdir: str | None = None  # a folder per plan inside; default: a temporary folder per swarm
    plans: tuple[str, ...] = ()  # which of them to run ("scheduled" always); () the scenario's default
    settings: tuple[str, ...] = (DEFAULT_SETTING,)  # SETTING_FORM; the plans use the first
    settings_plan: str = "scheduled"  # the plan the other settings train with (one of PLANS, run first)
    # the world in slow motion: devices this many times slower, the time scale alike; None: fitting_scale
    compute_scale: float | None = None

    def __post_init__(self) -> None:
        if not self.settings:
            raise ValueError(f"--settings: at least one {SETTING_FORM}")
        for setting in self.settings:
            h = sync_every(setting)
            if h > 1 and self.steps < 2 * h:
                raise ValueError(f"--settings {setting}: --steps must be at least {2 * h} (two rounds: the first "
                                 "is a warm-up, the second measured whole)")
        if self.scenario not in NAMED_SCENARIOS:
            raise ValueError(f"unknown scenario {self.scenario!r} (choose from {', '.join(NAMED_SCENARIOS)})")
        if not self.plans:
            object.__setattr__(self, "plans", MIXED_PLANS if self.scenario in MIXED_SCENARIOS else PAPER_PLANS)
        if self.steps < 2:
            raise ValueError("--steps must be at least 2 (the first step is a warm-up and not measured)")
        if self.settings_plan not in self.plans:
            raise ValueError(f"--settings-plan {self.settings_plan}: not among --plans {','.join(self.plans)}")
        if self.compute_scale is not None and not 1 <= self.compute_scale < float("inf"):
            raise ValueError(f"--compute-scale must be a number of at least 1, got {self.compute_scale}")
        unknown = set(self.plans) - set(PLANS)
        if unknown or "scheduled" not in self.plans:
            raise ValueError(f"--plans: {', '.join(PLANS)}, always with scheduled (got {', '.join(self.plans)})")


def emulation_factors(config: E2EConfig) -> dict[str, Any]:
    """The training config, network, size factor, time scale and compute scale of ``config`` (see the module
    docstring)."""
    from p2ptrain.agent.leadership.plan_maker import run_workload
    from p2ptrain.runtime.calibration import step_profile, step_workload
    from p2ptrain.runtime.compute_speed import fitting_scale
    from p2ptrain.swarm.agent_launcher import plan_swarm

    train, network, _, size_factor = plan_swarm(_swarm_config(config, "megatron", 1.0, 1.0))
    assert network is not None
    compute_scale = config.compute_scale or fitting_scale(network)
    replicas = config.agents // config.stages
    time_scale = config.time_scale
    megatron_s = None
    if time_scale is None:
        workload = run_workload(train, config.stages, replicas, size_factor)
        profile = step_profile([], train, config.stages, replicas, size_factor=size_factor)
        objective = make_objective("simulated", network, step_workload(workload, profile), config.stages)
        megatron_s = objective.evaluate(megatron_assignment(config.agents, config.stages)).cost_s
        time_scale = TARGET_STEP_S / megatron_s * compute_scale
    return {"train": train, "network": network, "size_factor": size_factor, "time_scale": time_scale,
            "compute_scale": compute_scale, "megatron_communication_s": megatron_s}


def _swarm_config(config: E2EConfig, strategy: str, time_scale: float, compute_scale: float,
                  workdir: str | None = None, setting: str | None = None):
    from p2ptrain.model.outer import DiLoCoConfig
    from p2ptrain.swarm.agent_launcher import SwarmConfig

    setting = setting or config.settings[0]
    wire, schedule, overlap = parse_setting(setting)
    h = sync_every(setting)
    return SwarmConfig(agents=config.agents, stages=config.stages, steps=config.steps, scenario=config.scenario,
                       time_scale=time_scale, strategy=strategy, objective="simulated", model=config.model,
                       micro_batches=config.micro_batches, seed=config.seed, workdir=workdir, wire=wire,
                       schedule=schedule, overlap=overlap, subspace=subspace(setting), compute_scale=compute_scale, call_timeout_s=CALL_TIMEOUT_S,
                       plan_budget_s=PLAN_BUDGET_S, startup_timeout_s=STARTUP_TIMEOUT_S, sync="diloco" if h > 1 else "every-step", verify=verified(setting),
                       verify_rate=verify_rate(setting),
                       diloco=DiLoCoConfig(inner_steps=h, overlap=streamed(setting)))


def run_e2e(config: E2EConfig, stop) -> dict[str, Any]:
    """Run the swarm once per plan on ``E2EConfig.scenario`` and return the report (``--json``'s document)."""
    from p2ptrain.swarm.agent_launcher import run_swarm

    factors = emulation_factors(config)
    train, time_scale, compute_scale = factors["train"], factors["time_scale"], factors["compute_scale"]
    logger.info("%s: %d agents, %s, batch %d in %d micro-batches; size factor %.4g, time scale %.4g, compute "
                "scale %g", config.scenario, config.agents, train.model, train.global_batch_size,
                train.micro_batches, factors["size_factor"], time_scale, compute_scale)
    plans: dict[str, Any] = {}
    models: dict[str, Any] = {}
    settings: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="p2ptrain-e2e-") as scratch:
        root = Path(config.workdir or scratch)  # a folder per swarm: the settings' reuse the plan's peers
        for strategy in [p for p in PLANS if p in config.plans]:
            result = run_swarm(_swarm_config(config, strategy, time_scale, compute_scale, str(root / strategy)), stop)
            if not result.ok:
                raise RuntimeError(f"{config.scenario}, {strategy}: the swarm failed: {result.error}")
            if strategy == "scheduled":
                models = leader_objectives(result.summary)
            plans[strategy] = plan_row(result.summary, step_completions(result.agents), time_scale,
                                       shown_compute(result.agents), sync_every(config.settings[0])) | {
                "breakdown": step_breakdown(result.agents)}
            logger.info("%s, %s: measured %.3f s, predicted %.3f s", config.scenario, strategy,
                        plans[strategy]["measured_step_s"], plans[strategy]["predicted_step_s"])
        settings[config.settings[0]] = plans[config.settings_plan]
        for setting in config.settings[1:]:
            # the same peers (identity files) as the plan's swarm: a plan by peer-ID order is the same plan
            workdir = root / setting.replace("/", "-")
            workdir.mkdir(parents=True, exist_ok=True)
            for k in range(config.agents):
                shutil.copy2(root / config.settings_plan / f"agent-{k}.id", workdir / f"agent-{k}.id")  # mode 600 too
            swarm = _swarm_config(config, config.settings_plan, time_scale, compute_scale, str(workdir), setting)
            result = run_swarm(swarm, stop)
            if not result.ok:
                raise RuntimeError(f"{config.scenario}, {setting}: the swarm failed: {result.error}")
            settings[setting] = plan_row(result.summary, step_completions(result.agents), time_scale,
                                         shown_compute(result.agents), sync_every(setting)) | {
                "breakdown": step_breakdown(result.agents)}
            logger.info("%s, %s: measured %.3f s, predicted %.3f s", config.scenario, setting,
                        settings[setting]["measured_step_s"], settings[setting]["predicted_step_s"])
    return {
        "scenario": config.scenario, "agents": config.agents, "stages": config.stages,
        "replicas": config.agents // config.stages, "steps": config.steps, "model": train.model,
        "global_batch_size": train.global_batch_size, "micro_batches": train.micro_batches,
        "size_factor": factors["size_factor"], "time_scale": time_scale, "compute_scale": compute_scale,
        "seed": config.seed,
        "plans": plans, "speedups": speedups(plans, models), "settings": settings, "settings_plan": config.settings_plan,
    }


def step_completions(agents) -> list[float]:
    """When each step ended: the time of the last agent's event for it (wall clock, steps 1, 2, …)."""
    ends: dict[int, float] = {}
    for agent in agents:
        for event in agent.events.all("step"):
            ends[event["step"]] = max(ends.get(event["step"], 0.0), event["time"])
    return [ends[k] for k in sorted(ends)]


BREAKDOWN = ("step_time_s", "compute_s", "compute_cpu_s", "recv_wait_s", "reduce_wait_s", "send_wait_s", "between_s")


def step_breakdown(agents) -> dict[int, dict[str, float]]:
    """Where each agent's steps went (its ``step`` events' ``BREAKDOWN`` fields, ``agent.events``; real
    seconds): the median of each over steps 2…K, by agent index, and the agent's stage."""
    out: dict[int, dict[str, float]] = {}
    for agent in agents:
        steps = [e for e in agent.events.all("step") if e["step"] >= 2]
        if steps:
            out[agent.index] = {"stage": steps[-1]["stage"]} | {
                k: statistics.median(e.get(k, 0.0) for e in steps) for k in BREAKDOWN}
    return out


def shown_compute(agents) -> dict[int, float]:
    """Each agent's compute per step as it showed it while training (the compute pacer's wall time of the
    step's forwards, backwards and update, ``ProgressRecord.compute_s``; real seconds): the median over
    steps 2…K, by agent index. Agents that trained no such step are left out."""
    seen: dict[int, list[float]] = {}
    for agent in agents:
        for event in agent.events.all("step"):
            if event["step"] >= 2 and event.get("compute_s"):
                seen.setdefault(agent.index, []).append(event["compute_s"])
    return {k: statistics.median(values) for k, values in sorted(seen.items())}


def repriced(summary: dict[str, Any], shown: dict[int, float], time_scale: float) -> dict[str, Any] | None:
    """The leader's prediction of its plan once more, with each trainer computing as it showed in training
    (``shown_compute``) instead of as it calibrated before: each device's speed scaled by its calibrated
    compute per step over the compute it showed. What the objective predicts from the right compute, which
    separates its own error from its input's (a loaded CPU computes slower than it calibrated; a GPU does
    not). None where the workload has no compute or a trainer showed none."""
    workload, plan = summary["workload"], summary["plan"]
    step = workload.get("step")
    stages = len(plan["pipelines"][0])
    if not step:
        return None
    profile = StepProfile(**{k: tuple(v) if isinstance(v, list) else v for k, v in step.items()})
    if "layer_costs" in workload:  # per layer: the plan's split
        raw = workload["layer_costs"]
        costs = LayerCosts(**{k: Parts(**v) if isinstance(v, dict) else v for k, v in raw.items()})
        split = tuple(tuple(r) for r in plan["layers"]) if plan.get("layers") else even_layers(costs.num_layers, stages)
        at = LayeredWorkload(workload["activation_gb"], workload["gradient_gb"], step=profile, costs=costs).at(split)
    else:
        at = StepWorkload(workload["activation_gb"], workload["gradient_gb"], step=profile)
    profile = at.step
    if not profile.forward_s:
        return None
    cluster = _measured_cluster(summary["measured"])
    reference = profile.reference_tflops or 1.0
    speeds = [d.tflops if profile.reference_tflops and d.tflops else reference for d in cluster.devices]
    per_step = [(profile.micro_batches * (f + b) + u) * time_scale for f, b, u in
                zip(profile.forward_s, profile.backward_s, profile.update_s or (0.0,) * stages, strict=True)]
    calibrated, scaled = {}, list(speeds)
    for row in plan["pipelines"]:
        for j, k in enumerate(row):
            if k not in shown:
                return None
            calibrated[k] = per_step[j] * reference / speeds[k]
            scaled[k] = speeds[k] * calibrated[k] / max(shown[k], 1e-12)
    devices = tuple(dataclasses.replace(d, tflops=v) for d, v in zip(cluster.devices, scaled, strict=True))
    objective = make_objective("simulated", dataclasses.replace(cluster, devices=devices),
                               dataclasses.replace(at, step=dataclasses.replace(profile, reference_tflops=reference)),
                               stages)
    return {"step_s": objective.evaluate(np.array(plan["pipelines"])).cost_s * time_scale,
            "compute_calibrated_s": {k: calibrated[k] for k in sorted(calibrated)},
            "compute_shown_s": {k: shown[k] for k in sorted(calibrated)}}


def plan_row(summary: dict[str, Any], completions: list[float], time_scale: float,
             shown: dict[int, float] | None = None, rounds: int = 1) -> dict[str, Any]:
    """One plan's measured and predicted step times, from its swarm's summary and step completion times;
    with ``shown`` (``shown_compute``) also the prediction repriced with the compute shown in training.
    DiLoCo (``rounds`` H > 1): one step in H ends a round with the pseudo-gradients' all-reduce, which the
    prediction spreads over the round; the measured step is then the mean over whole rounds after the first
    (from the first round's end to the last one's)."""
    times = [b - a for a, b in zip(completions, completions[1:], strict=False)]  # steps 2…K: end to end
    plan = summary["plan"]
    measured = step_period(times) if rounds == 1 else round_period(completions, rounds)
    predicted = plan["cost_s"] * time_scale
    dtfm = leader_objectives(summary)["dtfm"].evaluate(np.array(plan["pipelines"])).cost_s
    layers = plan.get("layers")
    again = repriced(summary, shown, time_scale) if shown else None
    return {
        "measured_step_s": measured, "predicted_step_s": predicted, "predicted_paper_s": plan["cost_s"],
        "error": predicted / measured - 1.0, "dtfm_step_s": dtfm * time_scale, "dtfm_paper_s": dtfm,
        "repriced_step_s": again["step_s"] if again else None,
        "repriced_error": again["step_s"] / measured - 1.0 if again else None,
        "compute_calibrated_s": again["compute_calibrated_s"] if again else None,
        "compute_shown_s": again["compute_shown_s"] if again else None,
        "objective": plan["objective"], "pipelines": plan["pipelines"], "layers": layers, "step_time_s": times,
        "agent_step_time_s": summary["step_time_s"], "step_profile": summary["workload"].get("step"),
        "loss_first": summary["losses"][0], "loss_last": summary["losses"][-1],
    }


def round_period(completions: list[float], rounds: int) -> float:
    """The mean step time over the whole DiLoCo rounds of ``rounds`` steps after the first (``completions[k]``:
    when step k + 1 ended)."""
    ends = [k * rounds - 1 for k in range(1, len(completions) // rounds + 1)]
    if len(ends) < 2:
        raise ValueError(f"{len(completions)} steps hold fewer than two rounds of {rounds}")
    return (completions[ends[-1]] - completions[ends[0]]) / (ends[-1] - ends[0])


def leader_objectives(summary: dict[str, Any]) -> dict[str, Any]:
    """Both objectives on what a swarm's leader planned with: its measured links, workload, step profile
    (and, for mixed devices, every agent's speed and the per-layer costs: "simulated" then scores a plan
    at its own layer split, ``evaluate(pipelines, layers)``)."""
    cluster = _measured_cluster(summary["measured"])
    workload = summary["workload"]
    stages = len(summary["plan"]["pipelines"][0])
    step = workload.get("step")
    profile = StepProfile(**{k: tuple(v) if isinstance(v, list) else v for k, v in step.items()}) if step else None
    dtfm = make_objective("dtfm", cluster, Workload(workload["activation_gb"], workload["gradient_gb"]), stages)
    if "layer_costs" in workload:
        raw = workload["layer_costs"]
        costs = LayerCosts(**{k: Parts(**v) if isinstance(v, dict) else v for k, v in raw.items()})
        layered = LayeredWorkload(workload["activation_gb"], workload["gradient_gb"], step=profile or StepProfile(),
                                  costs=costs)
        return {"dtfm": dtfm, "simulated": _AtLayers(cluster, layered, stages)}
    simulated = StepWorkload(workload["activation_gb"], workload["gradient_gb"], step=profile or StepProfile())
    return {"dtfm": dtfm, "simulated": make_objective("simulated", cluster, simulated, stages)}


class _AtLayers:
    """The simulated objective of a layered workload, for plans at any layer split (None: even)."""

    def __init__(self, cluster: Cluster, workload: LayeredWorkload, stages: int):
        self.cluster, self.workload, self.stages = cluster, workload, stages

    def evaluate(self, pipelines: np.ndarray, layers: list[list[int]] | None = None):
        assert self.workload.costs is not None
        split = tuple(tuple(r) for r in layers) if layers else even_layers(self.workload.costs.num_layers, self.stages)
        return make_objective("simulated", self.cluster, self.workload.at(split), self.stages).evaluate(pipelines)


def _measured_cluster(measured: dict[str, list[Any]]) -> Cluster:
    """The leader's measured links (by agent index, in the network's units) and, when it planned with them,
    every agent's speed, as a cluster."""
    latency = np.array([[v or 0.0 for v in row] for row in measured["latency_ms"]])
    bandwidth = np.array([[v or 1.0 for v in row] for row in measured["bandwidth_gbps"]])
    speeds = measured.get("tflops") or [None] * len(latency)
    devices = tuple(Device(name=f"agent-{k}", tflops=speeds[k]) for k in range(len(latency)))
    access = {k: measured[k] for k in ("uplink_gbps", "downlink_gbps") if measured.get(k) is not None}
    return Cluster(devices, latency, bandwidth, **access)


def speedups(plans: dict[str, Any], models: dict[str, Any]) -> dict[str, dict[str, float]]:
    """The scheduled plan's speedup over each baseline: measured (each plan in its own swarm); predicted
    and the paper's model (dtfm), each plan evaluated on the same measurements, the scheduled swarm's
    leader's; and the ratio of the predictions each swarm's leader made on its own measurements."""
    ours = plans["scheduled"]

    def ratio(name: str, base: str) -> float:
        objective = models[name]
        if isinstance(objective, _AtLayers):  # each plan at its own layer split
            return (objective.evaluate(np.array(plans[base]["pipelines"]), plans[base].get("layers")).cost_s
                    / objective.evaluate(np.array(ours["pipelines"]), ours.get("layers")).cost_s)
        return (objective.evaluate(np.array(plans[base]["pipelines"])).cost_s
                / objective.evaluate(np.array(ours["pipelines"])).cost_s)

    return {
        f"over_{base}": {
            "measured": plans[base]["measured_step_s"] / ours["measured_step_s"],
            "predicted": ratio("simulated", base),
            "dtfm": ratio("dtfm", base),
            "predicted_by_each_leader": plans[base]["predicted_step_s"] / ours["predicted_step_s"],
        }
        for base in PLANS[1:]
        if base in plans
    }


@click.command(name="e2e")
@click.option("--scenario", type=click.Choice(list(NAMED_SCENARIOS)), required=True,
              help="The network to emulate (volunteers: mixed GPUs, compute emulated too; homes: access links).")
@click.option("--agents", type=click.IntRange(min=2), default=8, show_default=True, help="Agent processes.")
@click.option("--stages", type=click.IntRange(min=1), default=4, show_default=True, help="Pipeline stages.")
@click.option("--steps", type=click.IntRange(min=2), default=8, show_default=True,
              help="Steps per plan (the first is not measured).")
@click.option("--time-scale", type=click.FloatRange(min=0, min_open=True),
              help=f"Emulated seconds per network second.  [default: Megatron's order takes {TARGET_STEP_S:g} s "
                   "of communication]")
@click.option("--micro-batches", type=click.IntRange(min=1), default=2, show_default=True)
@click.option("--model", type=click.Choice(list(MODEL_PRESETS)), default="tiny", show_default=True,
              help="The model preset every swarm trains (its recipe; the planner prices its layers).")
@click.option("--compute-scale", type=click.FloatRange(min=1),
              help="Play every device this many times slower than this machine's core, and (unless "
                   "--time-scale is given) the network alike: the same world in slow motion, in which more "
                   "agents than cores compute as on cards of their own.  [default: the agents' compute over "
                   "this machine's cores, at least 1]")
@click.option("--plans", default="",
              help=f"Which plans to run, comma-separated, of {', '.join(PLANS)} (scheduled always).  [default: "
                   f"{','.join(PAPER_PLANS)}; on mixed GPUs {','.join(MIXED_PLANS)}]")
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True,
              help="Seed of the model, the data, the scheduler and the random assignment.")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default=DEFAULT_OUT, show_default=True,
              help="Where e2e-NETWORK.json (a list of one report), .csv and .png go.")
@click.option("--workdir", type=click.Path(file_okay=False), help="Keep the swarms' logs here (one folder per plan).")
@click.option("--settings", default=DEFAULT_SETTING, show_default=True,
              help=f"{SETTING_FORM}, comma-separated (diloco-H: DiLoCo rounds of H steps): the plans train with the "
                   "first; the scheduled plan also with each other one, side by side.")
@click.option("--settings-plan", type=click.Choice(PLANS), default="scheduled", show_default=True,
              help="The plan the settings after the first train with, by the same peers as its own swarm "
                   "(megatron: the same placement in every setting's swarm; must be among --plans).")
@click.option("--json", "as_json", is_flag=True, help="Print the report as one JSON document on stdout.")
def command(scenario: str, agents: int, stages: int, steps: int, time_scale: float | None, micro_batches: int,
            model: str, compute_scale: float | None, plans: str, seed: int, out_dir: str, workdir: str | None,
            settings: str, settings_plan: str, as_json: bool) -> None:
    """One emulated network end to end: scheduled plan, Megatron's order, random; measured beside predicted."""
    from p2ptrain.lifecycle import StopSignal

    if agents % stages:
        raise ValueError(f"--agents {agents} is not a multiple of --stages {stages}")
    config = E2EConfig(scenario=scenario, agents=agents, stages=stages, steps=steps, time_scale=time_scale,
                       micro_batches=micro_batches, model=model, compute_scale=compute_scale, seed=seed, workdir=workdir,
                       plans=tuple(p.strip() for p in plans.split(",") if p.strip()),
                       settings=tuple(s.strip() for s in settings.split(",") if s.strip()),
                       settings_plan=settings_plan)
    _progress_logging()
    with StopSignal() as stop:
        report = run_e2e(config, stop)
    paths = write_results([report], Path(out_dir), f"e2e-{scenario}")
    if as_json:
        click.echo(json.dumps(report))
    else:
        click.echo(format_reports([report]))
        if len(report["settings"]) > 1:
            click.echo("\n" + format_settings(report))
        click.echo("wrote " + ", ".join(str(p) for p in paths))


def _progress_logging() -> None:
    """One line per swarm on stderr (the agents' own logs stay in their work dirs), for this command's run."""
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    click.get_current_context().with_resource(logger_levels({"p2ptrain": logging.WARNING, logger.name: logging.INFO}))
