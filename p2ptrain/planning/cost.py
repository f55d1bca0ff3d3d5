"""The paper's cost model (NOTES.md), and the objective interface the scheduler searches.

An assignment σ is a D_dp × D_pp integer array: ``sigma[i][j]`` is the device holding stage j of pipeline i;
column j is the data-parallel group C_j of stage j.

Derivation of the two terms (seconds; α in ms, c in GB, β in Gbit/s, so a transfer of c GB takes 8c/β s):

Data parallelism, DP(σ) = max_j max_{d∈C_j} Σ_{d'∈C_j, d'≠d} (α_dd' + α_d'd) + 8·c_DP/D_dp · (1/β_dd' + 1/β_d'd).
    Each stage's gradients (c_DP) are all-reduced in its group C_j of D_dp devices by a sharded all-reduce:
    every device owns a 1/D_dp shard, reduce-scatter sends each peer the slice of its gradients that peer
    owns, all-gather sends each peer the reduced slice it owns. So device d exchanges one 1/D_dp shard with
    every other member, once in each phase, one peer after another: Σ over peers of (delay + shard / β).
    With symmetric links the two directions are the paper's factor 2 · (α + c_DP/(D_dp·β)). The groups run
    in parallel and a step waits for the slowest device of the slowest group: the two maxima.

Pipeline parallelism, PP(σ) = Σ_{s=0}^{D_pp−2} max_i (α_ab + α_ba) + 8·c_PP · (1/β_ab + 1/β_ba), (a, b) =
(σ[i][s], σ[i][s+1]).
    Each shard's activations (c_PP) cross the boundary between stages s and s+1 forward (a→b), and their
    gradients come back (b→a): with symmetric links the paper's 2 · (α + c_PP/β). All pipelines cross
    boundary s at the same time, so the boundary takes as long as its slowest pipeline; the boundaries
    follow one another (the paper ignores overlap with compute), so they add up.

cost(σ) = DP(σ) + PP(σ). Compute is not modelled (neither does the paper's).

The scheduler does not hard-code this formula: it searches any ``Objective`` that decomposes like it —
a value per stage group (depends only on the group's members), a value per hop (the max over pipelines
of a per-link cost ``hop_link_s[a, b]``), and a ``combine`` that is non-decreasing in every argument.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from p2ptrain.planning.cluster import Cluster
from p2ptrain.planning.workload import Workload

GBIT_PER_GB = 8.0


@dataclass(frozen=True)
class CostBreakdown:
    """A plan's predicted communication time per iteration, in seconds, split by kind."""

    cost_s: float
    data_parallel_s: float
    pipeline_s: float


class Objective(Protocol):
    """What the scheduler minimises. See the module docstring for the decomposition it must have."""

    name: str
    num_stages: int
    num_replicas: int
    hop_link_s: np.ndarray  # N×N: the cost of one pipeline's link a→b at one stage boundary

    def group_terms(self, members: np.ndarray) -> np.ndarray:
        """Per-member values whose maximum is the value of the stage group ``members``."""
        ...

    def combine(self, group_values: Sequence[float], hop_values: Sequence[float]) -> CostBreakdown:
        """The cost of a plan from its groups' values (stage order) and its hops' bottleneck values."""
        ...

    def evaluate(self, assignment: np.ndarray) -> CostBreakdown:
        """The exact cost of an assignment (D_dp × D_pp device indices)."""
        ...


def link_cost_s(cluster: Cluster, volume_gb: float) -> np.ndarray:
    """N×N: seconds to send ``volume_gb`` a→b and the same back b→a (zero on the diagonal)."""
    alpha_s = cluster.latency_ms / 1000.0
    with np.errstate(divide="ignore", invalid="ignore"):  # on the diagonal, which is ignored
        one_way = alpha_s + GBIT_PER_GB * volume_gb / cluster.bandwidth_gbps
    both = one_way + one_way.T
    np.fill_diagonal(both, 0.0)
    both.setflags(write=False)
    return both


class DtfmObjective:
    """The paper's objective (named after its code, DT-FM): communication time DP(σ) + PP(σ)."""

    name = "dtfm"

    def __init__(self, cluster: Cluster, workload: Workload, num_stages: int):
        self.num_stages = num_stages
        self.num_replicas = replicas_of(cluster.num_devices, num_stages)
        self.hop_link_s = link_cost_s(cluster, workload.activation_gb)
        # one 1/D_dp shard exchanged with a peer, both ways
        self.pair_dp_s = link_cost_s(cluster, workload.gradient_gb / self.num_replicas)

    def group_terms(self, members: np.ndarray) -> np.ndarray:
        return self.pair_dp_s[np.ix_(members, members)].sum(axis=1)

    def combine(self, group_values: Sequence[float], hop_values: Sequence[float]) -> CostBreakdown:
        dp = float(max(group_values))
        pp = float(sum(hop_values))
        return CostBreakdown(cost_s=dp + pp, data_parallel_s=dp, pipeline_s=pp)

    def evaluate(self, assignment: np.ndarray) -> CostBreakdown:
        sigma = check_assignment(assignment, self.num_replicas, self.num_stages, len(self.hop_link_s))
        cols = sigma.T  # S × D
        group_values = self.pair_dp_s[cols[:, :, None], cols[:, None, :]].sum(axis=2).max(axis=1)
        hop_values = self.hop_link_s[sigma[:, :-1], sigma[:, 1:]].max(axis=0) if self.num_stages > 1 else []
        return self.combine(group_values, hop_values)


def replicas_of(num_devices: int, num_stages: int) -> int:
    """D_dp for ``num_devices`` in ``num_stages`` stages; ValueError unless the stages are of equal size."""
    if num_stages <= 0 or num_devices % num_stages:
        raise ValueError(f"{num_devices} devices cannot be split into {num_stages} stages of equal size")
    return num_devices // num_stages


def check_assignment(assignment: np.ndarray, num_replicas: int, num_stages: int, num_devices: int) -> np.ndarray:
    """The assignment as an int array, after checking it is a D_dp × D_pp table of distinct devices."""
    sigma = np.asarray(assignment, dtype=np.intp)
    if sigma.shape != (num_replicas, num_stages):
        raise ValueError(f"assignment has shape {sigma.shape}, expected ({num_replicas}, {num_stages})")
    if sorted(sigma.ravel().tolist()) != list(range(num_devices)):
        raise ValueError("assignment must use every device exactly once")
    return sigma
