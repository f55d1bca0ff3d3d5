"""The paper's scheduler, GCMA, run live for comparison (``p2ptrain plan --search gcma``).

As the paper (§3.3, a hybrid genetic algorithm after Kim & Moon's GCMA for graph partitioning) and its
public code (DS3Lab/DT-FM, ``scheduler/heuristic_evolutionary_solver``) describe it, re-written here on our
objective interface:

- A candidate is a balanced partition of the devices into D_pp groups (a group label per device), scored
  exactly: every group's data-parallel value, a bottleneck matching between every two groups, the best
  open path over the groups (``matching``, ``path``).
- Population: ``population`` random partitions.
- Each of ``offspring`` rounds draws two parents from the population; *five-point crossover* copies the
  labels of ``crossover_points`` random devices from the first parent into the second, then restores the
  group sizes (a device of an over-full group, in device order, moves to the first group still short);
  *cyclic partitioning* improves the child: moves of single devices between groups chained into a cycle
  (each group gives one device and receives one, so sizes stay equal), the best prefix of each cycle kept,
  the best prefix of cycles kept. As in the public code, a move's gain counts pipeline links only: a
  device's link to a group is its mean link cost to the members, to its own group its cheapest link to a
  member, and the gain of a move is the first minus the second; the device moved out of a group is its
  member with the cheapest own link.
- Replacement: a child no worse than its worse parent takes that parent's place; otherwise it is dropped.
- The best candidate ever scored is the result.

Deviations, all in GCMA's favour: the seed is honoured (the public code's seeding has no effect), a
bottleneck matching is one threshold search (not up to D_dp² assignment solves) and the open path is one
Held–Karp run (not one per start group); the search stops on ``offspring`` rounds or the deadline.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from p2ptrain.planning.cost import Objective
from p2ptrain.planning.matching import bottleneck_value
from p2ptrain.planning.path import best_path
from p2ptrain.planning.search import SearchResult, budget_stop, compose_pipelines


@dataclass(frozen=True)
class GcmaConfig:
    """The paper's settings: 100 random partitions, then 4,900 children."""

    population: int = 100
    offspring: int = 4_900
    crossover_points: int = 5


