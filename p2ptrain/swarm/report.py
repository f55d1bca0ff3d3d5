"""What the local swarm shows: its state from the agents' events, a live progress line, a final summary.

The summary (``summarize``) is what ``p2ptrain swarm --json`` prints: ``losses`` and ``step_time_s`` per
step as ``p2ptrain train --json`` has them, ``plan`` (the plan document of docs/design.md with devices named by
agent index), the predicted cost, the measured median step time, the emulation factors, the peer ID of
each agent and, from the leader's cluster, the link matrices in the network's units (``estimated_links``: the
pairs of agents whose links the leader estimated rather than measured, ``planning.estimated``).
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from p2ptrain.planning import Cluster
from p2ptrain.runtime.config import TrainConfig

if TYPE_CHECKING:
    from p2ptrain.swarm.config import AgentProcess, SwarmConfig


@dataclass
class SwarmState:
    config: SwarmConfig
    train: TrainConfig
    run: str
    workdir: str
    network: Cluster | None
    time_scale: float
    size_factor: float
    agents: list[AgentProcess]
    started: float = field(default_factory=time.monotonic)
    killed: dict[int, dict[str, Any]] = field(default_factory=dict)  # agent index -> {step, time, as}; partitions too
    joins: list[dict[str, Any]] = field(default_factory=list)
    failed_start: dict[int, str] = field(default_factory=dict)  # agent index -> why it exited before it joined

    def is_killed(self, index: int) -> bool:
        """Killed for good (a partitioned agent comes back and must finish like the others)."""
        return index in self.killed and self.killed[index]["as"] != "partitioned"

    def is_out(self, index: int) -> bool:
        """Not part of the run's end: killed for good, or failed to start."""
        return self.is_killed(index) or index in self.failed_start

    def index_of(self, peer_id: str) -> int | None:
        return next((a.index for a in self.agents if a.peer_id == peer_id), None)

    def roles(self) -> dict[int, dict[str, Any]]:
        return {a.index: r for a in self.agents if (r := a.events.last("role")) is not None}

    def all_have_roles(self) -> bool:
        return all(a.index in self.roles() for a in self.agents if a.index not in self.failed_start)

    def plans(self) -> list[tuple[int, dict[str, Any]]]:
        """Every plan event (agent index, event), by epoch: leaders change when one fails."""
        found = [(a.index, e) for a in self.agents for e in a.events.all("plan")]
        return sorted(found, key=lambda item: item[1]["epoch"])

    def leader_plan(self) -> tuple[int, dict[str, Any]] | None:
        """The run's first plan (the one training started with)."""
        plans = self.plans()
        return plans[0] if plans else None

    def current_leader(self) -> int | None:
        plans = self.plans()
        return plans[-1][0] if plans else None

    def start_step(self) -> int:
        first = self.leader_plan()
        return first[1].get("start_step", 0) if first else 0

    def steps_done(self) -> int:
        return max((e["step"] for a in self.agents for e in a.events.all("step")), default=0)

    def _final_steps(self) -> dict[int, list[dict[str, Any]]]:
        """Per step, its step events from the last epoch that completed it (a re-plan may redo steps)."""
        by_step: dict[int, list[dict[str, Any]]] = {}
        for agent in self.agents:
            for e in agent.events.all("step"):
                kept = by_step.get(e["step"])
                if kept is None or e["epoch"] > kept[0]["epoch"]:
                    by_step[e["step"]] = [e]
                elif e["epoch"] == kept[0]["epoch"]:
                    kept.append(e)
        return dict(sorted(by_step.items()))

    def last_loss(self) -> tuple[int, float, float] | None:
        """The newest step whose loss is known (its last stage reported it): (step, loss, step time so far).

        The progress line shows these together: the step counter of ``steps_done`` runs ahead of the loss,
        since the first stage reports step N before the last stage has finished it."""
        for step, events in reversed(self._final_steps().items()):
            loss = _run_loss(events)
            if loss is not None:
                return step, loss, max(e["step_time_s"] for e in events)
        return None

    def losses(self) -> list[float]:
        """Per step from the run's start step on, the run's loss (reported by the last stages, ``_run_loss``)."""
        out = []
        for events in self._final_steps().values():
            loss = _run_loss(events)
            if loss is not None:
                out.append(loss)
        return out

    def step_times(self) -> list[float]:
        """Per step, the slowest trainer's step time (a step ends when its last stage does)."""
        return [max(e["step_time_s"] for e in events) for events in self._final_steps().values()]

    def replans(self) -> list[dict[str, Any]]:
        """Every re-planned epoch: why, and (after a kill) the seconds from the kill to its first step."""
        out = []
        for _, event in self.plans():
            if not event.get("replan"):
                continue
            steps = [e["time"] for a in self.agents for e in a.events.all("step") if e["epoch"] == event["epoch"]]
            kills = [k["time"] for k in self.killed.values() if k["time"] <= event["time"]]
            failure = kills[-1] if event["replan"] == "failure" and kills else None
            before = [e["step"] for a in self.agents for e in a.events.all("step") if e["time"] <= event["time"]]
            start = event.get("start_step", 0)
            out.append({
                "epoch": event["epoch"], "kind": event["replan"], "reason": event["trigger"],
                "start_step": start,
                "from_checkpoint": "checkpoint" in event.get("sources", []),
                "recovery_s": (min(steps) - failure) if failure is not None and steps else None,
                "steps_redone": max(0, max(before, default=0) - start),
                "warm_copies": event["plan"].get("warm_copies"),
            })
        return out


