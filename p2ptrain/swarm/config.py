"""What a local swarm is asked to run (``SwarmConfig``), its agent processes and its result.

Apart from the launcher (``agent_launcher``) so that the launcher and its report (``report``) both import it,
and neither imports the other's caller.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from p2ptrain.agent.config import ObjectiveName, Strategy
from p2ptrain.agent.events import EventReader
from p2ptrain.errors import ConfigError
from p2ptrain.model.optim import OptimizerConfig
from p2ptrain.model.outer import DiLoCoConfig
from p2ptrain.net.dht.keys import check_run_id
from p2ptrain.net.transport.probe import ProbeConfig


@dataclass(frozen=True)
class SwarmConfig:
    agents: int = 4
    stages: int | str = 2  # or "auto": the leader chooses (TrainConfig.stages)
    steps: int = 10
    scenario: str | None = "worldwide"  # one of the paper's networks, scaled to `agents` devices; None: loopback
    cluster_file: str | None = None  # or a cluster file of `agents` devices (docs/design.md "Cluster file")
    # default: DEFAULT_TIME_SCALE for a scenario, 1 for a cluster file, times compute_scale
    time_scale: float | None = None
    size_factor: float | None = None  # default: automatic for a scenario, 1 for a cluster file
    compute_scale: float = 1.0  # emulated devices this many times slower (EmulationSettings.compute_scale)
    strategy: Strategy = "scheduled"
    objective: ObjectiveName = "dtfm"  # what the leader scores plans by ("simulated": agents calibrate first)
    model: str = "tiny"
    batch_size: int | None = None  # default: matched to the paper's c_PP/c_DP when emulating a scenario, else 16
    micro_batches: int = 2
    wire: str = "fp32"  # TrainConfig.wire: how tensors travel (p2ptrain.runtime.wire)
    schedule: str = "gpipe"  # TrainConfig.schedule: gpipe or 1f1b
    overlap: bool = True  # TrainConfig.overlap: gradient buckets all-reduced during the last backward
    seed: int = 0
    device: str = "cpu"
    data: str | None = None  # TrainConfig.data: text, or a prepared dataset (p2ptrain data prepare); None: built-in
    precision: str = "fp32"  # TrainConfig.precision: fp32 (exact), bf16 or fp16
    compile: bool = False  # TrainConfig.compile: each block through torch.compile
    eval_every: int = 0  # TrainConfig.eval_every: the summary evaluates the checkpoints of every K steps
    workdir: str | None = None  # default: a new temporary directory (kept: it holds the logs)
    run: str | None = None  # default: swarm-<random>
    startup_timeout_s: float = 240.0  # from launch until every agent has its role
    # the leader plans without the agents not live this long after its start (one that failed to start: the
    # swarm reports it and goes on); None: half of startup_timeout_s
    join_deadline_s: float | None = None
    step_timeout_s: float = 180.0  # longest wait for the next step
    call_timeout_s: float = 60.0
    plan_budget_s: float = 60.0  # PlanConfig.time_budget_s: the leader's search, and what followers allow it
    probe: ProbeConfig | None = None  # default: LOOPBACK_PROBE or EMULATED_PROBE
    peer_ttl_s: float = 30.0  # a peer record's lifetime (refreshed every half); heartbeats notice the dead sooner
    kills: tuple[tuple[str, int], ...] = ()  # (agent index or "leader", step): SIGKILL it while that step runs
    # (agent index, step, seconds): SIGSTOP its process group (agent, DHT, p2pd: cut off, not dead) while
    # that step runs, SIGCONT it that many seconds later
    partitions: tuple[tuple[str, int, float], ...] = ()
    joins: tuple[tuple[int, int], ...] = ()  # (count, step): start this many more agents when that step is done
    fail_start: tuple[int, ...] = ()  # these agents' processes exit at once with an error (a broken install)
    checkpoint_every: int = 0  # every K steps each stage's replica 0 saves a checkpoint in <workdir>/checkpoints
    shared_checkpoints: bool = False  # resume and re-plans also read <workdir>/checkpoints (with checkpoint_every)
    resume: bool = False  # the first plan starts from the agents' own copies (<workdir>/agent-K.state)
    liveness: bool = True  # heartbeat pings (off: failures show only as failed calls and expired records)
    verify: bool = True  # the checks of members' work (``[verify] enabled``; off: to measure what they cost)
    verify_rate: float | None = None  # their ``[verify] rate`` (None: the default)
    warm_copies: bool = True  # periodic warm copies of every stage (off: only the epochs' start copies)
    monitor_port: int | None = None  # also start ``p2ptrain monitor`` on this port (0: any free port); None: no
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)  # TrainConfig.optimizer: unsaid keys, the preset's
    init_from: str | None = None  # TrainConfig.init_from: start from a Hugging Face folder or a p2ptrain checkpoint
    sync: str = "every-step"  # TrainConfig.sync: every step, or DiLoCo rounds (``diloco``)
    diloco: DiLoCoConfig = field(default_factory=DiLoCoConfig)  # TrainConfig.diloco

    def __post_init__(self) -> None:
        self._check()
        for agent, step in self.kills:
            if agent != "leader" and not (agent.isdigit() and int(agent) < self.agents + sum(n for n, _ in self.joins)):
                raise ConfigError(f"--kill {agent}@{step}: AGENT must be an agent index or 'leader'")
            if not 1 <= step <= self.steps:
                raise ConfigError(f"--kill {agent}@{step}: STEP must be in 1..{self.steps}")
        for agent, step, seconds in self.partitions:
            if not (agent.isdigit() and int(agent) < self.agents) or not 1 <= step <= self.steps or not seconds > 0:
                raise ConfigError(f"--partition {agent}@{step}:{seconds:g}: AGENT must be an agent index, STEP in "
                                  f"1..{self.steps} and SECONDS positive")
        for count, step in self.joins:
            if count < 1 or not 0 <= step < self.steps:
                raise ConfigError(f"--join {count}@{step}: N must be >= 1 and STEP in 0..{self.steps - 1}")
        if self.compute_scale != 1 and not self.emulated:
            raise ConfigError("--compute-scale slows emulated devices: it needs --scenario or --cluster")
        if self.joins and self.emulated:
            raise ConfigError("--join needs a loopback swarm (--scenario none): a joiner plays no emulated device")
        if self.monitor_port is not None and not 0 <= self.monitor_port <= 65535:
            raise ConfigError(f"--monitor {self.monitor_port}: the port must be in 0..65535")
        if self.checkpoint_every < 0 or not self.peer_ttl_s > 0:
            raise ConfigError("--checkpoint-every must be >= 0 and the peer TTL positive")

    def _check(self) -> None:
        fixed = self.stages != "auto"
        if self.agents < 1 or self.steps < 1 or (fixed and (not isinstance(self.stages, int) or self.stages < 1)):
            raise ConfigError('--agents, --stages and --steps must be at least 1 (--stages may be "auto")')
        if self.run is not None:
            check_run_id(self.run)
        if fixed and self.agents < self.stages:
            raise ConfigError(f"{self.agents} agents cannot hold {self.stages} stages")
        if self.scenario is not None and self.cluster_file is not None:
            raise ConfigError("give --scenario or --cluster, not both")
        for name in ("time_scale", "size_factor"):
            value = getattr(self, name)
            if value is not None and not 0 < value < float("inf"):
                raise ConfigError(f"--{name.replace('_', '-')} must be a positive number, got {value}")
        if not 1 <= self.compute_scale < float("inf"):
            raise ConfigError(f"--compute-scale must be a number of at least 1, got {self.compute_scale}")

    @property
    def emulated(self) -> bool:
        return self.scenario is not None or self.cluster_file is not None


@dataclass
class AgentProcess:
    index: int
    peer_id: str
    name: str
    config_path: Path
    log_path: Path
    events: EventReader
    pid: int = 0


@dataclass
class SwarmResult:
    ok: bool  # every agent trained every step and exited 0
    summary: dict[str, Any]
    workdir: str
    error: str | None = None
    agents: list[AgentProcess] = field(default_factory=list)
