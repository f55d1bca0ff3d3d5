"""What the leader does with the run's records: a cluster, a plan, a plan record. Pure (no I/O).

1. ``trainers_and_spares``: how many replicas the live membership gives (``members // stages``, fewer if
   the global batch does not split over them), and which peers train: the first ``stages × replicas`` in
   cluster order; the others are spares. ``stages`` is the run's S (``run_stages``: the config's, or the
   one the leader chose with ``stages = "auto"``).
2. ``build_cluster``: devices from the peer records (region, TFLOP/s, memory), α and β from the links rows.
   Each row holds its writer's measurements of its outgoing links; a pair's α is the mean of the two
   directions and its β their harmonic mean (transfer times average, not rates). A row is its writer's
   claim: where the two ends' figures are more than ``LINK_DISAGREEMENT`` (10x) apart the worse one counts
   (logged), and a link only one end measured is never better than the best link both ends measured.
   A pair nobody measured (each peer measures its partners in the probe graph, ``probe_set``) is estimated
   from the measured ones (``planning.estimated``: the median of the measured links between the two ends'
   groups of devices alike, groups found from the links both ends measured; logged), and the cluster
   carries those groups for the search (``Cluster.groups``). When
   emulating, measured values become the emulated network's own units: α = α'/time_scale,
   β = β'·time_scale/size_factor, so the plan's cost compares with one computed from the true matrices.
3. ``run_workload``: c_PP and c_DP of this run (fp32 activations and gradients of the configured model and
   batch), divided by the emulation's size factor.
4. ``make_plan``: the scheduler, or a baseline (Megatron's rank order in cluster order; a random
   assignment), as the plan document of docs/design.md, scored by ``PlanConfig.objective`` (for "simulated" the
   workload carries the members' calibrated step profile, ``runtime.calibration``). Slow for big clusters:
   the agent runs it in a thread.

5. ``warm_copies``: per stage the peer keeping a warm copy of its state and the interval of the copies
   (``churn.warm_copies``), from the measured links of every member (spares too) and the step time.

Cluster order: by the device each peer plays when every member emulates one (so Megatron's order is the
emulated network's device order), otherwise by peer ID.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import numpy as np

from p2ptrain.agent.churn.warm_copies import copy_part_numel
from p2ptrain.agent.config import ChurnConfig, EmulationSettings, PlanConfig
from p2ptrain.agent.leadership import searches
from p2ptrain.net.dht.records import LinkMeasurement, LinksRecord, PeerRecord
from p2ptrain.planning import (
    Cluster,
    Device,
    Plan,
    SearchStats,
    Workload,
    make_objective,
    megatron_assignment,
    parameter_count,
    random_assignment,
    random_cost,
    schedule,
    workload_from_model,
)
from p2ptrain.planning.estimated import estimate_links, twin_groups
from p2ptrain.planning.joint import LayeredWorkload
from p2ptrain.planning.plan import Infeasible
from p2ptrain.planning.search import DEFAULT_SEARCH, SearchConfig
from p2ptrain.planning.split import even_layers
from p2ptrain.runtime.calibration import with_measured_speeds
from p2ptrain.runtime.config import TrainConfig

logger = logging.getLogger(__name__)

FP32_BYTES = 4


def cluster_order(peers: Mapping[str, PeerRecord]) -> list[str]:
    """Peers in the cluster's device order (see the module docstring)."""
    if peers and all(r.emulated_device is not None for r in peers.values()):
        return sorted(peers, key=lambda p: (peers[p].emulated_device, p))
    return sorted(peers)