def _run_loss(events: list[dict[str, Any]]) -> float | None:
    """A step's loss from its last stages' step events: every-step sync gives each pipeline the global loss
    (the same number); with DiLoCo each pipeline reports the loss on its own shard, and the run's is their
    mean (``model.outer``)."""
    losses = [e["loss"] for e in sorted(events, key=lambda e: e.get("replica") or 0) if e["loss"] is not None]
    if not losses:
        return None
    return losses[0] if all(x == losses[0] for x in losses) else sum(losses) / len(losses)


def summarize(state: SwarmState) -> dict[str, Any]:
    config = state.config
    losses, step_times = state.losses(), state.step_times()
    done = [a.events.last("done") for a in state.agents if not state.is_out(a.index)]
    summary: dict[str, Any] = {
        "run": state.run, "workdir": state.workdir, "agents": len(state.agents), "stages": config.stages,
        "replicas": state.train.replicas, "steps": config.steps, "model": state.train.model,
        "network": config.scenario or config.cluster_file, "strategy": config.strategy,
        "emulation": ({"time_scale": state.time_scale, "size_factor": state.size_factor,
                       "compute_scale": config.compute_scale} if state.network is not None else None),
        "peers": {str(a.index): a.peer_id for a in state.agents},
        "finished": all(d is not None for d in done) and len(losses) == config.steps - state.start_step(),
        "start_step": state.start_step(), "replans": state.replans(),
        "killed": {str(k): v for k, v in state.killed.items()}, "joins": state.joins,
        "failed_to_start": {str(k): v for k, v in state.failed_start.items()},
        "losses": losses, "step_time_s": step_times,
        "median_step_time_s": statistics.median(step_times) if step_times else None,
        "config": state.train.to_dict(),
    }
    leader = state.leader_plan()
    if leader is not None and state.train.stages_auto:  # the stage count the leader chose for the run
        summary["stages"], summary["replicas"] = leader[1]["plan"]["stages"], leader[1]["plan"]["replicas"]
    summary.update(_throughput(state, step_times, summary["stages"], summary["replicas"]))
    summary["val_losses"] = _validation(state)
    summary["dht_traffic"] = _dht_traffic(state)
    if leader is not None:
        index, event = leader
        summary.update(_plan_by_agent(state, index, event))
    return summary


