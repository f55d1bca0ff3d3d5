"""Plans for mixed devices: the layer split and the assignment chosen together, under memory limits.

The objective is the ``simulated`` step time (``planning.simulated``) with compute: stage j's forward, backward
and update are its blocks' (plus the embeddings on stage 0, the head on the last), on a device of the
profile's reference speed; a device of ``tflops`` takes reference/tflops times as long, and a stage's
replicas wait for each other in the all-reduce, so the slowest replica paces its stage. Gradients are
the stage's own parameters. A stage fits when its peak memory (``layers.LayerModel``: training state and
the activations of its micro-batches) is at most the memory of every device in its group.

Search (``schedule_layered``), all exact simulations of (assignment, split):

1. Starts: the ``simulated`` partition search at the even split (network- and compute-aware
   grouping, ``scheduler.schedule``); the paper's communication-only plan (its objective, even split);
   devices grouped by speed (groups of like cards), by memory (the grouping that fits most), Megatron's
   order.
2. For an assignment, the split is the min-max balance of the stages' compute over the slowest device of
   each stage's group, among the splits that fit memory (``split.minmax_split``, exact dynamic
   programming); then the best split by the simulation: every split when they are few, else moves of one
   or two blocks between any two stages while the simulated step improves.
3. Local search: swap two devices (across stages: other groups; within a stage: other pipelines) while
   the step improves (each swap priced at its balanced split and at the current one), in a random order
   from the seed; then the split again; repeated until neither improves. Starts go best first (their
   step at the balanced split), each with an equal share of the time left; then one more search from the
   partition search at the best split found. Every start is also priced as it is at the even split, so
   the plan is never slower than the paper's plan or Megatron's order where those fit.

A plan that fits nowhere is ``Infeasible``, naming the stage, its need and the shortfall for the
grouping that comes closest (devices grouped by memory).
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from p2ptrain.planning.baselines import megatron_assignment, random_assignment
from p2ptrain.planning.cluster import Cluster
from p2ptrain.planning.cost import CostBreakdown
from p2ptrain.planning.layers import LayeredWorkload  # also imported from here (agent.leader)
from p2ptrain.planning.plan import Infeasible, Plan, SearchStats
from p2ptrain.planning.simulated import SimulatedObjective
from p2ptrain.planning.split import Layers, even_layers, layers_from_sizes, minmax_split
from p2ptrain.planning.workload import Workload

log = logging.getLogger(__name__)

MAX_JOINT_EVALUATIONS = 20_000  # simulations in the local search, over all starts
MAX_PERMUTED_GROUPS = 6  # memory grouping: every stage order of the groups up to this many stages
MAX_ENUMERATED_SPLITS = 120  # the split of an assignment: every split up to this many
MAX_SWEEP_SPLITS = 600  # swaps × splits: below, every swap is priced at each of its splits
MAX_CACHED_COSTS = 200_000  # simulated (assignment, split) pairs remembered
REL_GAIN = 1e-9  # a change must be better than this, relatively, to be taken
MAX_CACHED_SPLITS = 512  # simulated objectives (one per split) remembered


@dataclass
class _Found:
    sigma: np.ndarray
    layers: Layers
    cost_s: float


class _Joint:
    """Exact costs of (assignment, split), with the simulated objective of each split cached."""

    def __init__(self, cluster: Cluster, workload: LayeredWorkload, num_stages: int):
        assert workload.costs is not None
        self.cluster, self.workload, self.costs = cluster, workload, workload.costs
        self.num_stages, self.num_replicas = num_stages, cluster.num_devices // num_stages
        self.even = even_layers(self.costs.num_layers, num_stages)
        self._objectives: dict[Layers, SimulatedObjective] = {}
        self._costs: dict[tuple[bytes, Layers], float] = {}
        self.slow = self.objective(self.even).slowdown
        self.cap = np.array([d.memory_gb if d.memory_gb else np.inf for d in cluster.devices])
        self.evaluations = 0
        c = self.costs
        self._block = c.forward_s.block + c.backward_s.block
        self._ends = (c.forward_s.embeddings + c.backward_s.embeddings, c.forward_s.head + c.backward_s.head)
        self._eps = 1e-9 * max(self._block, *self._ends, 1e-30)  # ties: the most even split

    def objective(self, layers: Layers) -> SimulatedObjective:
        cache = self._objectives
        obj = cache.get(layers)
        if obj is None:
            if len(cache) > MAX_CACHED_SPLITS:
                cache.clear()
            obj = cache[layers] = SimulatedObjective(self.cluster, self.workload.at(layers), self.num_stages)
        return obj

    def cost(self, sigma: np.ndarray, layers: Layers) -> float:
        key = (np.asarray(sigma, dtype=np.intp).tobytes(), layers)
        hit = self._costs.get(key)
        if hit is None:  # the starts' searches meet the same states: simulate each once
            if len(self._costs) > MAX_CACHED_COSTS:
                self._costs.clear()
            self.evaluations += 1
            hit = self._costs[key] = self.objective(layers).simulate(sigma).predicted_s
        return hit

    def fits(self, sigma: np.ndarray, layers: Layers) -> bool:
        return bool(np.all(np.array(self.costs.memory(layers)) <= self.cap[sigma].min(axis=0) * (1 + 1e-12)))

    def _stage_memory(self, j: int, ks: np.ndarray) -> np.ndarray:
        m, last = self.costs.memory_gb, self.num_stages - 1
        return ks * m.block + (m.embeddings if j == 0 else 0.0) + (m.head if j == last else 0.0) + \
            self.costs.stage_memory_gb

    def balanced(self, sigma: np.ndarray) -> Layers | None:
        """The split balancing compute over the stages' slowest devices among those that fit (None: none)."""
        slow, cap, last = self.slow[sigma].max(axis=0), self.cap[sigma].min(axis=0), self.num_stages - 1

        def stage_cost(j: int, ks: np.ndarray) -> np.ndarray:
            compute = (ks * self._block + (self._ends[0] if j == 0 else 0.0) + (self._ends[1] if j == last else 0.0))
            value = compute * slow[j] + self._eps * ks
            return np.where(self._stage_memory(j, ks) <= cap[j] * (1 + 1e-12), value, np.inf)

        layers, value = minmax_split(self.costs.num_layers, self.num_stages, stage_cost)
        return layers if math.isfinite(value) else None

    def shortfall(self, sigma: np.ndarray) -> tuple[Layers, float]:
        """The split whose worst stage is least over its group's memory, and that excess in GB."""
        cap = self.cap[sigma].min(axis=0)
        return minmax_split(self.costs.num_layers, self.num_stages, lambda j, ks: self._stage_memory(j, ks) - cap[j])

    def _split_count(self) -> int:
        return math.comb(self.costs.num_layers - 1, self.num_stages - 1)

    def _all_splits(self) -> list[Layers]:
        n, s = self.costs.num_layers, self.num_stages
        return [layers_from_sizes(np.diff((0, *cuts, n)).tolist()) for cuts in itertools.combinations(range(1, n), s - 1)]

    def polish(self, sigma: np.ndarray, layers: Layers, cost: float, budget: int) -> tuple[Layers, float]:
        """The best split for ``sigma`` near ``layers``: every split when there are at most
        ``MAX_ENUMERATED_SPLITS``, else moves of one or two blocks from any stage to any other while the
        simulated step improves (and memory fits)."""
        s = self.num_stages
        if self._split_count() <= MAX_ENUMERATED_SPLITS:
            for candidate in self._all_splits():
                if candidate != layers and self.fits(sigma, candidate):
                    c = self.cost(sigma, candidate)
                    if c < cost * (1 - REL_GAIN):
                        layers, cost = candidate, c
            return layers, cost
        sizes = [b - a for a, b in layers]
        improved = True
        while improved and budget > 0:
            improved = False
            for src, dst, k in itertools.product(range(s), range(s), (1, 2)):
                if src == dst or sizes[src] <= k:
                    continue
                trial = list(sizes)
                trial[src] -= k
                trial[dst] += k
                candidate = layers_from_sizes(trial)
                if not self.fits(sigma, candidate):
                    continue
                budget -= 1
                c = self.cost(sigma, candidate)
                if c < cost * (1 - REL_GAIN):
                    sizes, layers, cost, improved = trial, candidate, c, True
                    break
        return layers, cost

    def local_search(self, start: np.ndarray, rng: np.random.Generator, budget: int,
                     out_of_time: Callable[[], bool]) -> _Found | None:
        """Swap sweeps and block moves until neither improves (module docstring, step 3)."""
        sigma = np.array(start, dtype=np.intp)
        layers = self.balanced(sigma)
        if layers is None:
            return None
        found = _Found(sigma, layers, self.cost(sigma, layers))
        spent = self.evaluations
        while self.evaluations - spent < budget and not out_of_time():
            swapped = self._sweep(found, rng, spent + budget, out_of_time)
            layers, cost = self.polish(found.sigma, found.layers, found.cost_s, 4 * self.num_stages ** 2)
            moved = cost < found.cost_s * (1 - REL_GAIN)
            found = _Found(found.sigma, layers, cost)
            if not (swapped or moved):
                break
        return found

    def _sweep(self, found: _Found, rng: np.random.Generator, until: int, out_of_time: Callable[[], bool]) -> bool:
        """Swaps of two slots, first improvement, in a random order, until a pass improves nothing. Each
        trial is priced at every split when that is cheap (``MAX_SWEEP_SPLITS``), else at the balanced
        split of its groups and at the current split (those that fit)."""
        d, s = found.sigma.shape
        pairs = list(itertools.combinations([(i, j) for i in range(d) for j in range(s)], 2))
        every = self._all_splits() if len(pairs) * self._split_count() <= MAX_SWEEP_SPLITS else None
        any_gain, improved = False, True
        while improved and self.evaluations < until and not out_of_time():
            improved = False
            for k in rng.permutation(len(pairs)):
                (i1, j1), (i2, j2) = pairs[k]
                trial = found.sigma.copy()
                trial[i1, j1], trial[i2, j2] = found.sigma[i2, j2], found.sigma[i1, j1]
                if every is not None:
                    options = every
                else:
                    options = [found.layers] if j1 == j2 else [self.balanced(trial), found.layers]
                for layers in options:
                    if layers is None or not self.fits(trial, layers):
                        continue
                    c = self.cost(trial, layers)
                    if c < found.cost_s * (1 - REL_GAIN):
                        found.sigma, found.layers, found.cost_s = trial, layers, c
                        improved = any_gain = True
                        break
                if self.evaluations >= until or out_of_time():
                    break
        return any_gain


