"""The agent's configuration: one frozen dataclass tree, from a TOML file and flags (unknown keys refused).

Example (see ``agent/agent.example.toml`` for every key with comments)::

    run = "demo"
    initial_peers = ["/ip4/203.0.113.7/tcp/31337/p2p/QmBootstrap..."]

    [train]
    model = "tiny"
    stages = 2
    steps = 100

    [membership]
    expect = 4            # plan once 4 peers are live ...
    join_deadline_s = 600 # ... or 10 minutes after start with at least min_peers of them
    min_peers = 2

Sub-tables reuse the configs of the layers they configure: ``[train]`` is ``TrainConfig`` (its ``replicas``
is ignored: the plan decides it; its ``stages`` may be ``"auto"``: the leader chooses, ``leadership.run_stages``), ``[dht]`` is ``DHTConfig``, ``[transport]`` is ``TransportConfig``,
``[links.probe]`` is ``ProbeConfig``, ``[links.access]`` is ``AccessConfig``. Every timeout is a field ending in ``_s``.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Literal

from p2ptrain.config import option
from p2ptrain.errors import ConfigError
from p2ptrain.net.dht.keys import check_run_id
from p2ptrain.net.dht.node import DHTConfig
from p2ptrain.net.transport.access_probe import AccessConfig
from p2ptrain.net.transport.endpoint import TransportConfig
from p2ptrain.net.transport.probe import ProbeConfig
from p2ptrain.runtime.config import TrainConfig
from p2ptrain.verify.config import VerifyConfig

# communication_only: the paper's planner (its communication cost, every stage the same number of layers),
# scored by the run's objective: what a plan that ignores mixed devices' compute and memory would do
Strategy = Literal["scheduled", "megatron", "random", "communication_only"]
STRATEGIES: tuple[str, ...] = ("scheduled", "megatron", "random", "communication_only")
ObjectiveName = Literal["dtfm", "simulated"]
OBJECTIVE_NAMES: tuple[str, ...] = ("dtfm", "simulated")


@dataclass(frozen=True)
class MembershipConfig:
    """When the leader plans: the expected number of peers, or a join deadline with a minimum.

    Members beyond a multiple of the run's stages (or beyond what the global batch splits into) are spares:
    they stay in the run without a stage and leave when the trainers are done.
    """

    expect: int | None = option(None, "Plan once this many peers are live.", min=1)
    join_deadline_s: float | None = option(  # ... or this long after start, with at least min_peers live
        None, "... or this many seconds after start, with at least --min-peers live.", min=0, min_open=True)
    min_peers: int = option(1, "Fewest peers to plan with at the join deadline.", min=1)
    links_timeout_s: float = 120.0  # leader: wait this long for complete link rows, then plan with what it has
    # in a run of more than LINKS_ALL_UP_TO trainers the first plan may go once at most this share of its trainers'
    # partner links is unmeasured (estimated, as the links outside the probe graph): the last measurements of a
    # loaded or large run come slowest (``plan_maker.links_enough``). Off by default: 32 agents on two cores
    # planned beside the measurements still running, and the leader's search took minutes instead of 25 s
    links_missing: float = 0.0
    # give up if no plan for the live membership comes within this of the run's last move toward one: peers
    # joining or leaving, a plan read, a search of the first plan running (ours, the leader's, a pinged peer's)
    plan_timeout_s: float = 900.0
    poll_s: float = 1.0  # how often to read the run's records while waiting
    # in a run of n members beyond this, an agent other than the leader and the next in line reads the peer and
    # progress records every n / read_all_up_to polls (at most every dht.peer_ttl_s), and at once when a newer
    # plan appears: its read bytes a minute stay those of a run this size (``membership_reader``)
    read_all_up_to: int = 16
    finish_timeout_s: float = 60.0  # after the last step: wait this long for the other trainers to finish too
    # once this agent followed a plan: stop (with a one-line reason) if it trains nothing and no progress record
    # shows the run getting further for this long (a run that lost its peers, an agent nobody plans again)
    idle_timeout_s: float = 900.0
    # a leader gets this long from when a plan is due to publish one we accept (plus twice what our own search
    # of the first plan took, or plan.time_budget_s for a re-plan); then it is passed over (the next-lowest peer
    # leads) for leader_backoff_s, doubling with each repeat. A plan we refuse passes its leader over at once.
    leader_grace_s: float = 10.0
    leader_backoff_s: float = 300.0

    def __post_init__(self) -> None:
        if self.expect is None and self.join_deadline_s is None:
            raise ConfigError("membership: set expect (peers to wait for) or join_deadline_s (or both)")
        if self.expect is not None and self.expect < 1:
            raise ConfigError(f"membership.expect={self.expect} must be at least 1")
        if self.min_peers < 1:
            raise ConfigError(f"membership.min_peers={self.min_peers} must be at least 1")
        if not 0 <= self.links_missing < 1:
            raise ConfigError(f"membership.links_missing={self.links_missing} must be in [0, 1)")
        if self.read_all_up_to < 1:
            raise ConfigError(f"membership.read_all_up_to={self.read_all_up_to} must be at least 1")
        for name in ("links_timeout_s", "plan_timeout_s", "poll_s", "finish_timeout_s", "idle_timeout_s",
                     "leader_grace_s", "leader_backoff_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"membership.{name}={getattr(self, name)} must be positive")
        if self.join_deadline_s is not None and not self.join_deadline_s > 0:
            raise ConfigError(f"membership.join_deadline_s={self.join_deadline_s} must be positive")


@dataclass(frozen=True)
class PlanConfig:
    """How the leader assigns stages: the scheduler, or a baseline for comparison."""

    strategy: Strategy = option("scheduled", "The leader's strategy (baselines for comparison).")
    seed: int = 0  # the scheduler's and the random baseline's seed
    time_budget_s: float = 60.0  # the scheduler's search budget
    # what plans are scored by: the paper's communication cost, or the runtime's simulated step time (every
    # agent then calibrates its device on the run's model and publishes it in its peer record)
    objective: ObjectiveName = "dtfm"
    # followers check a leader's plan before following it: it must plan the members they see, and predict
    # at most (1 + verify_tolerance) times the step time of their own plan of the same records
    verify: bool = True
    verify_tolerance: float = 0.1
    # ... plus this much: where steps are short (loopback), link noise moves both plans' costs by more than
    # 10% and nobody gains from the difference
    verify_slack_s: float = 0.05
    # a follower's own plan stops after this many of the search's evaluations times devices (0: never; 20,000
    # evaluations at 64 devices, where the search has mostly converged, 5,000 at 256, 1,250 at 1,024): its check's
    # work is bounded at any size (an evaluation's grows with the devices), and followers of the same records make
    # the same one whatever their machines' speed
    verify_device_evaluations: int = 1_280_000
    # the members other than the leader that check each plan by a search of their own (``leadership.checkers``);
    # the others follow once every checker says it trains the plan, and check it themselves after
    # ``time_budget_s`` without that (0: every follower checks)
    checkers: int = 4

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ConfigError(f"plan.strategy={self.strategy!r} is not one of {', '.join(STRATEGIES)}")
        if self.objective not in OBJECTIVE_NAMES:
            raise ConfigError(f"plan.objective={self.objective!r} is not one of {', '.join(OBJECTIVE_NAMES)}")
        if self.seed < 0 or not self.time_budget_s > 0:
            raise ConfigError("plan.seed must be >= 0 and plan.time_budget_s positive")
        if self.checkers < 0:
            raise ConfigError(f"plan.checkers={self.checkers} must be >= 0 (0: every follower checks)")
        if self.verify_device_evaluations < 0:
            raise ConfigError(f"plan.verify_device_evaluations={self.verify_device_evaluations} must be >= 0 "
                              "(0: never stopped)")
        if not self.verify_tolerance >= 0 or not self.verify_slack_s >= 0:
            raise ConfigError(f"plan.verify_tolerance={self.verify_tolerance} and plan.verify_slack_s="
                              f"{self.verify_slack_s} must be >= 0")


@dataclass(frozen=True)
class LinksConfig:
    """The link prober: rounds over this agent's partners (``partners``, ``near_partners``: the probe graph of
    ``leadership.probe_set``), each link measured ``min_rounds`` times before it is published, smoothed (EWMA)
    across rounds."""

    probe: ProbeConfig = field(default_factory=ProbeConfig)
    min_rounds: int = 1
    ewma_weight: float = 0.3  # weight of a new measurement in the smoothed estimate
    round_pause_s: float = 2.0  # pause between rounds
    refresh_s: float = 120.0  # a link measured well enough is measured again after this long (probes cost bandwidth)
    settle_s: float = 2.0  # after first seeing a peer, wait this long before probing it (see links.py)
    connect_timeout_s: float = 10.0
    # whom to measure (``leadership.probe_set``, ``planning.estimated``): about ``partners`` peers of the run,
    # about ``near_partners`` of each place we share (our host, our region), and our neighbours in the plan; the
    # other links are estimated. A run of at most ``partners + 1`` peers measures every link.
    partners: int = 8
    near_partners: int = 8
    pause_wait_s: float = 3.0  # training waits at most this long for a measurement in progress (a dead peer's ends late)
    # this device's access link as its owner knows it (a home line's speed test), Mbit/s: published in the
    # peer record, so the leader plans with one uplink and one downlink shared by all its flows; None:
    # unknown (an emulated device publishes its network's own)
    uplink_mbps: float | None = None
    downlink_mbps: float | None = None
    # without a declared line (nor an emulated device's own), measure it and publish what the measurement
    # supports (``net.transport.access_probe``: several flows at once against each alone)
    measure_access: bool = True
    access: AccessConfig = field(default_factory=AccessConfig)

    def __post_init__(self) -> None:
        if self.min_rounds < 1 or not 0 < self.ewma_weight <= 1:
            raise ConfigError("links.min_rounds must be >= 1 and links.ewma_weight in (0, 1]")
        for name in ("uplink_mbps", "downlink_mbps"):
            value = getattr(self, name)
            if value is not None and not 0 < value < float("inf"):
                raise ConfigError(f"links.{name}={value} must be a positive number of Mbit/s")
        for name in ("round_pause_s", "settle_s", "refresh_s"):
            if getattr(self, name) < 0:
                raise ConfigError(f"links.{name} must be >= 0")
        if self.partners < 2 or self.near_partners < 0:
            raise ConfigError("links.partners must be >= 2 and links.near_partners >= 0")
        if not self.connect_timeout_s > 0 or self.pause_wait_s < 0:
            raise ConfigError("links.connect_timeout_s must be positive and links.pause_wait_s >= 0")


@dataclass(frozen=True)
class EmulationSettings:
    """Play device ``device_index`` of the network in ``cluster_file`` (the local swarm sets this).

    Outgoing links to a peer are shaped once that peer's record says which device it plays; measured
    values are converted back to the file's units before planning (α = α'/time_scale,
    β = β'·time_scale/size_factor), and the workload is this run's bytes over ``size_factor``.
    ``compute_scale`` > 1 plays every device that many times slower than the file says (this machine's
    core stands for the fastest device): with ``time_scale`` scaled alike it is the same world in slow
    motion, in which a swarm of more agents than this machine has cores computes as on cards of their own
    (``runtime.compute_speed``).
    """

    cluster_file: str | None = None
    device_index: int | None = None
    time_scale: float = 1.0
    size_factor: float = 1.0
    compute_scale: float = 1.0

    def __post_init__(self) -> None:
        if (self.cluster_file is None) != (self.device_index is None):
            raise ConfigError("emulation: cluster_file and device_index go together")
        if self.device_index is not None and self.device_index < 0:
            raise ConfigError(f"emulation.device_index={self.device_index} must be >= 0")
        for name in ("time_scale", "size_factor"):
            if not 0 < getattr(self, name) < float("inf"):
                raise ConfigError(f"emulation.{name}={getattr(self, name)} must be a positive number")
        if not 1 <= self.compute_scale < float("inf"):
            raise ConfigError(f"emulation.compute_scale={self.compute_scale} must be a number of at least 1")
        if self.compute_scale != 1 and self.cluster_file is None:
            raise ConfigError("emulation.compute_scale slows emulated devices: it needs emulation.cluster_file")

    @property
    def enabled(self) -> bool:
        return self.cluster_file is not None


@dataclass(frozen=True)
class ChurnConfig:
    """Re-planning when peers fail or join (``leadership/leader.py``, ``churn/replan.py``, ``churn/restart.py``).

    A trainer whose call fails, or whose plan peer stops answering heartbeats or reports a failure
    (``[liveness]``), halts and says so in its heartbeat; a peer whose peer record expires
    (``dht.peer_ttl_s``) or that stops answering the leader's heartbeats is gone. The leader
    then waits up to ``halt_timeout_s`` for every live trainer to halt (one that does not is left out of
    the next plan) and publishes the next epoch. Peers that join while training goes on get a role once
    ``join_min_new_peers`` of them wait, or once ``join_every_steps`` steps passed since the first did.

    Warm copies (``churn.warm_copies``): every plan names a backup peer per stage (spares first), which the
    stage's replica 0 sends the stage's state at the epoch's start and every ``backup_every`` steps; with
    "auto" the leader picks the interval so that one copy costs at most ``backup_budget`` of the steps
    between copies (at most ``backup_max_every``, and at most ``backup_first_every`` until a step time was
    measured: predictions miss per-step overheads; not where the network has access links, whose uplink a
    copy shares with the pipeline's own traffic); 0 turns periodic copies off.
    """

    halt_timeout_s: float = 30.0
    join_min_new_peers: int = 1
    join_every_steps: int | None = None
    keep_states: int = 2  # a trainer keeps its stage's state after its last this many steps
    backup_every: int | Literal["auto"] = "auto"
    backup_budget: float = 0.1
    backup_max_every: int = 50
    backup_first_every: int = 5
    # a failure's causes stay out of the plans this long, doubling per repeat (``churn.quarantine``)
    quarantine_s: float = 60.0
    quarantine_max_s: float = 3600.0
    # a member blamed by a halted trainer for the failure of this many epochs within blame_window_s is
    # quarantined too, though it halted (it took tensors and answered nothing); blamed once: only counted
    quarantine_blames: int = 2
    blame_window_s: float = 900.0

    def __post_init__(self) -> None:
        if self.quarantine_blames < 1 or not self.blame_window_s > 0:
            raise ConfigError(f"churn.quarantine_blames={self.quarantine_blames} must be at least 1 and "
                              f"churn.blame_window_s={self.blame_window_s} positive")
        if not 0 < self.quarantine_s <= self.quarantine_max_s:
            raise ConfigError(f"churn.quarantine_s={self.quarantine_s} must be positive and at most "
                              f"churn.quarantine_max_s={self.quarantine_max_s}")
        if not self.halt_timeout_s > 0:
            raise ConfigError(f"churn.halt_timeout_s={self.halt_timeout_s} must be positive")
        if self.backup_every != "auto" and (isinstance(self.backup_every, bool) or not isinstance(self.backup_every, int)
                                            or self.backup_every < 0):
            raise ConfigError(f"churn.backup_every={self.backup_every!r} must be \"auto\" or a whole number >= 0")
        if not 0 < self.backup_budget <= 1 or self.backup_max_every < 1 or self.backup_first_every < 1:
            raise ConfigError("churn.backup_budget must be in (0, 1], churn.backup_max_every and "
                              "churn.backup_first_every at least 1")
        if self.join_min_new_peers < 1 or (self.join_every_steps is not None and self.join_every_steps < 1):
            raise ConfigError("churn.join_min_new_peers and churn.join_every_steps must be at least 1")
        if self.keep_states < 2:
            raise ConfigError(f"churn.keep_states={self.keep_states} must be at least 2")


@dataclass(frozen=True)
class ClaimsConfig:
    """A device's claims checked (``leadership.claims``): its tflops at most ``peak_over_calibrated`` times the
    FLOP/s its own calibration of the run's model shows (small models reach a few per cent of a card's
    peak); once it trains, a peer whose compute per step (the median over at least ``min_steps`` steps of
    an epoch) is more than ``speed_tolerance`` times what its calibration predicts is planned at the speed
    it showed (a world-wide run is noisy: shared cards, throttled laptops; a few times slower is honest)."""

    peak_over_calibrated: float = 100.0
    speed_tolerance: float = 4.0
    min_steps: int = 3

    def __post_init__(self) -> None:
        if not self.peak_over_calibrated >= 1 or not self.speed_tolerance >= 1 or self.min_steps < 1:
            raise ConfigError(f"claims.peak_over_calibrated={self.peak_over_calibrated} and claims.speed_tolerance="
                              f"{self.speed_tolerance} must be at least 1, claims.min_steps={self.min_steps} too")


@dataclass(frozen=True)
class LivenessConfig:
    """Heartbeats separate from data (``churn.liveness``): every ``interval_s`` an agent pings the peers it
    watches (every member up to ``watch_all_up_to`` members; beyond, its pipeline neighbours, O(log) of its
    replica group, the leader and the next in line: ``membership_reader``), each ping under ``ping_timeout_s``. A peer that has not answered for ``timeout_s`` is dead:
    the epoch it trains in halts at once, and it leaves this agent's view of the live peers until it
    answers again. Tensor calls then need no short deadline: theirs is ``deadline_multiple`` × the plan's
    predicted step time, and at least ``transport.call_timeout_s``."""

    enabled: bool = True
    interval_s: float = 1.0
    ping_timeout_s: float = 2.0
    timeout_s: float = 6.0
    watch_all_up_to: int = 32
    deadline_multiple: float = 4.0

    def __post_init__(self) -> None:
        for name in ("interval_s", "ping_timeout_s", "timeout_s", "deadline_multiple"):
            if not 0 < getattr(self, name) < float("inf"):
                raise ConfigError(f"liveness.{name}={getattr(self, name)} must be a positive number")
        if self.timeout_s < 2 * self.interval_s:
            raise ConfigError(f"liveness.timeout_s={self.timeout_s} must be at least two pings "
                              f"(2 × interval_s = {2 * self.interval_s})")
        if self.watch_all_up_to < 1:
            raise ConfigError("liveness.watch_all_up_to must be at least 1")


@dataclass(frozen=True)
class CheckpointConfig:
    """Every agent keeps its own copies (``local_dir``; default ``<cache>/p2ptrain/state/<run>/<peer ID>``;
    "" for none): its stage's state at every warm-copy step and the warm copies it keeps for others
    (``churn.state_store``). With ``resume`` the first plan starts from the newest step every stage has a
    copy of on some live agent's disk (no shared directory needed).

    Optionally also a shared directory (``dir``, every agent must see the same one): every ``every_steps``
    steps, replica 0 of each stage saves the stage's state there (``runtime.checkpoint``); ``resume`` and
    re-plans that lost a stage then also consider its complete checkpoints."""

    dir: str | None = None
    every_steps: int = 0  # 0: never save
    resume: bool = False
    local_dir: str | None = None

    def __post_init__(self) -> None:
        if self.every_steps < 0:
            raise ConfigError(f"checkpoint.every_steps={self.every_steps} must be >= 0")
        if self.every_steps and not self.dir:
            raise ConfigError("checkpoint.dir is required to save checkpoints (every_steps)")
        if self.local_dir:
            object.__setattr__(self, "local_dir", os.path.expanduser(self.local_dir))
        if self.dir:
            object.__setattr__(self, "dir", os.path.expanduser(self.dir))


@dataclass(frozen=True)
class ProfileConfig:
    cache_dir: str | None = None  # None: $XDG_CACHE_HOME/p2ptrain or ~/.cache/p2ptrain
    refresh: bool = False  # measure again even if the cache has this device
    measure_s: float = 0.5  # how long the matmul benchmark runs


@dataclass(frozen=True)
class AgentConfig:
    run: str = option("demo", "Run name shared by every agent of the run.")
    initial_peers: tuple[str, ...] = option((), "The bootstrap's address line (full multiaddrs with /p2p/).")
    # free text shown in plans (e.g. "Frankfurt"); an emulated device's region wins
    region: str = option("", "Where this device is (free text shown in plans).")
    # append one JSON line per event (the local swarm reads it)
    events_file: str | None = option(None, "Append one JSON line per event here.", path="file")
    train: TrainConfig = field(default_factory=TrainConfig)
    membership: MembershipConfig = field(default_factory=lambda: MembershipConfig(expect=1))
    plan: PlanConfig = field(default_factory=PlanConfig)
    links: LinksConfig = field(default_factory=LinksConfig)
    dht: DHTConfig = field(default_factory=DHTConfig)
    transport: TransportConfig = field(default_factory=TransportConfig)
    emulation: EmulationSettings = field(default_factory=EmulationSettings)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    churn: ChurnConfig = field(default_factory=ChurnConfig)
    liveness: LivenessConfig = field(default_factory=LivenessConfig)
    claims: ClaimsConfig = field(default_factory=ClaimsConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    verify: VerifyConfig = field(default_factory=VerifyConfig)  # a run setting: checks of the members' work

    def __post_init__(self) -> None:
        try:
            check_run_id(self.run)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if not self.initial_peers:
            raise ConfigError("initial_peers is empty: give the bootstrap's address line (--initial-peers)")
        if self.train.diloco_on and self.transport.step_window < self.train.diloco.step_window:
            # pipelines of a DiLoCo round drift apart by up to H - 1 steps before its end joins them (2H overlapped)
            object.__setattr__(self, "transport",
                               dataclasses.replace(self.transport, step_window=self.train.diloco.step_window))
        if self.dht.initial_peers and self.dht.initial_peers != self.initial_peers:
            raise ConfigError("set initial_peers at the top level, not in [dht]")
        identity_path = os.path.expanduser(self.dht.identity_path) if self.dht.identity_path else None
        object.__setattr__(self, "dht", dataclasses.replace(self.dht, initial_peers=tuple(self.initial_peers),
                                                            identity_path=identity_path))
        if self.events_file:
            object.__setattr__(self, "events_file", os.path.expanduser(self.events_file))
        expect, fewest = self.membership.expect, self.train.stage_bounds[0]
        if expect is not None and expect < fewest:
            key = "train.min_stages" if self.train.stages_auto else "train.stages"
            raise ConfigError(f"membership.expect={expect} is fewer peers than {key}={fewest}: "
                              "set --expect (membership.expect) to the number of agents of the run")
