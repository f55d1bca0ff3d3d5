"""The search over partitions: groups of devices, one per stage, in a stage order.

Why a partition is enough (see ``matching`` and ``path``): for a fixed partition into stage groups and a
fixed stage order, the best pipelines are one bottleneck matching per hop, and the best order is a shortest
open path over the groups. So the search moves devices between groups and keeps the order and matchings
optimal (or near it) for the partition at hand.

The score of a state is the pair (cost, surrogate), compared lexicographically. ``cost`` is the objective's
exact value. The surrogate is the same objective fed with softened values — each group's value is a
log-sum-exp of its per-member terms and each hop's value its bottleneck plus its crowding excess (how many
matched links sit at or near the bottleneck), plus the crowding of the groups near the largest group value.
The max in the cost makes it flat over huge regions (the reason the paper's GCMA never improves on the
"spot" network): the surrogate still goes down when a move removes one of several links at the bottleneck,
so the search walks across plateaus towards the move that finally lowers the cost.

Moves swap devices between two groups: for each pair of twin classes (``canonical``: interchangeable
devices, a region or an instance) one device of each, or 2, 4, … of each at once (block moves, so a
region can change group without passing through worse states). A move is scored with the stage order
fixed — only the ≤ 4 hops next to the two groups and the two groups change — which over-estimates the
cost after re-ordering; after every sweep the order is re-optimised (with 3 stages every order is tried
per move: cheap, and there a move often pays only in another order). Descent accepts the first improving
move; a group pair scanned without success is skipped until it or a neighbour changes.

Around it: starts built from the structure (stage groups inside regions; pipelines inside regions; greedy
groups; greedy chains; clusters aligned at the same stages of every pipeline — ``starts``) and random
ones; then iterated local search — perturb one of the best states by a few random swaps, descend, keep
the result when it is no worse — until ``patience`` rounds bring no new best (and at least
``min_evaluations`` moves were scored), the evaluation budget is spent, or the deadline passes. In a
measured network no two devices are exact twins; the first phase moves near-twins (links within 25 % of
each other) as one, then a second phase repeats the iterated search with every single swap.

Everything random comes from the Generator passed in, and the stopping rule is a count, so a seed fixes
the result unless the time budget cuts the search short.
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from p2ptrain.planning.cost import CostBreakdown, Objective
from p2ptrain.planning.matching import bottleneck_matching
from p2ptrain.planning.path import EXACT_PATH_LIMIT, best_path
from p2ptrain.planning.starts import aligned_chains, greedy_chains, greedy_groups, near_twin_classes

log = logging.getLogger(__name__)

SOFTNESS = 0.01  # τ as a fraction of the median link cost: the surrogate's temperature
REL_TOL = 1e-9


@dataclass(frozen=True)
class SearchConfig:
    """Knobs of the search; the defaults are what ``p2ptrain plan`` uses."""

    random_starts: int = 2
    elite: int = 2  # how many of the best starts iterated local search works on
    patience: int = 8  # perturbation rounds without improvement before stopping …
    min_evaluations: int = 1_000  # … once at least this many moves were evaluated (small clusters: cheap)
    max_evaluations: int = 400_000  # move evaluations, summed over the whole search
    exact_path_max_stages: int = EXACT_PATH_LIMIT


DEFAULT_SEARCH = SearchConfig()


@dataclass
class SearchResult:
    assignment: np.ndarray  # D_dp × D_pp, device indices of the problem given to the search
    cost: CostBreakdown
    evaluations: int
    stopped_by: str


Key = tuple[int, ...]
Score = tuple[float, float]
Order = list[int]
REORDER_IN_MOVES_STAGES = 3


@functools.cache
def _paths(s: int) -> tuple[tuple[int, ...], ...]:
    """Every stage order of s groups, each path once (not also its reverse)."""
    return tuple(q for q in itertools.permutations(range(s)) if q[0] < q[-1])


class _Problem:
    """What every state shares: the objective, twin classes, caches of group and hop values."""

    def __init__(self, objective: Objective, twin_class: np.ndarray):
        self.obj = objective
        self.link = objective.hop_link_s
        self.twin = twin_class
        self._twin_list = [int(c) for c in twin_class]
        n = len(twin_class)
        off = self.link[~np.eye(n, dtype=bool)]
        scale = float(np.median(off)) if off.size else 1.0
        self.tau_hop = SOFTNESS * scale if scale > 0 else 1.0
        self.tau_group: float | None = None
        self.group_cache: dict[Key, tuple[float, float]] = {}
        self.signature_cache: dict[Key, Key] = {}
        self.hop_cache: dict[tuple[Key, Key], tuple[float, float]] = {}
        self.evaluations = 0

    def signature(self, key: Key) -> Key:
        """The twin classes of a group's members: groups with equal signatures are interchangeable."""
        sig = self.signature_cache.get(key)
        if sig is None:
            if len(self.signature_cache) > 2_000_000:
                self.signature_cache.clear()
            twin = self._twin_list
            sig = self.signature_cache[key] = tuple(sorted([twin[m] for m in key]))
        return sig

    def group(self, key: Key) -> tuple[float, float]:
        """(value, soft value) of a stage group."""
        sig = self.signature(key)
        hit = self.group_cache.get(sig)
        if hit is None:
            terms = self.obj.group_terms(np.array(key))
            top = float(terms.max())
            if self.tau_group is None:
                self.tau_group = SOFTNESS * top if top > 0 else 1.0
            soft = top + self.tau_group * math.log(float(np.exp((terms - top) / self.tau_group).sum()))
            hit = self.group_cache[sig] = (top, soft)
        return hit

    def hop(self, a: Key, b: Key) -> tuple[float, float]:
        """(bottleneck, bottleneck + crowding excess) of the hop between two groups."""
        sa, sb = self.signature(a), self.signature(b)
        k = (sa, sb) if sa <= sb else (sb, sa)
        hit = self.hop_cache.get(k)
        if hit is None:
            if len(self.hop_cache) > 2_000_000:
                self.hop_cache.clear()
            t, excess, _ = bottleneck_matching(self.link[np.array(a)[:, None], np.array(b)], self.tau_hop)
            hit = self.hop_cache[k] = (t, t + excess)
        return hit

    def score(self, gv: list[float], gs: list[float], hv: list[float], hs: list[float]) -> tuple[float, float]:
        cost = self.obj.combine(gv, hv).cost_s
        top = max(gs)
        tau = self.tau_group or 1.0
        crowd = tau * math.log(sum(math.exp((x - top) / tau) for x in gs))
        return cost, self.obj.combine(gs, hs).cost_s + crowd