def _dht_traffic(state: SwarmState) -> dict[str, dict[str, float]]:
    """Each agent's DHT calls over its run (its last ``dht_traffic`` event): stores and reads a minute, the bytes
    of both a minute, and the calls that failed; and its control traffic on the transport: pings and probe
    round trips a minute, and their bytes."""
    out = {}
    for agent in state.agents:
        event = agent.events.last("dht_traffic")
        if event is None or event["uptime_s"] <= 0:
            continue
        minutes = event["uptime_s"] / 60.0
        rows = event["kinds"].values()
        out[str(agent.index)] = {
            "stores_per_min": round(sum(r["stores"] for r in rows) / minutes, 1),
            "reads_per_min": round(sum(r["reads"] for r in rows) / minutes, 1),
            "bytes_per_min": round(sum(r["store_bytes"] + r["read_bytes"] for r in rows) / minutes),
            "failures": sum(r["store_failures"] + r["read_failures"] for r in rows),
        }
        control = event.get("control") or {}  # the transport's control traffic: heartbeat pings, link probes
        for kind in ("ping", "probe"):
            row = control.get(kind, {})
            out[str(agent.index)][f"{kind}s_per_min"] = round(row.get("calls", 0) / minutes, 1)
            out[str(agent.index)][f"{kind}_bytes_per_min"] = round(row.get("bytes", 0) / minutes)
    return out


def _throughput(state: SwarmState, step_times: list[float], stages: int | str, replicas: int) -> dict[str, Any]:
    """Tokens/s and MFU of the trained steps (``runtime.throughput``): every trainer's device (``stages`` ×
    ``replicas``; every agent while "auto" is not chosen yet) at the peak its profile says (data sheet for a
    known GPU, else its measured matmul throughput)."""
    from p2ptrain.runtime.throughput import peak_tflops, throughput

    if not step_times:
        return {"tokens_per_s": None, "mfu": None, "throughput": None}
    train = state.train
    profile = next((e for a in state.agents if (e := a.events.last("profile")) is not None), None)
    peak = peak_tflops(profile["device_name"], train.precision, profile["tflops"]) if profile else (None, "unknown")
    tokens = train.global_batch_size * train.shape.seq_len * len(step_times)
    devices = stages * replicas if isinstance(stages, int) else len(state.agents)
    speed = throughput(train.shape, tokens, sum(step_times), peak, num_devices=devices)
    return {"tokens_per_s": speed.to_json()["tokens_per_s"], "mfu": speed.to_json()["mfu"],
            "throughput": speed.to_json()}


def _validation(state: SwarmState) -> list[list[float]]:
    """With ``eval_every`` K on a prepared dataset: the validation loss (``reference.evaluate``) of every
    complete checkpoint in ``<workdir>/checkpoints`` after a multiple of K steps or the last, gathered from
    its stages (``p2ptrain.export``): the agents themselves do not evaluate."""
    from p2ptrain.model.prepared import is_prepared

    train, root = state.train, Path(state.workdir) / "checkpoints"
    if not train.eval_every or not is_prepared(train.data) or not root.is_dir():
        return []
    from p2ptrain.export import build_model, gather_checkpoint
    from p2ptrain.runtime.reference import build_validation, evaluate

    batches, out = build_validation(train), []
    for folder in sorted(root.glob("step-*")):
        step = int(folder.name.removeprefix("step-"))
        if step % train.eval_every and step != train.steps:
            continue
        try:
            out.append([step, evaluate(build_model(gather_checkpoint(folder)), batches)])
        except ValueError:  # not complete (a stage still writing, or killed)
            continue
    return out


def _plan_by_agent(state: SwarmState, leader: int, event: dict[str, Any]) -> dict[str, Any]:
    to_agent = [state.index_of(p) for p in event["devices"]]
    plan = dict(event["plan"])
    plan["pipelines"] = [[to_agent[d] for d in row] for row in plan["pipelines"]]
    n = len(state.agents)
    cluster = event["cluster"]
    measured: dict[str, list[list[float | None]]] = {}
    for key in ("latency_ms", "bandwidth_gbps"):
        matrix: list[list[float | None]] = [[None] * n for _ in range(n)]
        for i, a in enumerate(to_agent):
            for j, b in enumerate(to_agent):
                if a is not None and b is not None:
                    matrix[a][b] = cluster[key][i][j]
        measured[key] = matrix
    # the pairs the leader estimated rather than measured (``planning.estimated``), by agent index
    estimated = [sorted((to_agent[i], to_agent[j])) for i, j in event.get("estimated", ())
                 if to_agent[i] is not None and to_agent[j] is not None]
    speeds: list[float | None] = [None] * n  # each agent's speed as the leader planned with it (mixed devices)
    for i, a in enumerate(to_agent):
        if a is not None and i < len(cluster["devices"]):
            speeds[a] = cluster["devices"][i].get("tflops")
    measured["tflops"] = speeds
    for key in ("uplink_gbps", "downlink_gbps"):  # the homes' access links the leader planned with, if any
        if cluster.get(key) is not None:
            values: list[float | None] = [None] * n
            for i, a in enumerate(to_agent):
                if a is not None:
                    values[a] = cluster[key][i]
            measured[key] = values
    return {
        "leader": leader, "epoch": event["epoch"], "plan": plan, "predicted_cost_s": plan["cost_s"],
        "planning_s": (plan.get("search") or {}).get("seconds"),
        "predicted_emulated_s": plan["cost_s"] * state.time_scale if state.network is not None else None,
        "settings": event.get("settings"), "workload": event["workload"], "measured": measured,
        "spares": [state.index_of(p) for p in event["spares"]],
        "estimated_links": estimated,
        "links_by_agent": _links_by_agent([a for a in to_agent if a is not None], estimated),
    }


