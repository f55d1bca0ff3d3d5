"""The local swarm: a bootstrap and N agents as separate processes on this machine (``p2ptrain swarm``).

    result = run_swarm(SwarmConfig(agents=4, stages=2, steps=3), stop, on_update=display.update)

Each child runs in its own session (``runtime.procgroup``), so stopping one stops everything it started
(its DHT process, its p2pd). The work dir holds, per agent, its TOML config (``agent-K.toml``), identity
(``agent-K.id``, so peer IDs are known before they start; identity files already in the work dir are
reused), log (``agent-K.log``) and events
(``agent-K.events.jsonl``); the bootstrap's log and address line; the emulated network (``cluster.json``);
and ``swarm.json``, the status file (PIDs, peer IDs, paths); with a monitor (``monitor_port``), its log
(``monitor.log``) and page's URL (``monitor.url``, also in ``swarm.json``).

Emulated networks: with ``scenario`` (one of the paper's, scaled to N devices) or ``cluster_file``, agent
K plays device K: its transport shapes its links as that device's (docs/design.md "Link emulation"), so the
agents measure the network and the leader plans on measurements. Two factors map the network onto this
machine: ``size_factor`` (this run's activation bytes per boundary over the paper's c_PP; automatic for a
scenario) and ``time_scale`` (the network's seconds become this many seconds). A third, ``compute_scale``,
plays every device that many times slower and, unless a time scale is given, the network alike: the same
world in slow motion, for more agents than this machine has cores (``runtime.compute_speed.fitting_scale``).
With a scenario and no batch size, the global batch is chosen so that this run's c_PP/c_DP is near the
paper's (0.72), so one size factor serves both kinds of transfer.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from p2ptrain.agent.config import LivenessConfig
from p2ptrain.agent.events import EventReader
from p2ptrain.agent.leadership.plan_maker import run_workload
from p2ptrain.errors import ConfigError
from p2ptrain.lifecycle import StopSignal
from p2ptrain.net.dht.bootstrap import write_atomically
from p2ptrain.net.identity import load_or_create_identity
from p2ptrain.net.transport.emulation import EmulationConfig, scaled_bandwidth
from p2ptrain.net.transport.probe import ProbeConfig
from p2ptrain.planning import PAPER_WORKLOAD, Cluster, load_cluster, parameter_count, scenario
from p2ptrain.runtime.config import AUTO_STAGES, TrainConfig
from p2ptrain.runtime.procgroup import ProcessGroup, tail
from p2ptrain.swarm.config import AgentProcess, SwarmConfig, SwarmResult
from p2ptrain.swarm.report import SwarmState, summarize

logger = logging.getLogger(__name__)

PAPER_ACTIVATION_TO_GRADIENT = PAPER_WORKLOAD.activation_gb / PAPER_WORKLOAD.gradient_gb  # c_PP/c_DP ≈ 0.72
DEFAULT_TIME_SCALE = 0.05  # a scenario's seconds -> emulated seconds
LOOPBACK = "/ip4/127.0.0.1/tcp/0"
# What an agent process imports (``runtime.forkserver``): the command line and the agent, torch and hivemind,
# and the parts of torch that deterministic mode and the optimizer load on first use.
AGENT_MODULES = ("p2ptrain.cli", "p2ptrain.cli.agent", "p2ptrain.cli.bootstrap", "p2ptrain.agent.agent", "torch._dynamo",
                 "torch._inductor.config")

# Probing on loopback (no emulation): links are fast and alike; small transfers keep the CPU free, and their
# real jitter is large against them, so samples agree loosely and at most one more transfer is spent on it.
LOOPBACK_PROBE = ProbeConfig(pings=5, transfers=2, max_transfers=3, agreement=0.25, loosest_agreement=0.25,
                             max_transfer_bytes=4 << 20, rtt_multiple=3.0, min_transfer_s=0.02, max_transfer_s=0.5, deadline_s=30.0)
# Probing an emulated network: transfers long against the round trip; the fastest three must agree (an
# undisturbed sample is exact, net.probe), within 2 % and looser with each transfer past three, up to ten. Transfers
# of at least 0.06 s (0.15 s before): 16 agents on two cores measured a link in 0.6-0.7 s instead of 0.9-1.0, as
# close to the emulated links (bandwidth within 0.6-0.7 % at p90 both ways, ``benchmarks/probe_accuracy.py``), and
# planned 14.0 s after the last agent up instead of 16.3 (three runs each, ``benchmarks/swarm_start.py``).
EMULATED_PROBE = ProbeConfig(pings=8, transfers=3, max_transfers=10, agreement=0.02, rtt_multiple=4.0,
                             min_transfer_s=0.06, max_transfer_s=1.5, deadline_s=60.0)


def matched_batch_size(train: TrainConfig, stages: int, replicas: int) -> int:
    """The global batch whose c_PP/c_DP (fp32 activations per shard over one stage's gradients) is nearest
    the paper's 0.72, rounded to a multiple of replicas × micro-batches."""
    shape = train.shape
    params_per_stage = parameter_count(shape) / stages
    per_shard = PAPER_ACTIVATION_TO_GRADIENT * params_per_stage / (shape.seq_len * shape.hidden_size)
    unit = replicas * train.micro_batches
    return max(unit, unit * round(per_shard * replicas / unit))


def plan_swarm(config: SwarmConfig) -> tuple[TrainConfig, Cluster | None, float, float]:
    """The training config, the emulated network (or None) and its time scale and size factor. With ``stages``
    "auto" the batch and the size factor are matched as for one stage (every agent a replica)."""
    auto = config.stages == AUTO_STAGES
    matched_stages = 1 if auto else config.stages
    replicas = config.agents // matched_stages
    train = TrainConfig(model=config.model, subspace=config.subspace, steps=config.steps, global_batch_size=config.batch_size or 16,
                        micro_batches=config.micro_batches, seed=config.seed, device=config.device, num_threads=1,
                        stages=config.stages, wire=config.wire, schedule=config.schedule,
                        overlap=config.overlap, precision=config.precision, compile=config.compile,
                        eval_every=config.eval_every,
                        data=str(Path(config.data).resolve()) if config.data else None,
                        optimizer=config.optimizer, sync=config.sync, diloco=config.diloco,
                        init_from=str(Path(config.init_from).resolve()) if config.init_from else None)
    network = None
    if config.scenario is not None:
        network = scenario(config.scenario, config.agents)
        if config.batch_size is None:
            train = dataclasses.replace(train, global_batch_size=matched_batch_size(train, matched_stages, replicas))
    elif config.cluster_file is not None:
        network = load_cluster(config.cluster_file)
        if network.num_devices != config.agents:
            raise ConfigError(f"{config.cluster_file} has {network.num_devices} devices; run --agents {network.num_devices}")
    train = dataclasses.replace(train, replicas=1 if auto else replicas)  # checks that the batch splits
    if network is None:
        return train, None, 1.0, 1.0
    time_scale = config.time_scale or (DEFAULT_TIME_SCALE if config.scenario else 1.0) * config.compute_scale
    size_factor = config.size_factor
    if size_factor is None:
        own = run_workload(train, matched_stages, replicas).activation_gb
        size_factor = own / PAPER_WORKLOAD.activation_gb if config.scenario else 1.0
    return train, network, time_scale, size_factor


def run_swarm(
    config: SwarmConfig, stop: StopSignal, on_update: Callable[[SwarmState], None] | None = None,
    on_monitor: Callable[[str], None] | None = None,
) -> SwarmResult:
    """Start the swarm, follow it until every agent is done (or one fails, a deadline passes, or ``stop``),
    stop every process, and summarise. Never leaves a process running. With ``SwarmConfig.monitor_port``, a
    monitor starts before the agents (so it sees the run from its start) and ``on_monitor(url)`` is called
    once its page answers; it stops with the swarm."""
    train, network, time_scale, size_factor = plan_swarm(config)
    if train.compile:  # torch cannot compile here: one line before any agent starts
        from p2ptrain.model.compiled import check_compile
        from p2ptrain.runtime.reference import resolve_device

        check_compile(resolve_device(train.device))
    root = Path(config.workdir or tempfile.mkdtemp(prefix="p2ptrain-swarm-"))
    root.mkdir(parents=True, exist_ok=True)
    run = config.run or f"swarm-{uuid.uuid4().hex[:6]}"
    cluster_path = None
    if network is not None:
        cluster_path = root / "cluster.json"
        cluster_path.write_text(json.dumps(network.to_dict()))
    agents = _prepare_agents(root, range(config.agents))
    state = SwarmState(config=config, train=train, run=run, workdir=str(root), network=network,
                       time_scale=time_scale, size_factor=size_factor, agents=agents)
    with ProcessGroup(grace_s=15.0) as group:
        try:
            # The bootstrap, the agents and the monitor are forked from a server that imports their modules
            # once: each would otherwise take seconds of CPU to import torch and hivemind (on 2 busy cores, the
            # bootstrap's own imports cost as much as the wait for the server's).
            group.use_fork_server(AGENT_MODULES, log_path=root / "forkserver.log")
            maddrs = _start_bootstrap(group, root, run, config.startup_timeout_s, stop)
            if config.monitor_port is not None:
                url = _start_monitor(group, root, run, maddrs, config, train, network is not None,
                                     (time_scale, size_factor), stop)
                if on_monitor is not None:
                    on_monitor(url)
            def launch(new: list[AgentProcess]) -> None:
                for agent in new:
                    toml = _agent_toml(config, train, run, maddrs, agent, root, cluster_path, time_scale, size_factor,
                                       _probe(config, network, time_scale, size_factor))
                    agent.config_path.write_text(toml)
                    argv = [sys.executable, "-m", "p2ptrain", "agent", "--config", str(agent.config_path)]
                    if agent.index in config.fail_start:  # fault injection: a start that fails
                        argv = [sys.executable, "-c", f"raise SystemExit('agent {agent.index}: Error: a start that "
                                                      "fails (SwarmConfig.fail_start)')"]
                    child = group.start(agent.name, argv, log_path=agent.log_path, fork=True)
                    agent.pid = child.pid
                _write_status(root, run, group, state.agents)

            launch(agents)
            faults = FaultInjector(config, group, state, root, launch)
            error = _follow(config, group, state, stop, on_update, faults)
        except (TimeoutError, RuntimeError) as e:
            error = str(e)
        finally:
            group.stop_all()  # agents stop before the bootstrap: every agent's own shutdown reaps its p2pd
    summary = summarize(state)
    ok = error is None and summary["finished"] and all(
        group.children[a.name].poll() == 0 for a in state.agents if not state.is_out(a.index)
    )
    if error is None and not ok:
        error = "an agent did not finish; see its log in " + str(root)
    return SwarmResult(ok, summary, str(root), error, state.agents)


def _prepare_agents(root: Path, indices) -> list[AgentProcess]:
    agents = []
    for k in indices:
        (root / f"agent-{k}.events.jsonl").unlink(missing_ok=True)  # a reused work dir: this run's events only
        identity = load_or_create_identity(root / f"agent-{k}.id")  # a work dir reused keeps its peer IDs
        agents.append(AgentProcess(k, identity.peer_id, f"agent-{k}", root / f"agent-{k}.toml",
                                   root / f"agent-{k}.log", EventReader(root / f"agent-{k}.events.jsonl")))
    return agents


def _start_bootstrap(group: ProcessGroup, root: Path, run: str, timeout_s: float, stop: StopSignal) -> list[str]:
    announce = root / "bootstrap.maddrs"
    announce.unlink(missing_ok=True)
    child = group.start("bootstrap", [sys.executable, "-m", "p2ptrain", "bootstrap", "--host-maddrs", LOOPBACK,
                                      "--announce-file", str(announce), "--run-id", run],
                        log_path=root / "bootstrap.log", stdout_path=root / "bootstrap.out", fork=True)
    return _wait_announced(announce, child, "bootstrap", root / "bootstrap.log", timeout_s, stop).split()


def _wait_announced(announce: Path, child, name: str, log: Path, timeout_s: float, stop: StopSignal) -> str:
    """The line ``child`` writes to ``announce`` once it is up; RuntimeError if it exits or we are stopped
    first, TimeoutError past ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not announce.exists():
        if child.poll() is not None:
            raise RuntimeError(f"the {name} exited with code {child.poll()}: {tail(log, 5)}")
        if stop.is_set():
            raise RuntimeError(f"stopped ({stop.reason})")
        if time.monotonic() > deadline:
            raise TimeoutError(f"the {name} did not start within {timeout_s:.0f} s; see {log}")
        time.sleep(0.1)
    return announce.read_text().strip()


def _start_monitor(group: ProcessGroup, root: Path, run: str, maddrs: list[str], config: SwarmConfig,
                   train: TrainConfig, emulated: bool, factors: tuple[float, float], stop: StopSignal) -> str:
    """Start ``p2ptrain monitor`` on the swarm's DHT; its page's URL, once it answers."""
    announce = root / "monitor.url"
    announce.unlink(missing_ok=True)
    command = [sys.executable, "-m", "p2ptrain", "monitor", "--initial-peers", " ".join(maddrs), "--run", run,
               "--port", str(config.monitor_port), "--poll", "1", "--announce-file", str(announce),
               "--tokens-per-step", str(train.global_batch_size * train.shape.seq_len)]
    if emulated:
        command += ["--time-scale", repr(factors[0]), "--size-factor", repr(factors[1])]
    child = group.start("monitor", command, log_path=root / "monitor.log", stdout_path=root / "monitor.out", fork=True)
    return _wait_announced(announce, child, "monitor", root / "monitor.log", config.startup_timeout_s, stop)


def _write_status(root: Path, run: str, group: ProcessGroup, agents: list[AgentProcess]) -> None:
    status = {
        "run": run, "swarm_pid": os.getpid(),
        "bootstrap": {"pid": group.children["bootstrap"].pid, "log": str(root / "bootstrap.log"),
                      "maddrs_file": str(root / "bootstrap.maddrs")},
        "agents": [{"index": a.index, "pid": a.pid, "peer_id": a.peer_id, "log": str(a.log_path),
                    "events": str(a.events.path), "config": str(a.config_path)} for a in agents],
    }
    if "monitor" in group.children:
        status["monitor"] = {"pid": group.children["monitor"].pid, "log": str(root / "monitor.log"),
                             "url": _read_or_none(root / "monitor.url")}
    write_atomically(root / "swarm.json", json.dumps(status, indent=1) + "\n")


def _read_or_none(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        return None


class FaultInjector:
    """``--kill`` and ``--join``: act on the swarm when the agents' events say a step was reached."""

    def __init__(self, config: SwarmConfig, group: ProcessGroup, state: SwarmState, root: Path,
                 launch: Callable[[list[AgentProcess]], None]):
        self.group, self.state, self.root, self.launch = group, state, root, launch
        self.kills = sorted(config.kills, key=lambda k: k[1])
        self.joins = sorted(config.joins, key=lambda j: j[1])
        self.partitions = sorted(config.partitions, key=lambda p: p[1])
        self.resumes: list[tuple[float, int]] = []  # (monotonic time, agent index) to SIGCONT

    def tick(self) -> None:
        done = self.state.steps_done()
        while self.kills and self._reached(self.kills[0], done) and (done or self.state.all_have_roles()):
            agent, step = self.kills.pop(0)
            self._kill(agent, step)
        while self.partitions and done >= self.partitions[0][1] - 1 and (done or self.state.all_have_roles()):
            agent, step, seconds = self.partitions.pop(0)
            index = int(agent)
            self.group.signal(self.state.agents[index].name, signal.SIGSTOP)
            self.state.killed[index] = {"step": step, "time": time.time(), "as": "partitioned", "seconds": seconds}
            self.resumes.append((time.monotonic() + seconds, index))
            logger.info("stopped agent %d (cut off) with step %d in flight, for %g s", index, step, seconds)
        for due, index in list(self.resumes):
            if time.monotonic() >= due:
                self.resumes.remove((due, index))
                self.group.signal(self.state.agents[index].name, signal.SIGCONT)
                self.state.killed[index]["resumed"] = time.time()
                logger.info("agent %d continues after its partition", index)
        while self.joins and done >= self.joins[0][1]:
            count, step = self.joins.pop(0)
            first = len(self.state.agents)
            new = _prepare_agents(self.root, range(first, first + count))
            self.state.agents.extend(new)
            self.launch(new)
            logger.info("started %d joining agent(s) after step %d: %s", count, step, [a.index for a in new])
            self.state.joins.append({"step": step, "agents": [a.index for a in new], "time": time.time()})

    def _reached(self, kill: tuple[str, int], done: int) -> bool:
        """Whether ``kill``'s agent has its step in flight: its own steps in the epoch it trains (DiLoCo's replicas
        train their rounds apart, steps from each other), else (a spare, not started) the run's."""
        agent, step = kill
        index = self.state.current_leader() if agent == "leader" else int(agent)
        role = self.state.agents[index].events.last("role") if index is not None and index < len(self.state.agents) \
            else None
        if role is None or role.get("stage") is None:
            return done >= step - 1
        own = [e["step"] for e in self.state.agents[index].events.all("step") if e["epoch"] == role["epoch"]]
        return max(own, default=role.get("start_step", 0)) >= step - 1

    def _kill(self, agent: str, step: int) -> None:
        index = self.state.current_leader() if agent == "leader" else int(agent)
        if index is None or index >= len(self.state.agents) or self.state.is_killed(index):
            logger.warning("--kill %s@%d: no such live agent; skipped", agent, step)
            return
        name = self.state.agents[index].name
        self.group.signal(name, signal.SIGKILL)
        self.state.killed[index] = {"step": step, "time": time.time(), "as": agent}
        logger.info("killed agent %d (%s) with step %d in flight", index, agent, step)
        try:
            self.group.children[name].popen.wait(timeout=10)
        except subprocess.TimeoutExpired:
            logger.error("agent %d survived SIGKILL", index)


def _follow(config: SwarmConfig, group: ProcessGroup, state: SwarmState, stop: StopSignal,
            on_update: Callable[[SwarmState], None] | None, faults: FaultInjector) -> str | None:
    """Watch the agents until all exited; the reason for failing, or None."""
    deadline = time.monotonic() + startup_deadline_s(config)
    seen = (0, 0, 0)  # steps done, agents with a role, the run's moves toward its first plan: each is progress
    while True:
        changed = any([bool(agent.events.poll()) for agent in state.agents])
        if changed and on_update is not None:
            on_update(state)
        faults.tick()
        steps, roles, moves = state.steps_done(), len(state.roles()), _plan_moves(state)
        if steps > seen[0]:
            deadline = time.monotonic() + config.step_timeout_s
        elif roles > seen[1]:  # an agent took its role: the plan's checks go on (32 agents: minutes on two cores)
            deadline = max(deadline, time.monotonic() + config.step_timeout_s)
        elif moves > seen[2]:  # the agents' own plan_timeout_s counts from such a move (``leadership.plan_wait``)
            deadline = max(deadline, time.monotonic() + startup_deadline_s(config))
        seen = (max(seen[0], steps), max(seen[1], roles), max(seen[2], moves))
        running = [a for a in state.agents if group.children[a.name].poll() is None]
        failed = [a for a in state.agents if group.children[a.name].poll() not in (None, 0) and not state.is_out(a.index)]
        if failed and (why := _failed_start(config, group, state, failed)) is not None:
            return why
        failed = [a for a in failed if a.index not in state.failed_start]
        if failed:
            agent = failed[0]
            return f"agent {agent.index} exited with code {group.children[agent.name].poll()}: " + _last_error(agent)
        quit_early = [a for a in state.agents if group.children[a.name].poll() == 0 and a.events.last("done") is None]
        if quit_early:
            agent = quit_early[0]
            agent.events.poll()
            if agent.events.last("done") is None:
                stopped = agent.events.last("stopped")
                return f"agent {agent.index} stopped before finishing" + (f" ({stopped['reason']})" if stopped else "")
        if not running:
            return None
        if stop.is_set():
            return f"stopped ({stop.reason})"
        if group.children["bootstrap"].poll() is not None and not state.all_have_roles():
            return "the bootstrap exited before the agents had a plan"
        if time.monotonic() > deadline:
            phase = "step" if state.all_have_roles() else "plan"
            return f"no progress within the {phase} deadline; see the agents' logs in {state.workdir}"
        stop.wait(0.2)


def _plan_moves(state: SwarmState) -> int:
    """How far the run has come toward its first plan, as the agents' events say: agents up, agents that
    published their links, leaders that began a search, plans published (64 agents on two cores: 5 minutes of
    links, then a 6- to 14-minute search; a deadline from the last row published cut one search 7 s before its
    plan)."""
    return sum(bool(a.events.last("started")) + bool(a.events.last("links")) + len(a.events.all("planning"))
               for a in state.agents) + len(state.plans())


def _failed_start(config: SwarmConfig, group: ProcessGroup, state: SwarmState,
                  failed: list[AgentProcess]) -> str | None:
    """Agents of ``failed`` that exited before they joined the run (no ``started`` event) while it has no plan
    yet: noted in ``SwarmState.failed_start`` and logged, and the run goes on without them (the leader plans
    without them at the swarm's join deadline); the reason to stop when too few are left to train the stages."""
    for agent in failed:
        if agent.events.last("started") is None and state.leader_plan() is None:
            why = f"exited with code {group.children[agent.name].poll()}: {_last_error(agent)}"
            state.failed_start[agent.index] = why
            logger.warning("agent %d failed to start (%s); the run goes on without it", agent.index, why)
    left = len(state.agents) - len(state.failed_start)
    needed = config.stages if isinstance(config.stages, int) else 1
    if state.failed_start and left < needed:
        return (f"{len(state.failed_start)} agent(s) failed to start, and {left} cannot train {needed} stages; the "
                f"first: agent {min(state.failed_start)} {state.failed_start[min(state.failed_start)]}")
    return None


def _last_error(agent: AgentProcess) -> str:
    error = agent.events.last("error")
    if error is not None:
        return error["error"]
    lines = [line for line in tail(agent.log_path, 40).splitlines() if "Error" in line or "ERROR" in line]
    return lines[-1] if lines else f"see {agent.log_path}"


def _probe(config: SwarmConfig, network: Cluster | None, time_scale: float, size_factor: float) -> ProbeConfig:
    """The link prober's settings: ``SwarmConfig.probe``, else for an emulated network ``EMULATED_PROBE`` with its
    first transfer no longer than ``min_transfer_s`` on the network's slowest line (a home's access link,
    emulated at a few hundred kbit/s, took 2.5 s a 64 KiB transfer, and eight homes probing each other
    through their shared uplinks did not finish within the start-up deadline), else ``LOOPBACK_PROBE``."""
    if config.probe is not None:
        return config.probe
    if network is None:
        return LOOPBACK_PROBE
    off = ~np.eye(network.num_devices, dtype=bool)
    lines = [network.bandwidth_gbps[off].min()] + [float(v.min()) for v in (network.uplink_gbps, network.downlink_gbps)
                                                   if v is not None]
    slowest = scaled_bandwidth(float(min(lines)), EmulationConfig(time_scale, size_factor))  # emulated bytes/s
    first = int(min(EMULATED_PROBE.first_transfer_bytes, max(4 << 10, slowest * EMULATED_PROBE.min_transfer_s)))
    return dataclasses.replace(EMULATED_PROBE, first_transfer_bytes=first)


def _agent_toml(config: SwarmConfig, train: TrainConfig, run: str, maddrs: list[str], agent: AgentProcess,
                root: Path, cluster_path: Path | None, time_scale: float, size_factor: float,
                probe: ProbeConfig | None = None) -> str:
    probe = probe or config.probe or (EMULATED_PROBE if cluster_path else LOOPBACK_PROBE)
    tables: dict[str, Any] = {
        "run": run, "initial_peers": maddrs, "events_file": str(agent.events.path),
        "train": {k: v for k, v in asdict(train).items() if v is not None and k != "replicas"},
        "membership": {"expect": config.agents, "poll_s": _shared_cores_pause_s(config.agents),
                       "plan_timeout_s": startup_deadline_s(config),
                       "join_deadline_s": config.join_deadline_s or startup_deadline_s(config) / 2,
                       "min_peers": config.stages if isinstance(config.stages, int) else 1,
                       "links_timeout_s": startup_deadline_s(config) / 2, "finish_timeout_s": config.call_timeout_s},
        "plan": {"strategy": config.strategy, "seed": config.seed, "objective": config.objective,
                 "time_budget_s": config.plan_budget_s},
        # agents on one machine share its loopback, no home's line: an emulated device publishes its network's
        "links": {"settle_s": 1.5 if cluster_path else 0.0, "round_pause_s": _shared_cores_pause_s(config.agents), "measure_access": False,
                  "min_rounds": 1, "probe": asdict(probe), "partners": config.link_partners},
        "dht": {"host_maddrs": [LOOPBACK], "identity_path": str(root / f"agent-{agent.index}.id"), "check_identity": False,
                "peer_ttl_s": config.peer_ttl_s * max(1.0, _shared_cores_factor(config.agents) / 2)},
        "transport": {"call_timeout_s": config.call_timeout_s},
        "churn": {"halt_timeout_s": max(config.call_timeout_s, config.peer_ttl_s) * 2},
        "liveness": {"enabled": config.liveness, **_shared_cores_liveness(config.agents)},
        "verify": {"enabled": config.verify} | ({"rate": config.verify_rate} if config.verify_rate is not None else {}),
        "checkpoint": {"every_steps": config.checkpoint_every, "resume": config.resume,
                       "local_dir": str(root / f"agent-{agent.index}.state")},
    }
    if config.checkpoint_every or config.shared_checkpoints:
        tables["checkpoint"]["dir"] = str(root / "checkpoints")
    if not config.warm_copies:
        tables["churn"]["backup_every"] = 0
    if cluster_path is not None:
        tables["emulation"] = {"cluster_file": str(cluster_path), "device_index": agent.index,
                               "time_scale": time_scale, "size_factor": size_factor,
                               "compute_scale": config.compute_scale}
    return to_toml(tables)


AGENTS_PER_LIVENESS_TIMEOUT = 8  # beyond this many agents on one machine, heartbeats wait longer (below)


def _shared_cores_factor(agents: int) -> int:
    """1 up to ``AGENTS_PER_LIVENESS_TIMEOUT`` agents on this machine, then one more per as many more: how many
    times longer heartbeats wait and less often agents ping and poll. Beyond 16 agents a record also lives half
    that many times longer: 32 agents polling and refreshing at the defaults kept the few DHT processes that hold
    the run's records so busy that stores of peer records timed out and live agents' records expired."""
    return -(-agents // AGENTS_PER_LIVENESS_TIMEOUT)


def _shared_cores_pause_s(agents: int) -> float:
    """How often an agent reads the run's records while it waits, and pauses between its rounds of link
    measurements: 0.25 s up to ``AGENTS_PER_LIVENESS_TIMEOUT`` agents (a 4-agent swarm's start and re-plans wait on
    these reads: every half second more cost a tenth of its run), half a second per ``_shared_cores_factor``
    beyond (more agents reading faster load the few DHT processes that hold the run's records)."""
    factor = _shared_cores_factor(agents)
    return 0.25 if factor == 1 else 0.5 * factor


def startup_deadline_s(config: SwarmConfig) -> float:
    """From launch, or the run's last move toward its first plan, until an agent has its role (each one after gives
    the others at least ``step_timeout_s`` more, ``_follow``): ``startup_timeout_s``, and beyond 16 agents half
    ``_shared_cores_factor`` times that (32 agents on 2 cores measured their links for over two minutes)."""
    return config.startup_timeout_s * max(1.0, _shared_cores_factor(config.agents) / 2)


def _shared_cores_liveness(agents: int) -> dict[str, float]:
    """Heartbeat deadlines for ``agents`` processes sharing this machine's cores: the defaults up to
    ``AGENTS_PER_LIVENESS_TIMEOUT``, then that many times longer per as many more. Sixteen agents on two cores
    checking a plan at once (each a search of its own) answered pings late enough to be judged dead with the
    defaults (2 s a ping, 6 s silent), and the run's first epoch halted; a starved process is not a dead peer.
    They ping as many times less often: before its first plan a run of up to ``liveness.watch_all_up_to`` agents
    pings every pair, and sixteen agents pinging fifteen others a second kept a core busy (pings, their p2pd hops)."""
    factor = _shared_cores_factor(agents)
    if factor <= 1:
        return {}
    defaults = LivenessConfig()
    return {"interval_s": defaults.interval_s * factor, "ping_timeout_s": defaults.ping_timeout_s * factor,
            "timeout_s": defaults.timeout_s * factor}


def to_toml(tables: dict[str, Any]) -> str:
    """A TOML document of top-level keys and (dotted-name) tables of strings, numbers, bools and lists; a None
    value is left out (TOML has no null: the key's default)."""
    lines = [f"{k} = {_toml_value(v)}" for k, v in tables.items() if not isinstance(v, dict) and v is not None]
    pending = [(k, v) for k, v in tables.items() if isinstance(v, dict)]
    while pending:
        name, table = pending.pop(0)
        lines.append(f"\n[{name}]")
        lines += [f"{k} = {_toml_value(v)}" for k, v in table.items() if not isinstance(v, dict) and v is not None]
        pending += [(f"{name}.{k}", v) for k, v in table.items() if isinstance(v, dict)]
    return "\n".join(lines) + "\n"


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a valid TOML basic string
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {type(value).__name__} to TOML")