def replicas_for(num_members: int, train: TrainConfig, num_stages: int | None = None) -> int:
    """The most replicas (≤ members // stages) over which the global batch splits; 0 if none. ``num_stages``:
    the run's S (``run_stages``), default ``train.stages``."""
    stages = train.stages if num_stages is None else num_stages
    assert isinstance(stages, int), 'stages = "auto": the run\'s S comes from ``run_stages``'
    for replicas in range(num_members // stages, 0, -1):
        if train.global_batch_size % (replicas * train.micro_batches) == 0:
            return replicas
    return 0


def trainers_and_spares(order: Sequence[str], train: TrainConfig,
                        num_stages: int | None = None) -> tuple[list[str], list[str]]:
    stages = train.stages if num_stages is None else num_stages
    replicas = replicas_for(len(order), train, stages)
    if replicas == 0:
        raise ValueError(
            f"{len(order)} peers cannot train {stages} stages of a global batch of "
            f"{train.global_batch_size} in {train.micro_batches} micro-batches"
        )
    used = replicas * stages
    return list(order[:used]), list(order[used:])


def link_gaps(members: Sequence[str], rows: Mapping[str, LinksRecord],
              partners: Mapping[str, Collection[str]] | None = None) -> list[tuple[str, str]]:
    """Directed pairs (a, b) whose link a's row does not cover yet: of every pair, or, with ``partners`` (the
    probe graph, ``probe_set.graph``), of the pairs a measures."""
    gaps = []
    for a in members:
        covered = rows[a].resolve(members) if a in rows else {}
        wanted = partners.get(a, ()) if partners is not None else members
        gaps.extend((a, b) for b in members if b != a and b in wanted and b not in covered)
    return gaps


LINKS_ALL_UP_TO = 16  # a first plan of at most this many trainers waits for every partner link (``links_enough``)


def links_enough(gaps: Collection[tuple[str, str]], trainers: Sequence[str],
                 partners: Mapping[str, Collection[str]], missing: float) -> bool:
    """Whether the first plan may go with ``gaps`` (``link_gaps``) unmeasured: none, or in a run of more than
    ``LINKS_ALL_UP_TO`` trainers at most ``missing`` (``membership.links_missing``) of the directed partner links
    among the trainers. Leader and followers judge alike (``watching``: when the plan is due)."""
    if not gaps:
        return True
    if len(trainers) <= LINKS_ALL_UP_TO:
        return False
    members = set(trainers)
    wanted = sum(1 for a in trainers for b in partners.get(a, ()) if b in members and b != a)
    return len(gaps) <= missing * wanted


def unmeasured_links(members: Sequence[str], rows: Mapping[str, LinksRecord],
                     partners: Mapping[str, Collection[str]] | None = None) -> list[tuple[str, str]]:
    """Pairs (a < b) of the probe graph (``partners``; None: every pair) that neither end's row covers yet:
    what a plan waits for (one end's figure is enough to plan with; the other's checks it when it comes)."""
    directed = set(link_gaps(members, rows, partners))
    return sorted((a, b) for a, b in directed if a < b and (b, a) in directed)


def _paths_behind_lines(bandwidth: np.ndarray, uplink: Sequence[float | None] | None,
                        downlink: Sequence[float | None] | None) -> None:
    """Where both ends of a pair published their lines, the path between them is taken as no slower than
    the slower line (in place). Probes cross the same shared lines as every other flow of both homes: eight
    emulated homes probing each other at once measured their 0.1 Gbit/s paths at 0.05, and the planner, which
    then also charged the lines, predicted 20.4 s for a step of 15.3 s. A path genuinely slower than both
    homes' lines is not told apart from that (consumer lines are the bottleneck nearly always)."""
    n = len(bandwidth)
    for i in range(n):
        for j in range(n):
            up = uplink[i] if uplink is not None else None
            down = downlink[j] if downlink is not None else None
            if i != j and up is not None and down is not None:
                bandwidth[i, j] = max(bandwidth[i, j], min(up, down))


def build_cluster(
    order: Sequence[str],
    peers: Mapping[str, PeerRecord],
    rows: Mapping[str, LinksRecord],
    emulation: EmulationSettings,
) -> Cluster:
    """The cluster of ``order``'s peers (device i = ``order[i]``), in the (emulated) network's units."""
    n = len(order)
    measured_by = {a: (rows[a].resolve(order) if a in rows else {}) for a in order}
    latency, bandwidth = np.zeros((n, n)), np.zeros((n, n))
    unknown, one_sided, disputed = [], [], []
    for i, a in enumerate(order):
        for j, b in enumerate(order):
            if i < j:
                both = [m for m in (measured_by[a].get(b), measured_by[b].get(a)) if m is not None]
                if len(both) == 2 and _disagree(*both):
                    disputed.append((a, b))  # a row's claim is checked by the other end's measurement
                    latency[i, j] = latency[j, i] = max(m.latency_ms for m in both)
                    bandwidth[i, j] = bandwidth[j, i] = min(m.bandwidth_gbps for m in both)
                elif both:
                    latency[i, j] = latency[j, i] = _mean_latency(both)
                    bandwidth[i, j] = bandwidth[j, i] = _mean_bandwidth(both)
                    if len(both) == 1:
                        one_sided.append((i, j))
                else:
                    unknown.append((i, j))
    off = ~np.eye(n, dtype=bool)
    if disputed:
        logger.warning("%d link(s) measured very differently by their two ends (more than %gx apart), planned with "
                       "the worse figure: %s", len(disputed), LINK_DISAGREEMENT,
                       ", ".join(f"{a}-{b}" for a, b in disputed[:4]))
    checked = off.copy()
    for i, j in unknown + one_sided:
        checked[i, j] = checked[j, i] = False
    if one_sided and checked.any():
        # a link only one end measured is never better than the best link both ends agreed on
        for i, j in one_sided:
            latency[i, j] = latency[j, i] = max(latency[i, j], float(latency[checked].min()))
            bandwidth[i, j] = bandwidth[j, i] = min(bandwidth[i, j], float(bandwidth[checked].max()))
    groups = estimated = None
    if unknown:  # the links nobody measured: estimated from the measured ones (``planning.estimated``)
        measured = off.copy()
        for i, j in unknown:
            measured[i, j] = measured[j, i] = False
        estimate = estimate_links(latency, bandwidth, measured, groups=_twin_groups(order, measured_by))
        latency, bandwidth, groups = estimate.latency_ms, estimate.bandwidth_gbps, estimate.groups
        estimated = off & ~measured
        logger.info("%d of %d links estimated from the %d measured (%d groups of devices alike)", len(unknown),
                    n * (n - 1) // 2, n * (n - 1) // 2 - len(unknown), int(groups.max()) + 1 if groups is not None else 0)
    if emulation.enabled:
        latency[off] /= emulation.time_scale
        bandwidth[off] *= emulation.time_scale / emulation.size_factor
    devices = tuple(
        Device(name=p, region=peers[p].region or None, tflops=peers[p].tflops, memory_gb=peers[p].memory_gb)
        for p in order
    )
    access = {}  # the homes' uplinks and downlinks the peers published (``PeerRecord``), in the network's units
    for name in ("uplink_gbps", "downlink_gbps"):
        values = [getattr(peers[p], name) for p in order]
        if any(v is not None for v in values):
            scale = emulation.time_scale / emulation.size_factor if emulation.enabled else 1.0
            access[name] = [v * scale if v is not None else None for v in values]
    if access:
        _paths_behind_lines(bandwidth, access.get("uplink_gbps"), access.get("downlink_gbps"))
    # mixed devices: every trainer's own calibration is its speed (``runtime.calibration``), when all have one
    cluster = Cluster(devices, latency, bandwidth, groups=groups, estimated=estimated, **access)
    return with_measured_speeds(cluster, [peers[p].compute for p in order])


def _twin_groups(order: Sequence[str], measured_by: Mapping[str, Mapping[str, LinkMeasurement]]) -> np.ndarray:
    """The groups of devices alike (``estimated.twin_groups``) from the links both ends measured, each at the
    worse of its two figures: a row's own claims never make a peer look alike to an honest one."""
    n = len(order)
    latency, bandwidth, both = np.zeros((n, n)), np.zeros((n, n)), np.zeros((n, n), dtype=bool)
    for i, a in enumerate(order):
        for j, b in enumerate(order):
            ab, ba = measured_by[a].get(b), measured_by[b].get(a)
            if i != j and ab is not None and ba is not None:
                both[i, j] = True
                latency[i, j] = max(ab.latency_ms, ba.latency_ms)
                bandwidth[i, j] = min(ab.bandwidth_gbps, ba.bandwidth_gbps)
    return twin_groups(latency, bandwidth, both)


LINK_DISAGREEMENT = 10.0  # beyond this ratio of the two ends' figures a link is disputed: the worse counts


def _disagree(a: LinkMeasurement, b: LinkMeasurement) -> bool:
    """Whether two ends' measurements of one link are too far apart to be the same link's two directions
    (home uplinks are often several times slower than a data centre's: that much is honest asymmetry)."""
    ratio = max(a.bandwidth_gbps, b.bandwidth_gbps) / min(a.bandwidth_gbps, b.bandwidth_gbps)
    slow, fast = max(a.latency_ms, b.latency_ms), min(a.latency_ms, b.latency_ms)
    return ratio > LINK_DISAGREEMENT or slow > LINK_DISAGREEMENT * fast + 10.0


def _mean_latency(measurements: list[LinkMeasurement]) -> float:
    return sum(m.latency_ms for m in measurements) / len(measurements)


def _mean_bandwidth(measurements: list[LinkMeasurement]) -> float:
    return len(measurements) / sum(1.0 / m.bandwidth_gbps for m in measurements)


def run_workload(train: TrainConfig, num_stages: int, num_replicas: int, size_factor: float = 1.0) -> Workload:
    """This run's c_PP and c_DP in GB (fp32 activations and gradients), over the emulation's size factor."""
    shape = train.shape
    own = workload_from_model(
        shape, num_stages=num_stages, num_replicas=num_replicas,
        batch_tokens=train.global_batch_size * shape.seq_len,
        activation_bytes=FP32_BYTES, gradient_bytes=FP32_BYTES,
    )
    source = f"{train.model}, batch {train.global_batch_size}"
    if size_factor != 1.0:
        source += f", over size factor {size_factor:.4g}"
    return Workload(own.activation_gb / size_factor, own.gradient_gb / size_factor, source=source)


def check_search(config: PlanConfig, num_devices: int) -> SearchConfig:
    """The search a follower makes to check a leader's plan of ``num_devices`` (and to time it, ``watching``): the
    leader's, stopped after ``PlanConfig.verify_device_evaluations`` / ``num_devices`` evaluations (0: never), so
    that every follower of the same records makes the same one whatever its machine's speed, in about the same
    work at any size (an evaluation's work grows with the devices; ``make_plan`` with ``check=True`` also leaves
    out the random baseline, which nothing checks)."""
    if not config.verify_device_evaluations:
        return DEFAULT_SEARCH
    cap = max(1, config.verify_device_evaluations // max(1, num_devices))
    return dataclasses.replace(DEFAULT_SEARCH, max_evaluations=min(DEFAULT_SEARCH.max_evaluations, cap))


def stopped_short(search: Mapping[str, Any], config: PlanConfig, num_devices: int) -> bool:
    """Whether a check's search (a plan's ``search``) reached ``check_search``'s cap, where the leader's goes on (the
    exact solver is never stopped)."""
    cap = check_search(config, num_devices).max_evaluations
    return (bool(config.verify_device_evaluations) and search.get("method") != "exhaustive"
            and int(search.get("evaluations") or 0) >= cap)


def make_plan(cluster: Cluster, workload: Workload, num_stages: int, config: PlanConfig,
              check: bool = False) -> dict[str, Any]:
    """The plan document (docs/design.md "Plan file") of ``PlanConfig.strategy`` over ``cluster``; ValueError if
    none. ``check``: a follower's own plan, to check or time the leader's (``check_search``). A scheduled plan of
    inputs this process searched lately is that search's; a follower's runs in the check thread, at a lower
    priority than the rest of its agent (``searches``).

    A scheduled plan is never worse than the follower's check of it finds: the check's search is bounded by
    evaluations, not time, so that every follower of the same records finds the same plan on any machine under
    any load; the leader makes that very search first, without the time budget, and then, where it stopped at the
    check's cap (large runs), the full search in what is left of ``plan.time_budget_s``, and keeps the cheaper.
    A leader stopped by its time budget before the check's search ends was refused by followers whose check went
    further (a 32-agent swarm on two cores: 48.2 s a step against their 42.8 s)."""
    n = cluster.num_devices
    if config.strategy == "scheduled":
        if check:
            return searches.searched_plan(cluster, workload, num_stages, config, check_search(config, n), None, check=True)
        started = time.perf_counter()
        plan = searches.searched_plan(cluster, workload, num_stages, config, check_search(config, n), None)
        left_s = config.time_budget_s - (time.perf_counter() - started)
        if stopped_short(plan["search"], config, n) and left_s > 0:
            full = searches.searched_plan(cluster, workload, num_stages, config, DEFAULT_SEARCH, left_s)
            first = plan["search"]
            if full["cost_s"] < plan["cost_s"]:
                plan = full
            plan["search"] = {**plan["search"], "evaluations": first["evaluations"] + full["search"]["evaluations"],
                              "seconds": time.perf_counter() - started}
        return plan
    if n % num_stages:
        raise ValueError(f"{n} devices cannot be split into {num_stages} stages")
    if isinstance(workload, LayeredWorkload):  # a baseline keeps the even split
        workload = workload.at(even_layers(workload.costs.num_layers, num_stages))
    objective = make_objective(config.objective, cluster, workload, num_stages)
    rng = np.random.default_rng(config.seed)
    if config.strategy == "megatron":
        sigma = megatron_assignment(n, num_stages)
    elif config.strategy == "communication_only":  # the paper's planner: links only, even split
        paper = schedule(cluster, Workload(workload.activation_gb, workload.gradient_gb), num_stages, seed=config.seed,
                         objective="dtfm", time_budget_s=config.time_budget_s, clock=time.perf_counter)
        if isinstance(paper, Infeasible):
            raise ValueError(f"no plan: {paper.reason}")
        sigma = np.array(paper.pipelines)
    else:
        sigma = random_assignment(n, num_stages, rng)
    megatron = objective.evaluate(megatron_assignment(n, num_stages))
    plan = Plan(
        pipelines=tuple(tuple(int(d) for d in row) for row in sigma),
        objective=objective.name,
        cost=objective.evaluate(sigma),
        baselines={"megatron": megatron, "random": random_cost(objective, n, rng)},
        search=SearchStats(seed=config.seed, evaluations=1, method=config.strategy, stopped_by="converged"),
    )
    return plan.to_json()


def with_company(plan: dict[str, Any], cluster: Cluster, workload: Workload, probation: Collection[int],
                 config: PlanConfig) -> dict[str, Any]:
    """``plan`` with no stage trained by peers on probation alone (``probation``: indices into ``cluster``'s
    devices, peers that have shown no work yet, ``leadership.standing``): for each such stage, the cheapest swap
    (by ``PlanConfig.objective``) of one of its peers with a proven peer of another stage that keeps a proven peer
    of its own. Verification compares a stage's replicas (``p2ptrain.verify``): a stage whose replicas are all
    fresh keys may be one person's, who checks itself. A stage that no swap can cover (too few proven peers)
    stays as it is, logged. The plan's ``probation`` lists the devices on probation; ``cost_s`` is the
    objective's for the pipelines returned."""
    pipelines = [list(row) for row in plan["pipelines"]]
    if not probation or not pipelines:
        return plan
    fresh = set(probation)
    replicas, stages = len(pipelines), len(pipelines[0])

    def proven_in(j: int) -> int:
        return sum(pipelines[i][j] not in fresh for i in range(replicas))

    alone = [j for j in range(stages) if proven_in(j) == 0]
    if not alone:
        return {**plan, "probation": sorted(fresh)}
    if isinstance(workload, LayeredWorkload):
        workload = workload.at([tuple(r) for r in plan["layers"]] if plan.get("layers")
                               else even_layers(workload.costs.num_layers, stages))
    objective = make_objective(config.objective, cluster, workload, stages)
    cost = None
    for j in alone:
        best = None
        for i in range(replicas):
            for i2 in range(replicas):
                for j2 in range(stages):
                    if j2 == j or pipelines[i2][j2] in fresh or proven_in(j2) < 2:
                        continue
                    trial = [row[:] for row in pipelines]
                    trial[i][j], trial[i2][j2] = trial[i2][j2], trial[i][j]
                    value = objective.evaluate(np.array(trial))
                    if math.isfinite(value.cost_s) and (best is None or value.cost_s < best[0].cost_s):
                        best = (value, trial)
        if best is None:
            logger.warning("stage %d is trained by peers on probation only (%s): too few proven peers to pair "
                           "them with", j, ", ".join(str(pipelines[i][j]) for i in range(replicas)))
            continue
        cost, pipelines = best
    if cost is None:
        return {**plan, "probation": sorted(fresh)}
    return {**plan, "pipelines": pipelines, "cost_s": float(cost.cost_s), "data_parallel_s": float(cost.data_parallel_s),
            "pipeline_s": float(cost.pipeline_s), "probation": sorted(fresh)}


def meetings(pipelines: Sequence[Sequence[int]], pairs: Collection[tuple[int, int]]) -> int:
    """How many of ``pairs`` (device indices) exchange messages under ``pipelines``: pipeline neighbours (the
    activations and their gradients), or replicas of one stage (its all-reduce and its checks)."""
    where = {d: (i, j) for i, row in enumerate(pipelines) for j, d in enumerate(row)}
    count = 0
    for a, b in pairs:
        if a in where and b in where:
            (i, j), (i2, j2) = where[a], where[b]
            count += (i == i2 and abs(j - j2) == 1) or (j == j2 and i != i2)
    return count


def kept_apart(plan: dict[str, Any], cluster: Cluster, workload: Workload, pairs: Collection[tuple[int, int]],
               config: PlanConfig, probation: Collection[int] = ()) -> dict[str, Any]:
    """``plan`` with no pair of ``pairs`` (device indices: members that refused each other without evidence,
    ``churn.quarantine``) exchanging a message (``meetings``), where swaps of two devices can get there: one
    swap at a time, each the cheapest (by ``PlanConfig.objective``) of those that leave the fewest pairs meeting,
    while the count falls, and none that leaves a stage to devices on ``probation`` alone (``with_company``,
    applied before). A pair no swap separates (too few devices) stays, logged. ``cost_s`` is the objective's
    for the pipelines returned.

    Then, as far as it costs no pair of ``pairs`` a meeting, no two *disputants* (members of any pair) meet
    either: each rogue meets a peer no dispute touched yet. Two colluders that each disputed with one honest
    peer would otherwise be handed each other's honest counterpart, and the next epoch's disputes give each
    honest peer two counterparts, as many as each rogue has (the campaign's ``clean_commit`` at two colluding
    members found it)."""
    pipelines = [list(row) for row in plan["pipelines"]]
    disputants = sorted({d for pair in pairs for d in pair})
    explicit = {tuple(sorted(pair)) for pair in pairs}
    near = [(a, b) for n, a in enumerate(disputants) for b in disputants[n + 1:] if (a, b) not in explicit]

    def score(rows: list[list[int]]) -> tuple[int, int]:
        return meetings(rows, pairs), meetings(rows, near)

    meeting = score(pipelines)
    if meeting == (0, 0):
        return plan
    replicas, stages = len(pipelines), len(pipelines[0])
    if isinstance(workload, LayeredWorkload):
        workload = workload.at([tuple(r) for r in plan["layers"]] if plan.get("layers")
                               else even_layers(workload.costs.num_layers, stages))
    objective = make_objective(config.objective, cluster, workload, stages)
    cost = None
    cells = [(i, j) for i in range(replicas) for j in range(stages)]
    fresh = set(probation)

    def alone(rows: list[list[int]]) -> int:  # stages trained by devices on probation only
        return sum(all(rows[i][j] in fresh for i in range(replicas)) for j in range(stages)) if fresh else 0

    while meeting > (0, 0):
        best = None
        for n, (i, j) in enumerate(cells):
            for i2, j2 in cells[n + 1:]:
                trial = [row[:] for row in pipelines]
                trial[i][j], trial[i2][j2] = trial[i2][j2], trial[i][j]
                left = score(trial)
                if left >= meeting or (best is not None and left > best[0]) or alone(trial) > alone(pipelines):
                    continue
                value = objective.evaluate(np.array(trial))
                if math.isfinite(value.cost_s) and (best is None or (left, value.cost_s) < (best[0], best[1].cost_s)):
                    best = (left, value, trial)
        if best is None:
            break
        meeting, cost, pipelines = best
    if meeting[0]:
        logger.warning("%d pair(s) of members that refused each other still meet in this plan: too few devices to "
                       "place them apart", meeting[0])
    if cost is None:
        return plan
    return {**plan, "pipelines": pipelines, "cost_s": float(cost.cost_s), "data_parallel_s": float(cost.data_parallel_s),
            "pipeline_s": float(cost.pipeline_s)}


def check_plan_json(plan: Mapping[str, Any], num_devices: int) -> None:
    """An assertion that the planner's document is a full assignment of ``num_devices`` devices."""
    flat = sorted(d for row in plan["pipelines"] for d in row)
    assert flat == list(range(num_devices)), f"plan does not assign every device once: {plan['pipelines']}"
    assert math.isfinite(plan["cost_s"])


TRAINER_COPY_WEIGHT = 2.0  # a trainer's link also carries training traffic


def choose_backups(groups: Sequence[Sequence[int]], candidates: Sequence[int], spares: Sequence[int],
                   copy_s: np.ndarray, busy: Sequence[Collection[int]] = ()) -> list[int | None]:
    """Per stage j, the device keeping its copy: not in ``groups[j]`` (the stage's devices, replica 0
    first); spares before trainers at equal cost; ``copy_s[a, b]`` the time of one copy from a to b. None
    when no device is outside the stage's group. ``busy[j]``: the devices to which replica 0's link carries
    its training messages (its pipeline neighbours), taken only where nobody else can keep the copy: a copy
    there queues with the activations, and each part of it delays the step (on the emulated world-wide
    network a copy to the neighbour that sends the stage its gradients made every int8 step 10 % longer)."""
    spare_set = set(spares)
    share = math.ceil(len(groups) / max(1, len(candidates)))
    load = dict.fromkeys(candidates, 0)
    chosen: list[int | None] = []
    for group in groups:
        source = group[0]
        avoid = set(busy[len(chosen)]) if busy else set()
        options = [c for c in candidates if c not in group and c not in avoid and load[c] < share]
        if not options:
            options = [c for c in candidates if c not in group and c not in avoid]
        if not options:
            options = [c for c in candidates if c not in group]
        if not options:
            chosen.append(None)
            continue
        weight = {c: 1.0 if c in spare_set else TRAINER_COPY_WEIGHT for c in options}
        best = min(options, key=lambda c: (weight[c] * copy_s[source, c], c not in spare_set, load[c], c))
        load[best] += 1
        chosen.append(best)
    return chosen


def backup_interval(copy_s: float, step_s: float, budget: float, max_every: int) -> int:
    """Steps between copies so that one copy takes at most ``budget`` of that many steps' time."""
    if copy_s <= 0:
        return 1
    if step_s <= 0:
        return max_every
    return max(1, min(max_every, math.ceil(copy_s / (budget * step_s))))


STATE_TENSORS_PER_PARAMETER = 3  # the parameter and AdamW's two moments


def compute_estimate_s(train: TrainConfig, num_stages: int, num_replicas: int, tflops: float) -> float:
    """A stage's forward and backward time per step (6 FLOPs per parameter and token) at ``tflops``."""
    tokens = train.global_batch_size * train.shape.seq_len / num_replicas
    return 6 * parameter_count(train.shape) / num_stages * tokens / (tflops * 1e12)


def stage_state_bytes(train: TrainConfig, num_stages: int) -> float:
    """The bytes of one stage's training state (fp32 parameters and AdamW moments, with DiLoCo the outer
    momentum; an even split)."""
    tensors = STATE_TENSORS_PER_PARAMETER + (1 if train.diloco_on else 0)  # DiLoCo: the outer momentum too
    return tensors * FP32_BYTES * parameter_count(train.shape) / num_stages


def warm_copies(plan: Mapping[str, Any], devices: Sequence[str], spares: Sequence[str], cluster: Cluster,
                state_bytes: float, step_s: float, churn: ChurnConfig,
                emulation: EmulationSettings, train_rounds: int = 1) -> dict[str, Any]:
    """Who keeps each stage's warm copy and how often (``churn.warm_copies``), for ``plan`` over ``devices``.

    ``cluster`` holds every member, trainers (``devices``, in the plan's device order) first, then
    ``spares``; ``step_s`` is the step time in seconds (measured, or predicted); ``train_rounds``: DiLoCo's
    steps per round (copies at rounds' ends: the interval rounded up to whole rounds). Returns the peers
    (None: nobody), ``every_steps``, the slowest copy's seconds and its cost per step."""
    scale = emulation.time_scale if emulation.enabled else 1.0
    size_factor = emulation.size_factor if emulation.enabled else 1.0
    n = cluster.num_devices
    # this run's links, in its own units: bytes per second and one-way seconds
    bandwidth_bytes = np.where(np.eye(n, dtype=bool), np.inf, cluster.bandwidth_gbps * 1e9 / 8 * size_factor / scale)
    latency_s = cluster.latency_ms / 1e3 * scale
    # a copy goes in parts, one at a time (``backup.copy_part_numel``): each part's round trip adds up
    part_bytes = np.vectorize(lambda bw: 4.0 * copy_part_numel(None if np.isinf(bw) else float(bw), step_s))(
        bandwidth_bytes)
    parts = np.ceil(state_bytes / part_bytes)
    copy_s = latency_s + state_bytes / bandwidth_bytes + parts * 2 * latency_s
    stages = plan["stages"]
    groups = [[row[j] for row in plan["pipelines"]] for j in range(stages)]
    spare_ids = list(range(len(devices), n))
    first = plan["pipelines"][0]  # replica 0's pipeline: its neighbours of each stage's source
    neighbours = [{first[k] for k in (j - 1, j + 1) if 0 <= k < stages} for j in range(stages)]
    chosen = choose_backups(groups, list(range(n)), spare_ids, copy_s, neighbours)
    slowest = max((float(copy_s[g[0], c]) for g, c in zip(groups, chosen, strict=True) if c is not None), default=0.0)
    if churn.backup_every == "auto":
        every = backup_interval(slowest, step_s, churn.backup_budget, churn.backup_max_every)
    else:
        every = churn.backup_every
    if every and train_rounds > 1:  # DiLoCo: only a round's end is a state to restart from (``churn.restart``)
        every = -(-every // train_rounds) * train_rounds
    order = list(devices) + list(spares)
    return {"peers": [order[c] if c is not None else None for c in chosen], "every_steps": every,
            "copy_s": slowest, "per_step_s": slowest / every if every else 0.0}