def _better(a: tuple[float, float], b: tuple[float, float]) -> bool:
    tol = REL_TOL * max(1.0, abs(b[0]))
    if a[0] < b[0] - tol:
        return True
    return a[0] <= b[0] + tol and a[1] < b[1] - REL_TOL * max(1.0, abs(b[1]))


class _State:
    """A partition (sorted member tuples per group) and a stage order, with cached values."""

    def __init__(self, problem: _Problem, groups: list[Key], order: list[int]):
        self.p = problem
        self.groups = list(groups)
        self.order = list(order)
        # "don't look" bookkeeping: a group pair scanned without finding a move is not scanned again
        # until one of the two groups or a stage-order neighbour of either changes
        self.clock = 0
        self.changed = [0] * len(groups)
        self.scanned: dict[tuple[int, int], int] = {}
        self._refresh()

    def copy(self) -> _State:
        twin = _State(self.p, self.groups, self.order)
        twin.clock, twin.changed, twin.scanned = self.clock, list(self.changed), dict(self.scanned)
        return twin

    def touch(self, *groups: int) -> None:
        self.clock += 1
        last = len(self.order) - 1
        for g in groups:
            k = self.pos[g]
            for n in (self.order[max(k - 1, 0)], g, self.order[min(k + 1, last)]):
                self.changed[n] = self.clock

    @staticmethod
    def _neighbours(order: list[int]) -> dict[int, frozenset[int]]:
        return {g: frozenset(order[max(k - 1, 0) : k + 2]) for k, g in enumerate(order)}

    def is_clean(self, g: int, h: int) -> bool:
        return self.scanned.get((g, h), -1) >= max(self.changed[g], self.changed[h])

    def mark_clean(self, g: int, h: int) -> None:
        self.scanned[(g, h)] = self.clock

    def _refresh(self) -> None:
        self.pos = {g: k for k, g in enumerate(self.order)}
        vals = [self.p.group(key) for key in self.groups]
        self.gv = [v for v, _ in vals]
        self.gs = [s for _, s in vals]
        hops = [self.p.hop(self.groups[a], self.groups[b]) for a, b in zip(self.order, self.order[1:], strict=False)]
        self.hv = [v for v, _ in hops]
        self.hs = [s for _, s in hops]
        self.score = self.p.score(self._staged(self.gv), self._staged(self.gs), self.hv, self.hs)

    def _staged(self, per_group: list[float]) -> list[float]:
        return [per_group[g] for g in self.order]

    def swap_score(self, g: int, h: int, xs: tuple[int, ...], ys: tuple[int, ...]) -> tuple[Score, Key, Key, Order]:
        """The score after swapping devices ``xs`` (in group g) with ``ys`` (in group h)."""
        new_g = tuple(sorted([m for m in self.groups[g] if m not in xs] + list(ys)))
        new_h = tuple(sorted([m for m in self.groups[h] if m not in ys] + list(xs)))
        score, order = self.regroup_score(g, h, new_g, new_h)
        return score, new_g, new_h, order

    def regroup_score(self, g: int, h: int, new_g: Key, new_h: Key) -> tuple[Score, Order]:
        """The score with groups g and h replaced by ``new_g`` and ``new_h``, and the stage order it needs:
        the current one, except with at most ``REORDER_IN_MOVES_STAGES`` stages, where every order is tried
        (with so few groups a move often pays only in another order, and trying them all is cheap)."""
        p = self.p
        p.evaluations += 1
        gv, gs = list(self.gv), list(self.gs)
        gv[g], gs[g] = p.group(new_g)
        gv[h], gs[h] = p.group(new_h)
        groups = list(self.groups)
        groups[g], groups[h] = new_g, new_h
        if 2 < len(groups) <= REORDER_IN_MOVES_STAGES:
            best: tuple[Score, Order] | None = None
            for order in _paths(len(groups)):
                hops = [p.hop(groups[a], groups[b]) for a, b in zip(order, order[1:], strict=False)]
                score = p.score([gv[x] for x in order], [gs[x] for x in order], [v for v, _ in hops],
                                [w for _, w in hops])
                if best is None or _better(score, best[0]):
                    best = (score, list(order))
            assert best is not None
            return best
        hv, hs = list(self.hv), list(self.hs)
        last = len(self.order) - 2
        for k in {self.pos[g] - 1, self.pos[g], self.pos[h] - 1, self.pos[h]}:
            if 0 <= k <= last:
                a, b = self.order[k], self.order[k + 1]
                hv[k], hs[k] = p.hop(groups[a], groups[b])
        return p.score(self._staged(gv), self._staged(gs), hv, hs), self.order

    def apply(self, g: int, h: int, new_g: Key, new_h: Key, order: Order) -> None:
        self.groups[g], self.groups[h] = new_g, new_h
        if order != self.order:
            self.order = list(order)
            self.pos = {x: k for k, x in enumerate(self.order)}
            self.clock += 1
            self.changed = [self.clock] * len(self.groups)
        self.touch(g, h)
        self._refresh()

    def reorder(self, exact_limit: int) -> bool:
        """Re-optimise the stage order for the current partition; True when the score improved."""
        s = len(self.groups)
        if s <= 2:
            return False
        weights = np.zeros((s, s))
        for a in range(s):
            for b in range(a + 1, s):
                weights[a, b] = weights[b, a] = self.p.hop(self.groups[a], self.groups[b])[0]
        order = [int(g) for g in best_path(weights, exact_limit)]
        if order == self.order or order[::-1] == self.order:
            return False
        old_order, old_score = self.order, self.score
        self.order = order
        self._refresh()
        if _better(self.score, old_score):
            self.clock += 1
            before, after = self._neighbours(old_order), self._neighbours(self.order)
            for g in range(s):
                if before[g] != after[g]:
                    self.changed[g] = self.clock
            return True
        self.order = old_order
        self._refresh()
        return False