class _Gcma:
    def __init__(self, objective: Objective, rng: np.random.Generator, config: GcmaConfig,
                 deadline: Callable[[], bool] | None):
        self.obj = objective
        self.rng = rng
        self.cfg = config
        self.out_of_time = deadline or (lambda: False)
        self.s, self.r = objective.num_stages, objective.num_replicas
        self.n = self.s * self.r
        self.link = objective.hop_link_s
        self.evaluations = 0
        self.stopped_by = "converged"

    # -- scoring -----------------------------------------------------------------------------------------

    def groups(self, labels: np.ndarray) -> list[np.ndarray]:
        return [np.flatnonzero(labels == g) for g in range(self.s)]

    def score(self, labels: np.ndarray) -> tuple[float, list[np.ndarray]]:
        """The exact cost of the best plan over this partition, and its groups in stage order."""
        self.evaluations += 1
        groups = self.groups(labels)
        values = [float(self.obj.group_terms(g).max()) for g in groups]
        weights = np.zeros((self.s, self.s))
        for a in range(self.s):
            for b in range(a + 1, self.s):
                weights[a, b] = weights[b, a] = bottleneck_value(self.link[np.ix_(groups[a], groups[b])])
        order = [int(g) for g in best_path(weights)]
        hops = [weights[a, b] for a, b in zip(order, order[1:], strict=False)]
        cost = self.obj.combine([values[g] for g in order], hops).cost_s
        return cost, [groups[g] for g in order]

    # -- variation ---------------------------------------------------------------------------------------

    def crossover(self, first: np.ndarray, second: np.ndarray) -> np.ndarray:
        child = second.copy()
        points = self.rng.permutation(self.n)[: self.cfg.crossover_points]
        child[points] = first[points]
        sizes = np.bincount(child, minlength=self.s)
        for d in range(self.n):
            if sizes[child[d]] > self.r:
                short = int(np.flatnonzero(sizes < self.r)[0])
                sizes[child[d]] -= 1
                sizes[short] += 1
                child[d] = short
        return child

    def _gains(self, labels: np.ndarray, locked: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per group i: the device it would give (``mover[i]``, −1 if none), that device's gain towards
        every group (``gain_to[i, j]``) and its best target ``target[i]``."""
        onehot = np.zeros((self.n, self.s))
        onehot[np.arange(self.n), labels] = 1.0
        mean_to = self.link @ onehot / self.r
        own = np.where(labels[:, None] == labels[None, :], self.link, np.inf)
        np.fill_diagonal(own, np.inf)
        own_min = own.min(axis=1)
        mover = np.full(self.s, -1)
        gain_to = np.full((self.s, self.s), -np.inf)
        target = np.full(self.s, -1)
        for i in range(self.s):
            cand = np.flatnonzero((labels == i) & ~locked)
            if not len(cand):
                continue
            v = int(cand[own_min[cand].argmin()])
            mover[i] = v
            gain_to[i] = mean_to[v] - own_min[v]
            gain_to[i, i] = -np.inf
            target[i] = int(gain_to[i].argmax())
        return mover, gain_to, target

    def cyclic_partitioning(self, labels: np.ndarray) -> np.ndarray:
        locked = np.zeros(self.n, dtype=bool)
        locked_groups = np.zeros(self.s, dtype=bool)
        states, totals = [labels], [0.0]
        for _ in range(self.s):
            cur = states[-1].copy()
            mover, gain_to, target = self._gains(cur, locked)
            best_gain = np.where(mover >= 0, gain_to.max(axis=1), -np.inf)
            if not np.isfinite(best_gain).any():
                break
            start = here = int(best_gain.argmax())
            moves: list[tuple[int, int, int]] = []
            eps: list[float] = []
            tau: list[float] = []
            for _ in range(self.n):
                v, to = int(mover[here]), int(target[here])
                if v < 0:  # nothing left to give: close the cycle with the last device moved
                    if not moves:
                        break
                    v, to = moves[-1][0], start
                cur[v] = to
                locked[v] = True
                locked_groups[to] = True
                moves.append((v, here, to))
                eps.append(float(best_gain[here]))
                tau.append(float(gain_to[here, start]))
                here = to
                if here == start:
                    break
                mover, gain_to, target = self._gains(cur, locked)
                best_gain = np.where(mover >= 0, gain_to.max(axis=1), -np.inf)
            if not moves:
                break
            best_sum, keep = 0.0, 0
            for i in range(1, len(eps)):
                total = float(np.sum(eps[:i])) + tau[i]
                if total > best_sum:
                    best_sum, keep = total, i
            for v, origin, _ in reversed(moves[keep + 1 :]):
                cur[v] = origin
            cur[moves[keep][0]] = start  # the cycle closes at its first group: sizes stay equal
            states.append(cur)
            totals.append(best_sum)
            if locked_groups.all():
                break
        prefix = np.cumsum(totals)
        return states[int(prefix.argmax())]

    # -- the genetic algorithm ---------------------------------------------------------------------------

    def _exhausted(self, rounds: int) -> bool:
        stop = budget_stop(rounds, self.cfg.offspring, self.out_of_time)
        if stop:
            self.stopped_by = stop
        return stop is not None

    def run(self) -> SearchResult:
        base = np.repeat(np.arange(self.s), self.r)
        population, scores = [], []
        best: tuple[float, list[np.ndarray]] | None = None
        for k in range(self.cfg.population):
            labels = base[self.rng.permutation(self.n)]
            cost, ordered = self.score(labels)
            population.append(labels)
            scores.append(cost)
            if best is None or cost < best[0]:
                best = (cost, ordered)
            if k and self.out_of_time():
                self.stopped_by = "time budget"
                break
        rounds = 0
        while self.stopped_by == "converged" and not self._exhausted(rounds):
            rounds += 1
            i, j = (int(x) for x in self.rng.integers(len(population), size=2))
            child = self.cyclic_partitioning(self.crossover(population[i], population[j]))
            cost, ordered = self.score(child)
            assert best is not None
            if cost < best[0]:
                best = (cost, ordered)
            worse = i if scores[i] >= scores[j] else j
            if cost <= scores[worse]:
                population[worse], scores[worse] = child, cost
        assert best is not None
        sigma = compose_pipelines(self.link, [tuple(int(d) for d in g) for g in best[1]], _tau(self.link))
        return SearchResult(sigma, self.obj.evaluate(sigma), self.evaluations, self.stopped_by)


def _tau(link: np.ndarray) -> float:
    off = link[~np.eye(len(link), dtype=bool)]
    scale = float(np.median(off)) if off.size else 1.0
    return 0.01 * scale if scale > 0 else 1.0


def gcma_search(objective: Objective, rng: np.random.Generator, config: GcmaConfig,
                deadline: Callable[[], bool] | None) -> SearchResult:
    """The paper's GCMA on ``objective``: the best plan it finds in ``GcmaConfig.offspring`` rounds or by the
    deadline."""
    if objective.num_stages == 1 or objective.num_replicas == 1:
        sigma = np.arange(objective.num_stages * objective.num_replicas).reshape(objective.num_replicas, -1)
        if objective.num_replicas == 1 and objective.num_stages > 1:
            sigma = sigma[:, best_path(objective.hop_link_s)]
        return SearchResult(sigma, objective.evaluate(sigma), 1, "converged")
    return _Gcma(objective, rng, config, deadline).run()
