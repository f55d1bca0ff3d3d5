"""What a local swarm is asked to run (``SwarmConfig``), its agent processes and its result.

Apart from the launcher (``agent_launcher``) so that the launcher and its report (``report``) both import it,
and neither imports the other's caller.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from p2ptrain.agent.config import ObjectiveName, Strategy
from p2ptrain.agent.events import EventReader
from p2ptrain.config import option, option_like
from p2ptrain.errors import ConfigError
from p2ptrain.model.optim import OptimizerConfig
from p2ptrain.model.outer import DiLoCoConfig
from p2ptrain.net.dht.keys import check_run_id
from p2ptrain.net.transport.probe import ProbeConfig
from p2ptrain.runtime.config import Device, Precision, SyncMode, TrainConfig
from p2ptrain.runtime.schedule import ScheduleName
from p2ptrain.runtime.wire import WireName


@dataclass(frozen=True)
class SwarmConfig:
    agents: int = option(4, "Agent processes.", min=1)
    stages: int | Literal["auto"] = option(  # or "auto": the leader chooses (TrainConfig.stages)
        2, "Pipeline stages; auto: the leader chooses them for the run's first plan.")
    steps: int = option_like(TrainConfig, "steps", 10)
    # one of the paper's networks, scaled to `agents` devices; None: loopback
    scenario: str | None = option("worldwide", "The network to emulate, scaled to --agents devices (volunteers: mixed "
                                  "GPUs too, their compute emulated); 'none': plain loopback.")
    # or a cluster file of `agents` devices (docs/design.md "Cluster file")
    cluster_file: str | None = option(
        None, "Emulate this cluster file instead (docs/design.md format, one device per agent).", path="file")
    # None: DEFAULT_TIME_SCALE for a scenario, 1 for a cluster file, times compute_scale
    time_scale: float | None = option(None, "Emulated seconds per network second.", min=0, min_open=True,
                                      default_text="0.05 for a scenario, 1 for --cluster, times --compute-scale")
    size_factor: float | None = option(None, "This run's bytes per paper byte.", min=0, min_open=True,
                                       default_text="automatic for a scenario, 1 for --cluster")
    # emulated devices this many times slower (EmulationSettings.compute_scale)
    compute_scale: float = option(
        1.0, "Play every emulated device this many times slower, and (unless --time-scale is given) the network "
        "alike: the same world in slow motion, in which more agents than cores compute as on cards of their own.",
        min=1)
    strategy: Strategy = option("scheduled", "The leader's strategy.")
    # what the leader scores plans by ("simulated": agents calibrate first)
    objective: ObjectiveName = option(
        "dtfm", "What the leader scores plans by: the paper's communication cost, or the simulated step time.")
    model: str = option_like(TrainConfig, "model", "tiny")
    subspace: int = option_like(TrainConfig, "subspace", 0)  # TrainConfig.subspace: the residual stream's rank
    # None: matched to the paper's c_PP/c_DP when emulating a scenario, else 16
    batch_size: int | None = option(None, "Global batch.", min=1, default_text="matched to the paper's c_PP/c_DP "
                                    "when emulating a scenario, else 16")
    micro_batches: int = option_like(TrainConfig, "micro_batches", 2)
    # TrainConfig.wire: how tensors travel (p2ptrain.runtime.wire)
    wire: WireName = option_like(TrainConfig, "wire", "fp32", help="How tensors travel between agents (fp32 is exact).")
    schedule: ScheduleName = option_like(TrainConfig, "schedule", "gpipe")  # TrainConfig.schedule: gpipe or 1f1b
    overlap: bool = option_like(TrainConfig, "overlap", True)  # TrainConfig.overlap
    seed: int = option(0, "Seed of parameters, batches and the leader's planner.", min=0)
    device: Device = option("cpu", "Where the agents train.")
    # TrainConfig.data: text, or a prepared dataset (p2ptrain data prepare); None: built-in
    data: str | None = option(None, "Training data: a text file or folder, or a prepared dataset (p2ptrain data "
                              "prepare).", default_text="the built-in corpus")
    precision: Precision = option_like(TrainConfig, "precision", "fp32")  # TrainConfig.precision
    compile: bool = option_like(TrainConfig, "compile", False)  # TrainConfig.compile: each block through torch.compile
    # TrainConfig.eval_every: the summary evaluates the checkpoints of every K steps
    eval_every: int = option(0, "Validation loss of the checkpoints every K steps (a prepared dataset; checkpoints "
                             "every K steps unless --checkpoint-every says otherwise).", min=0)
    # None: a new temporary directory (kept: it holds the logs)
    workdir: str | None = option(None, "Logs, configs and status here.", path="dir", default_text="a new temp dir")
    run: str | None = option(None, "Run name (DHT keys).", default_text="swarm-<random>")
    # from launch, or the run's last move toward its first plan (an agent up, a links row, a plan published), until
    # every agent has its role (each role taken gives the others at least step_timeout_s more)
    startup_timeout_s: float = 240.0
    # the leader plans without the agents not live this long after its start (one that failed to start: the
    # swarm reports it and goes on); None: half of startup_timeout_s
    join_deadline_s: float | None = None
    step_timeout_s: float = 180.0  # longest wait for the next step
    call_timeout_s: float = option(60.0, "Seconds a tensor call may take before its peer counts as failed.", min=0,
                                   min_open=True)
    plan_budget_s: float = 60.0  # PlanConfig.time_budget_s: the leader's search, and what followers allow it
    probe: ProbeConfig | None = None  # default: LOOPBACK_PROBE or EMULATED_PROBE
    # a peer record's lifetime (refreshed every half); heartbeats notice the dead sooner
    peer_ttl_s: float = option(30.0, "Lifetime of an agent's peer record (heartbeats notice a silent agent sooner).",
                               min=0, min_open=True)
    # each agent's ``[links] partners`` (None: the agents' default): the peers it measures, the others estimated
    link_partners: int | None = option(None, "Peers each agent measures (links.partners; the other links are "
                                       "estimated from them); default: the agents' own.", min=2)
    # (agent index or "leader", step): SIGKILL it while that step runs
    kills: tuple[tuple[str, int], ...] = option(
        (), "SIGKILL agent AGENT (an index, or 'leader') while its step STEP is in flight; repeatable.")
    # (agent index, step, seconds): SIGSTOP its process group (agent, DHT, p2pd: cut off, not dead) while
    # that step runs, SIGCONT it that many seconds later
    partitions: tuple[tuple[str, int, float], ...] = option(
        (), "Cut agent AGENT off (SIGSTOP its processes) while step STEP is in flight, for SECONDS; repeatable.")
    # (count, step): start this many more agents when that step is done
    joins: tuple[tuple[int, int], ...] = option(
        (), "Start N more agents once step STEP is done; they take a role at the next re-plan; repeatable.")
    fail_start: tuple[int, ...] = ()  # these agents' processes exit at once with an error (a broken install)
    # every K steps each stage's replica 0 saves a checkpoint in <workdir>/checkpoints
    checkpoint_every: int = option(
        0, "Save every stage's state every K steps in <workdir>/checkpoints (0: never).", min=0)
    shared_checkpoints: bool = False  # resume and re-plans also read <workdir>/checkpoints (with checkpoint_every)
    # the first plan starts from the agents' own copies (<workdir>/agent-K.state)
    resume: bool = option(False, "Start from the newest step every stage has a copy of on the agents' own disks "
                          "(<workdir>/agent-K.state), or in <workdir>/checkpoints with --checkpoint-every.")
    liveness: bool = option(True, "Heartbeat pings that notice a dead or cut-off agent within seconds (off: only "
                            "failed calls and expired records do).")
    verify: bool = option(True, "The checks of members' work ([verify] enabled, p2ptrain.verify; off: to measure "
                          "what they cost).")
    verify_rate: float | None = None  # their ``[verify] rate`` (None: the default)
    # periodic warm copies of every stage (off: only the epochs' start copies)
    warm_copies: bool = option(True, "Copy every stage's state to another agent every few steps (off: only at "
                               "re-plans).")
    # also start ``p2ptrain monitor`` on this port (0: any free port); None: no
    monitor_port: int | None = option(None, "Also serve the run's live web page (p2ptrain monitor) on PORT (none "
                                      "given: any free port); its address is printed when it is up.", min=0, max=65535)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)  # TrainConfig.optimizer: unsaid keys, the preset's
    init_from: str | None = option_like(TrainConfig, "init_from", None)  # TrainConfig.init_from
    sync: SyncMode = option_like(TrainConfig, "sync", "every-step")  # TrainConfig.sync: every step, or DiLoCo rounds
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
        if self.link_partners is not None and self.link_partners < 2:
            raise ConfigError(f"--link-partners must be >= 2, got {self.link_partners}")

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