class Search:
    """Partition search for one objective. ``twin_class[d]`` marks interchangeable devices."""

    def __init__(
        self,
        objective: Objective,
        twin_class: np.ndarray,
        rng: np.random.Generator,
        config: SearchConfig | None = None,
        deadline: Callable[[], bool] | None = None,
    ):
        self.p = _Problem(objective, np.asarray(twin_class))
        self.rng = rng
        self.cfg = config or DEFAULT_SEARCH
        self.out_of_time = deadline or (lambda: False)
        # Moves treat near-twins (links within NEAR_TWIN_RATIO of each other: one region of a measured
        # network) as interchangeable, which shrinks the neighbourhood as exact twins do; a final descent
        # then tries every swap. Scores are always exact.
        self.move_class = near_twin_classes(objective.hop_link_s, self.p.twin)
        self.num_stages = objective.num_stages
        self.num_replicas = objective.num_replicas
        self.n = self.num_stages * self.num_replicas
        self.stopped_by = "converged"
        # when set, moves are single swaps of devices of the same class (``improve``)
        self.within: np.ndarray | None = None
        self.best_states: list[_State] = []

    # -- budget ------------------------------------------------------------------------------------------

    def _exhausted(self) -> bool:
        stop = budget_stop(self.p.evaluations, self.cfg.max_evaluations, self.out_of_time)
        if stop:
            self.stopped_by = stop
        return stop is not None

    # -- states ------------------------------------------------------------------------------------------

    def _state_from_assignment(self, sigma: np.ndarray) -> _State:
        groups = [tuple(sorted(int(d) for d in sigma[:, j])) for j in range(self.num_stages)]
        state = _State(self.p, groups, list(range(self.num_stages)))
        state.reorder(self.cfg.exact_path_max_stages)
        return state

    def _starts(self) -> list[tuple[str, np.ndarray]]:
        s, r, n = self.num_stages, self.num_replicas, self.n
        link = self.p.link
        starts = [
            ("blocks", np.arange(n).reshape(s, r).T),  # stage groups inside twin classes / regions
            ("transposed", np.arange(n).reshape(r, s)),  # pipelines inside regions
            ("greedy groups", greedy_groups(link, r).T),
            ("greedy chains", greedy_chains(link, s)),
            ("aligned chains", aligned_chains(link, self.p.twin, s)),
        ]
        for k in range(self.cfg.random_starts):
            starts.append((f"random {k}", self.rng.permutation(n).reshape(r, s)))
        return starts

    # -- local search ------------------------------------------------------------------------------------

    def _candidates(self, state: _State, g: int, h: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        """Swaps between groups g and h: for each pair of twin classes, 1, 2, 4, … devices of each at once
        (block moves let whole regions change group; without twins every swap is of one device)."""
        if self.within is not None:
            within = self.within
            same = [((x,), (y,)) for x in state.groups[g] for y in state.groups[h] if within[x] == within[y]]
            return [same[i] for i in self.rng.permutation(len(same))]
        twin = self.move_class
        by_class_g: dict[int, list[int]] = {}
        by_class_h: dict[int, list[int]] = {}
        for x in state.groups[g]:
            by_class_g.setdefault(int(twin[x]), []).append(x)
        for y in state.groups[h]:
            by_class_h.setdefault(int(twin[y]), []).append(y)
        moves = []
        for cx, xs in by_class_g.items():
            for cy, ys in by_class_h.items():
                if cx == cy:
                    continue
                most = min(len(xs), len(ys))
                sizes = sorted({1 << k for k in range(most.bit_length()) if 1 << k <= most} | {most})
                moves.extend((tuple(xs[:m]), tuple(ys[:m])) for m in sizes)
        order = self.rng.permutation(len(moves))
        return [moves[i] for i in order]

    def descend(self, state: _State) -> _State:
        """First-improvement descent over swaps, re-ordering after each sweep, to a local optimum."""
        s = self.num_stages
        pairs = [(g, h) for g in range(s) for h in range(g + 1, s)]
        while not self._exhausted():
            improved = False
            for i in self.rng.permutation(len(pairs)):
                g, h = pairs[i]
                if state.is_clean(g, h):
                    continue
                for xs, ys in self._candidates(state, g, h):
                    score, new_g, new_h, order = state.swap_score(g, h, xs, ys)
                    if _better(score, state.score):
                        state.apply(g, h, new_g, new_h, order)
                        improved = True
                        break
                else:
                    state.mark_clean(g, h)
                if self._exhausted():
                    break
            improved = state.reorder(self.cfg.exact_path_max_stages) or improved
            if not improved:
                break
        return state

    def _perturb(self, state: _State) -> _State:
        self.p.evaluations += 1  # the perturbed state is scored: this also bounds rounds that try no move
        out = state.copy()
        s = self.num_stages
        for _ in range(int(self.rng.integers(2, 3 + s))):
            g, h = self.rng.choice(s, size=2, replace=False)
            x = out.groups[g][int(self.rng.integers(len(out.groups[g])))]
            if self.within is not None:  # a mate of x in another group
                mates = [m for m in out.groups[h] if self.within[m] == self.within[x]]
                if not mates:
                    continue
                y = mates[int(self.rng.integers(len(mates)))]
            else:
                y = out.groups[h][int(self.rng.integers(len(out.groups[h])))]
            if self.within is not None or self.move_class[x] != self.move_class[y]:
                out.groups[g] = tuple(sorted([m for m in out.groups[g] if m != x] + [y]))
                out.groups[h] = tuple(sorted([m for m in out.groups[h] if m != y] + [x]))
                out.touch(int(g), int(h))
        out._refresh()
        return out

    def _iterate(self, elite: list[_State], patience: int, min_evaluations: int) -> list[_State]:
        """Iterated local search on the elite states until ``patience`` rounds bring no new best."""
        elite = sorted(elite, key=lambda st: st.score)
        idle = 0  # rounds since the best state last improved
        while (idle < patience or self.p.evaluations < min_evaluations) and not self._exhausted():
            i = idle % len(elite)
            base = elite[i]
            cand = self.descend(self._perturb(base))
            improves_best = _better(cand.score, elite[0].score)
            if not _better(base.score, cand.score):
                elite[i] = cand  # better, or as good: drift along the plateau
            elite.sort(key=lambda st: st.score)
            idle = 0 if improves_best else idle + 1
        return elite

    def improve(self, assignments: list[np.ndarray], classes: np.ndarray, full_swaps: bool) -> SearchResult:
        """Improve ``assignments`` (found on a snapped network, whose clusters ``classes`` were exact twins
        there): first swaps between members of one cluster (they differ only by noise: the moves the
        snapped search could not see), then, with ``full_swaps``, every single swap."""
        self.within = np.asarray(classes)
        found = [self.descend(self._state_from_assignment(sigma)) for sigma in assignments]
        found.sort(key=lambda st: st.score)
        elite = self._iterate(found[: self.cfg.elite], self.cfg.patience, 0)
        self.within = None
        if full_swaps and not self._exhausted():
            self.move_class = np.arange(self.n)
            elite = [self.descend(_State(self.p, st.groups, st.order)) for st in elite]
            elite = self._iterate(elite, self.cfg.patience, 0)
        return self._result(min(elite + found, key=lambda st: st.score))

    def run(self) -> SearchResult:
        """Search from the starts; ``best_states`` then holds the final states, best first."""
        if self.num_stages == 1 or self.num_replicas == 1 and self.num_stages <= 2:
            self.best_states = [self._state_from_assignment(np.arange(self.n).reshape(self.num_replicas, -1))]
            return self._result(self.best_states[0])
        found = []
        for name, sigma in self._starts():
            state = self.descend(self._state_from_assignment(sigma))
            log.debug("start %s: %.4f s", name, state.score[0])
            found.append(state)
            if self._exhausted():
                break
        found.sort(key=lambda st: st.score)
        elite = self._iterate(found[: self.cfg.elite], self.cfg.patience, self.cfg.min_evaluations)
        if not np.array_equal(self.move_class, self.p.twin) and not self._exhausted():
            # near-twins were moved as one; now every single swap, from the best states
            self.move_class = self.p.twin
            polished = [self.descend(_State(self.p, st.groups, st.order)) for st in elite]
            elite = self._iterate(polished, self.cfg.patience, 0)
        self.best_states = sorted(elite + found, key=lambda st: st.score)
        return self._result(self.best_states[0])

    def stage_groups(self, count: int) -> list[list[Key]]:
        """The stage groups (in stage order) of up to ``count`` of the best final states, each once."""
        out: list[list[Key]] = []
        for st in self.best_states:
            groups = [st.groups[g] for g in st.order]
            if groups not in out:
                out.append(groups)
            if len(out) == count:
                break
        return out

    # -- output ------------------------------------------------------------------------------------------

    def _result(self, state: _State) -> SearchResult:
        sigma = compose_pipelines(self.p.link, [state.groups[g] for g in state.order], self.p.tau_hop)
        cost = self.p.obj.evaluate(sigma)
        return SearchResult(sigma, cost, self.p.evaluations, self.stopped_by)


def budget_stop(count: int, limit: int, out_of_time: Callable[[], bool]) -> str | None:
    """Why a search must stop ("evaluations" or "time budget"), or None while it may go on."""
    if count >= limit:
        return "evaluations"
    if out_of_time():
        return "time budget"
    return None


def compose_pipelines(link: np.ndarray, stage_groups: list[Key], tau: float) -> np.ndarray:
    """Pipelines from stage groups in stage order: chain one bottleneck matching per hop."""
    current = np.array(stage_groups[0])
    columns = [current]
    for nxt in stage_groups[1:]:
        nxt = np.array(nxt)
        _, _, cols = bottleneck_matching(link[np.ix_(current, nxt)], tau)
        current = nxt[cols]
        columns.append(current)
    return np.stack(columns, axis=1)