def _links_by_agent(agents: list[int], estimated: list[list[int]]) -> dict[str, list[int]]:
    """Per planned agent, its links to the plan's other agents the leader planned with as measured (by either
    end) and as estimated (``planning.estimated``): [measured, estimated]."""
    guessed = {a: 0 for a in agents}
    for pair in estimated:
        for a in pair:
            guessed[a] = guessed.get(a, 0) + 1
    return {str(a): [len(agents) - 1 - guessed[a], guessed[a]] for a in sorted(agents)}


class SwarmDisplay:
    """One progress line on a terminal (redrawn), or a line per change elsewhere (logs, CI)."""

    def __init__(self, stream: TextIO = sys.stderr):
        self.stream = stream
        self.tty = stream.isatty()
        self._last = ""

    def update(self, state: SwarmState) -> None:
        line = self.line(state)
        if line == self._last:
            return
        if not self._last:
            self.stream.write(f"swarm {state.run}: {len(state.agents)} agents; logs and status in {state.workdir}\n")
        self._last = line
        elapsed = f"[{time.monotonic() - state.started:5.1f} s] "
        if self.tty:
            self.stream.write("\r\x1b[2K" + elapsed + line)
        else:
            self.stream.write(elapsed + line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty and self._last:
            self.stream.write("\n")
            self.stream.flush()

    @staticmethod
    def line(state: SwarmState) -> str:
        n = len(state.agents)
        up = sum(1 for a in state.agents if a.events.last("started"))
        linked = sum(1 for a in state.agents if a.events.last("links"))
        parts = [f"agents up {up}/{n}", f"links {linked}/{n}"]
        leader = state.leader_plan()
        if leader is not None:
            parts.append(f"plan epoch {leader[1]['epoch']} by agent {leader[0]} "
                         f"(predicted {leader[1]['plan']['cost_s']:.3f} s/step)")
        last = state.last_loss()
        if last is not None:  # a step with its own loss and time, not the newest step beside an older loss
            step, loss, took = last
            parts.append(f"step {step}/{state.config.steps} loss {loss:.4f} ({took:.2f} s)")
        elif steps := state.steps_done():  # no stage has finished a step with a loss yet
            parts.append(f"step {steps}/{state.config.steps}")
        done = sum(1 for a in state.agents if a.events.last("done"))
        if done:
            parts.append(f"done {done}/{n}")
        return " · ".join(parts)


def format_summary(summary: dict[str, Any], regions: list[str | None] | None = None) -> str:
    """The human-readable final summary (``regions[k]``: agent k's region, when emulating)."""
    lines = []
    emulation = summary.get("emulation")
    where = f"on {summary['network']}" if summary["network"] else "on loopback"
    if emulation:
        where += f" (time scale {emulation['time_scale']:g}, size factor {emulation['size_factor']:.4g}"
        if emulation.get("compute_scale", 1.0) != 1.0:
            where += f", compute scale {emulation['compute_scale']:g}"
        where += ")"
    lines.append(f"swarm {summary['run']}: {summary['agents']} agents {where}; {summary['model']}, batch "
                 f"{summary['config']['global_batch_size']}, {summary['stages']} stages × {summary['replicas']} replicas")
    for index, why in summary.get("failed_to_start", {}).items():
        lines.append(f"agent {index} failed to start ({why}); the run went on without it")
    plan = summary.get("plan")
    if plan is not None:
        emulated = summary.get("predicted_emulated_s")
        lines.append(f"plan epoch {summary['epoch']} by agent {summary['leader']} (lowest peer ID), "
                     f"{summary['strategy']}: predicted {plan['cost_s']:.3f} s/step"
                     + (f" in the network's seconds ({emulated:.3f} s emulated)" if emulated is not None else ""))
        baselines = plan.get("baselines", {})
        if baselines:
            lines.append("  baselines: " + ", ".join(f"{k} {v['cost_s']:.3f} s" for k, v in baselines.items()))
        search = plan.get("search") or {}
        devices = sum(len(row) for row in plan["pipelines"])
        if summary.get("estimated_links"):
            lines.append(f"  links: {devices * (devices - 1) // 2 - len(summary['estimated_links'])} measured, "
                         f"{len(summary['estimated_links'])} estimated from them; by agent, measured/estimated: "
                         + ", ".join(f"{a} {m}/{e}" for a, (m, e) in summary.get("links_by_agent", {}).items()))
        if search.get("seconds") is not None:  # a fixed order (megatron, random) has no search time
            lines.append(f"  planned in {search['seconds']:.2f} s ({search.get('method', '?')} search"
                         + (f"; {search['fallback']}'s order: the search did not beat it" if search.get("fallback") else "")
                         + ")")
        for i, row in enumerate(plan["pipelines"]):
            names = [f"agent {k}" + (f" ({regions[k]})" if regions and regions[k] else "") for k in row]
            lines.append(f"  pipeline {i}: " + " → ".join(names))
        if summary.get("spares"):
            lines.append("  spares: " + ", ".join(f"agent {k}" for k in summary["spares"]))
    if summary["losses"]:
        lines.append("step  loss     time")
        first = summary.get("start_step", 0)
        for i, (loss, took) in enumerate(zip(summary["losses"], summary["step_time_s"], strict=False)):
            lines.append(f"{first + i + 1:4d}  {loss:.4f}  {took:.3f} s")
        median = summary["median_step_time_s"]
        lines.append(f"median step time {median:.3f} s; loss {summary['losses'][0]:.4f} → {summary['losses'][-1]:.4f}")
        if summary.get("val_losses"):
            lines.append("validation loss: " + ", ".join(f"step {k} {v:.4f}" for k, v in summary["val_losses"]))
        if summary.get("throughput"):
            from p2ptrain.runtime.throughput import Throughput

            lines.append(f"throughput: {Throughput(**summary['throughput']).line()}")
    for r in summary.get("replans", []):
        took = f", {r['recovery_s']:.1f} s from the failure to its first step" if r["recovery_s"] is not None else ""
        redone = f", {r['steps_redone']} step(s) redone" if r.get("steps_redone") else ""
        lines.append(f"re-planned epoch {r['epoch']} at step {r['start_step']}: {r['reason']}{took}{redone}")
    if traffic := summary.get("dht_traffic"):
        rows = traffic.values()
        lines.append(f"DHT per agent: {max(r['stores_per_min'] for r in rows):.0f} stores and "
                     f"{max(r['reads_per_min'] for r in rows):.0f} reads a minute, "
                     f"{max(r['bytes_per_min'] for r in rows) / 1e3:.0f} kB a minute at most; "
                     f"{sum(r['failures'] for r in rows)} failed")
        lines.append(f"control traffic per agent: {max(r.get('pings_per_min', 0) for r in rows):.0f} pings "
                     f"({max(r.get('ping_bytes_per_min', 0) for r in rows) / 1e3:.1f} kB) and "
                     f"{max(r.get('probes_per_min', 0) for r in rows):.0f} probe round trips "
                     f"({max(r.get('probe_bytes_per_min', 0) for r in rows) / 1e6:.1f} MB) a minute at most")
        lines.append("  by agent, DHT calls · kB · pings and probes kB a minute: " + ", ".join(
            f"{a} {r['stores_per_min'] + r['reads_per_min']:.0f} · {r['bytes_per_min'] / 1e3:.0f} · "
            f"{(r.get('ping_bytes_per_min', 0) + r.get('probe_bytes_per_min', 0)) / 1e3:.0f}" for a, r in traffic.items()))
    lines.append(f"logs and status: {summary['workdir']}")
    return "\n".join(lines)