def _grouped(order: np.ndarray, num_stages: int) -> np.ndarray:
    """Devices in ``order``, D at a time into stages 0, 1, …; pipeline i takes the i-th of each group."""
    return np.asarray(order, dtype=np.intp).reshape(num_stages, -1).T.copy()


def _memory_starts(joint: _Joint) -> list[np.ndarray]:
    """Groups of like memory (the grouping that fits most), in the stage orders that fit best."""
    s = joint.num_stages
    base = _grouped(np.argsort(-joint.cap, kind="stable"), s)
    if s <= MAX_PERMUTED_GROUPS:
        orders = list(itertools.permutations(range(s)))
    else:
        orders = [tuple(range(s)), tuple(reversed(range(s)))]
    scored = sorted(orders, key=lambda o: joint.shortfall(base[:, list(o)])[1])
    return [base[:, list(o)] for o in scored[:2]]


def schedule_layered(
    cluster: Cluster,
    workload: LayeredWorkload,
    num_stages: int,
    *,
    inner: Callable[..., Plan | Infeasible],
    seed: int,
    rng: np.random.Generator,
    time_budget_s: float | None,
    clock: Callable[[], float] | None,
    search_kwargs: dict,
) -> Plan | Infeasible:
    """The joint plan (module docstring). ``inner`` is ``scheduler.schedule`` (the partition search),
    called with ``search_kwargs`` and the remaining time budget."""
    assert workload.costs is not None
    num_layers = workload.costs.num_layers
    if num_stages > num_layers:
        return Infeasible(f"{num_stages} stages but the model has only {num_layers} layers")
    start_time = clock() if clock else None

    def remaining() -> float | None:
        if time_budget_s is None or clock is None or start_time is None:
            return None
        return max(time_budget_s - (clock() - start_time), 1e-3)

    def out_of_time() -> bool:
        left = remaining()
        return left is not None and left <= 1e-3

    joint = _Joint(cluster, workload, num_stages)
    search_rng, baseline_rng, local_rng = rng.spawn(3)
    n, even = cluster.num_devices, joint.even

    def inner_plan(w: Workload, objective: str, r: np.random.Generator) -> np.ndarray | None:
        plan = inner(cluster, w, num_stages, seed=seed, rng=r, objective=objective, time_budget_s=remaining(),
                     clock=clock if remaining() is not None else None, **search_kwargs)
        return None if isinstance(plan, Infeasible) else np.array(plan.pipelines, dtype=np.intp)

    simulated_rng, dtfm_rng, again_rng = search_rng.spawn(3)
    comm_only = inner_plan(Workload(workload.activation_gb, workload.gradient_gb), "dtfm", dtfm_rng)
    starts = [inner_plan(workload.at(even), "simulated", simulated_rng), comm_only,
              _grouped(np.lexsort((-joint.cap, joint.slow)), num_stages), *_memory_starts(joint),
              megatron_assignment(n, num_stages)]
    starts = [x for x in starts if x is not None]
    best = _best_as_they_are(joint, starts)
    budget = MAX_JOINT_EVALUATIONS // (len(starts) + 1)

    def opening(sigma: np.ndarray) -> float:  # a start's step at its balanced split: the best go first
        layers = joint.balanced(sigma)
        return joint.cost(sigma, layers) if layers is not None else math.inf

    starts.sort(key=opening)
    for k, sigma in enumerate(starts):
        found = joint.local_search(sigma, local_rng, budget, _share_of(remaining, len(starts) - k, clock, out_of_time))
        if found is not None and (best is None or found.cost_s < best.cost_s * (1 - REL_GAIN)):
            best = found
    if best is not None and best.layers != even and not out_of_time():
        again = inner_plan(workload.at(best.layers), "simulated", again_rng)
        found = joint.local_search(again, local_rng, budget, out_of_time) if again is not None else None
        if found is not None and found.cost_s < best.cost_s * (1 - REL_GAIN):
            best = found
    if best is None:
        return Infeasible(_memory_reason(joint))
    objective = joint.objective(best.layers)
    pipelines = best.sigma[np.argsort(best.sigma[:, 0], kind="stable")]
    cost = objective.evaluate(pipelines if cluster.has_access_links else best.sigma)  # rank order orders shards
    baselines, unfit = _baselines(joint, comm_only, baseline_rng)
    seconds = clock() - start_time if clock and start_time is not None else None
    log.info("planned %d devices in %d stages with layers %s: %.3f s/step (%d simulations)", n, num_stages,
             [b - a for a, b in best.layers], cost.cost_s, joint.evaluations)
    return Plan(
        pipelines=tuple(tuple(int(x) for x in row) for row in pipelines), objective="simulated", cost=cost,
        baselines=baselines,
        search=SearchStats(seed=seed, evaluations=joint.evaluations, seconds=seconds, method="joint",
                           stopped_by="time budget" if out_of_time() else "converged"),
        layers=best.layers, stage_memory_gb=joint.costs.memory(best.layers),
        wire=workload.step.wire or workload.wire, schedule=workload.step.schedule, unfit_baselines=tuple(unfit))


def _best_as_they_are(joint: _Joint, starts: list[np.ndarray]) -> _Found | None:
    """The best of ``starts`` as they are, at the even split (so the plan is never worse than these)."""
    best: _Found | None = None
    for sigma in starts:
        if joint.fits(sigma, joint.even):
            c = joint.cost(sigma, joint.even)
            if best is None or c < best.cost_s:
                best = _Found(sigma, joint.even, c)
    return best


def _baselines(joint: _Joint, comm_only: np.ndarray | None, rng: np.random.Generator
               ) -> tuple[dict[str, CostBreakdown], list[str]]:
    """The baselines at the even split (Megatron's order, the communication-only plan, the mean of 100 random
    assignments, fit or not), and which of the first two do not fit the devices' memory."""
    n, num_stages, even = joint.cluster.num_devices, joint.num_stages, joint.even
    even_objective = joint.objective(even)
    baselines: dict[str, CostBreakdown] = {"megatron": even_objective.evaluate(megatron_assignment(n, num_stages))}
    if comm_only is not None:
        baselines["communication_only"] = even_objective.evaluate(comm_only)
    samples = [even_objective.evaluate(random_assignment(n, num_stages, rng)) for _ in range(100)]
    baselines["random"] = CostBreakdown(*(float(np.mean([getattr(c, k) for c in samples]))
                                          for k in ("cost_s", "data_parallel_s", "pipeline_s")))
    unfit = [name for name, sigma in (("megatron", megatron_assignment(n, num_stages)),
                                      ("communication_only", comm_only)) if sigma is not None and not joint.fits(sigma, even)]
    return baselines, unfit


def _share_of(remaining: Callable[[], float | None], parts: int, clock: Callable[[], float] | None,
              out_of_time: Callable[[], bool]) -> Callable[[], bool]:
    """A deadline for one of ``parts`` searches sharing what is left of the time budget (none without one)."""
    left = remaining()
    if left is None or clock is None:
        return out_of_time
    until = clock() + left / parts
    return lambda: out_of_time() or clock() >= until


def _memory_reason(joint: _Joint) -> str:
    """One line: the stage that does not fit in the grouping closest to fitting, its need and shortfall."""
    sigma = _memory_starts(joint)[0]
    layers, _ = joint.shortfall(sigma)
    need = np.array(joint.costs.memory(layers))
    cap = joint.cap[sigma].min(axis=0)
    j = int(np.argmax(need - cap))
    small = int(sigma[np.argmin(joint.cap[sigma[:, j]]), j])
    a, b = layers[j]
    return (f"the model does not fit: stage {j} (blocks {a}-{b - 1}) needs {need[j]:.3g} GB on each of its devices "
            f"but {joint.cluster.devices[small].name} has {cap[j]:.3g} GB ({need[j] - cap[j]:.3g} GB short); use more "
            f"stages, more micro-batches, activation recomputation or devices with more memory")
