"""``SimulatedObjective``: the closed form the search optimises and the exact prediction of a plan
(``docs/simulated.md``, "The closed form"). The closed form has ``cost.Objective``'s decomposition (group
values, bottleneck hop values, a non-decreasing ``combine``) and bounds the simulation from above; ``refine``
puts the search's stage groups in the order the simulation likes best, and ``evaluate`` is the event
simulation (``events``)."""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence

import numpy as np

from p2ptrain.planning.cluster import Cluster
from p2ptrain.planning.cost import GBIT_PER_GB, CostBreakdown, check_assignment, replicas_of
from p2ptrain.planning.matching import bottleneck_matching
from p2ptrain.planning.simulated.events import SimulatedSteps, bucket_shares, simulate_steps
from p2ptrain.planning.simulated.profile import StepProfile, StepWorkload
from p2ptrain.planning.wire_model import step_order
from p2ptrain.planning.workload import Workload

MAX_PERMUTED_STAGES = 6  # ``refine`` tries every stage order up to this many stages (720 simulations)
MAX_REFINE_EVALUATIONS = 400  # beyond, at most this many simulations of exchanged positions
REL_GAIN = 1e-9  # a new order must be better than this, relatively, to replace the current one
MATCHING_SOFTNESS = 0.01  # tie-breaking temperature of the bottleneck matchings, as a fraction of a hop


class SimulatedObjective:
    """Step time of GPipe + sharded all-reduce over per-link FIFOs (docs/simulated.md)."""

    name = "simulated"

    def __init__(self, cluster: Cluster, workload: Workload, num_stages: int):
        profile = workload.step if isinstance(workload, StepWorkload) else StepProfile()
        self.profile = profile
        self.num_stages = num_stages
        self.num_replicas = replicas_of(cluster.num_devices, num_stages)
        self.micro_batches = profile.micro_batches
        self._links(cluster)
        self._volumes(workload)
        self._codecs(workload)
        self._recompute_check()
        self.forward_s = profile.per_stage("forward_s", num_stages, 0.0)
        self.backward_s = profile.per_stage("backward_s", num_stages, 0.0)
        self.update_s = profile.per_stage("update_s", num_stages, 0.0)
        # the sum check's own work between its rounds (every-step sync only, as its messages)
        self.verify_compute_s = profile.per_stage("verify_compute_s", num_stages, 0.0) * (profile.sync_every == 1)
        self.slowdown = _slowdown(cluster, profile.reference_tflops)
        self._closed_form()

    def _links(self, cluster: Cluster) -> None:
        """Each pair's delay and seconds per GB; each device's access links (``docs/simulated.md``, "Links")."""
        n = cluster.num_devices
        off = ~np.eye(n, dtype=bool)
        # seconds a message takes to arrive after it starts (α + o), and seconds per GB on the link (8/β)
        self.delay_s = np.where(off, cluster.latency_ms / 1000.0 + self.profile.message_s, 0.0)
        with np.errstate(divide="ignore"):
            self.s_per_gb = np.where(off, GBIT_PER_GB / np.where(off, cluster.bandwidth_gbps, 1.0), 0.0)
        # access links: seconds per GB through each device's uplink and downlink (0 where it has none), and
        # a message's seconds per GB on its path, the pair's or the sender's uplink, whichever is slower
        self.access = cluster.has_access_links
        self.has_up, self.up_s_per_gb = _access(cluster.uplink_gbps, n)
        self.has_down, self.down_s_per_gb = _access(cluster.downlink_gbps, n)
        self.send_s_per_gb = self.s_per_gb
        if self.access:
            self.send_s_per_gb = np.maximum(self.s_per_gb, self.up_s_per_gb[:, None] * off)
        # a message alone on its path: the pair, the sender's uplink and the receiver's downlink
        self._alone_s_per_gb = (np.maximum(self.send_s_per_gb, self.down_s_per_gb[None, :] * off) if self.access
                                else self.s_per_gb)

    def _volumes(self, workload: Workload) -> None:
        """What each message carries on the wire, the all-reduce's buckets and the schedule's order."""
        profile, s, m = self.profile, self.num_stages, self.micro_batches
        act_factor, grad_factor, dp_factor = profile.factors
        self.activation_gb = workload.activation_gb / m * act_factor  # one micro-batch's activations, as sent
        self.activation_grad_gb = workload.activation_gb / m * grad_factor  # ... and their gradients
        self.gradient_gb = profile.per_stage("gradient_gb", s, workload.gradient_gb) * dp_factor
        self._workload_gradient_gb = self.gradient_gb / dp_factor if dp_factor else self.gradient_gb
        shares = bucket_shares(self._workload_gradient_gb, profile.bucket_gb)
        self.buckets = shares.shape[1]
        self.bucket_share = shares  # [stage, bucket]: the bucket's part of the stage's gradients (0: no bucket)
        self.bucket_ready = np.cumsum(shares, axis=1)  # ... how far through the last backward it is ready
        self.overlap = profile.bucket_gb > 0
        self.order = step_order(profile.schedule, s, m)

    def _codecs(self, workload: Workload) -> None:
        """The codecs' CPU time (``docs/simulated.md``, "Codecs")."""
        s, d = self.num_stages, self.num_replicas
        enc_act, enc_grad, enc_dp = self.profile.encode_s_per_gb
        dec_act, dec_grad, dec_dp = self.profile.decode_s_per_gb
        # a stage's per micro-batch, on its compute thread ...
        volume_gb = workload.activation_gb / self.micro_batches  # one micro-batch's activations before the wire
        receives, sends = np.arange(s) > 0, np.arange(s) < s - 1  # stages that receive activations, that send them
        self.codec_forward_s = volume_gb * (dec_act * receives + enc_act * sends)
        self.codec_before_backward_s = volume_gb * dec_grad * sends  # the gradient received, decoded
        self.codec_after_backward_s = volume_gb * enc_grad * receives  # the input's gradient, encoded
        # ... and each all-reduce bucket's, per member: [stage, bucket]
        bucket_shard_gb = self._workload_gradient_gb[:, None] * self.bucket_share / d
        self.rs_encode_s = (d - 1) * enc_dp * bucket_shard_gb  # its shards, before they are handed over
        self.rs_decode_s = (d - 1) * dec_dp * bucket_shard_gb  # the owner's, of the shards it sums
        self.ag_encode_s = (d > 1) * enc_dp * bucket_shard_gb  # the owner's, of the sum
        self.ag_decode_s = (d - 1) * dec_dp * bucket_shard_gb  # every member's, of the others' sums

    def _recompute_check(self) -> None:
        """The recompute check (steps 1–2) where the runtime installs it: a device computes 1 + ρ times its stage's
        forwards and backwards; a member reveals ρ·M micro-batches' messages, 2 or (middle stages) 4 of each."""
        s, d, profile = self.num_stages, self.num_replicas, self.profile
        self._rho = profile.recompute_rate if d > 1 and s > 1 and profile.sync_every == 1 else 0.0
        self.recompute_factor = 1.0 + self._rho
        # where the recompute check runs, the sum check of each step runs in the next one's shadow too
        # (``verify.sum_shadow``): its rounds from that step's start, waited for before its update
        self.sum_shadow = self._rho > 0
        neighbours = (np.arange(s) > 0).astype(float) + (np.arange(s) < s - 1)
        # in the simulated steps each member reveals its ⌈ρ·M⌉ micro-batches a step: a step waits for its slowest
        # pipeline, and with a few members one of them is challenged most steps (8 at ρ·M = 1/4: 90 % of steps),
        # its reveal on its uplink ahead of its pipeline's messages; the mean ρ·M would price that step too short
        challenged = math.ceil(self._rho * self.micro_batches - 1e-9)
        self.reveal_gb = challenged * neighbours * (self.activation_gb + self.activation_grad_gb)  # [stage]

    def _closed_form(self) -> None:
        """The terms of the closed form (``docs/simulated.md``, "The closed form")."""
        s, d, profile, alone = self.num_stages, self.num_replicas, self.profile, self._alone_s_per_gb
        off = ~np.eye(len(self.delay_s), dtype=bool)
        forward = self.delay_s + self.activation_gb * alone
        backward = self.delay_s + self.activation_grad_gb * alone
        hop = forward + backward.T
        hop = (hop + hop.T) / 2  # symmetric (it is already when links are; only formats differ by direction)
        np.fill_diagonal(hop, 0.0)
        hop.setflags(write=False)
        self.hop_link_s = hop
        shard_gb = self.gradient_gb.max() / d
        pair_dp = self.delay_s + shard_gb * alone
        if self.access and d > 2:  # each shard behind its phase's D − 2 others at both ends
            pair_dp = pair_dp + shard_gb * (d - 2) * (self.up_s_per_gb[:, None] + self.down_s_per_gb[None, :])
        # the codecs' time of the largest stage's exchange (its buckets' in a row), half on each of a member's terms
        codec_dp = float((self.rs_encode_s + self.rs_decode_s + self.ag_encode_s + self.ag_decode_s).sum(axis=1).max())
        if self._rho > 0:  # the largest stage's reveal, alone on the pair (docs/simulated.md: the closed form's bound)
            pair_dp = pair_dp + float(self.reveal_gb.max()) * alone
        self._pair_dp_s = np.where(off, pair_dp + codec_dp / 2, 0.0)
        worst = float(self.slowdown.max())
        self._compute_s = ((self.forward_s + self.backward_s) * worst * self.recompute_factor + self.codec_forward_s
                           + self.codec_before_backward_s + self.codec_after_backward_s)
        self._update_s = self.update_s * worst
        self._clip_s = float(self.delay_s.max()) if profile.clip and s > 1 else 0.0
        # the sum check's rounds (every step only): each a message from every other member, behind each other
        self._verify_s = sum(float((self.delay_s + gb * (d - 1) * alone).max()) for gb in profile.verify_gb
                             if gb > 0 and d > 1)
        if d > 1:  # and its own work between them, the slowest stage's
            self._verify_s += float(self.verify_compute_s.max())
        if self.sum_shadow:  # in the next step's shadow: off the step's path unless it outlasts the step
            self._verify_s = 0.0
        links = hop[off]
        self._tau = MATCHING_SOFTNESS * (float(np.median(links)) if links.size else 1.0) or 1.0

    # -- the closed form the search optimises ---------------------------------------------------------------

    def group_terms(self, members: np.ndarray) -> np.ndarray:
        sub = self._pair_dp_s[np.ix_(members, members)]  # sub[i, k]: member i → member k
        return sub.max(axis=0) + sub.max(axis=1)

    def combine(self, group_values: Sequence[float], hop_values: Sequence[float]) -> CostBreakdown:
        compute = self._compute_s
        hops = [float(h) for h in hop_values]
        bottleneck = max(float(compute.max()), max(hops, default=0.0))
        pipeline = float(compute.sum()) + sum(hops) + (self.micro_batches - 1) * bottleneck
        h = self.profile.sync_every  # DiLoCo: one all-reduce a round
        if self.profile.sync_overlap:  # streamed: the round's all-reduce runs beside the next round's steps
            local = pipeline + float(self._update_s.max()) + self.profile.boundary_s + self._clip_s
            step = max(local, max(float(g) for g in group_values) / self.profile.streamed_steps)
            return CostBreakdown(cost_s=step, data_parallel_s=step - pipeline, pipeline_s=pipeline)
        data_parallel = max(float(g) / h + float(u) for g, u in zip(group_values, self._update_s, strict=True))
        data_parallel += self.profile.boundary_s + self._clip_s + self._verify_s
        return CostBreakdown(cost_s=pipeline + data_parallel, data_parallel_s=data_parallel, pipeline_s=pipeline)

    # -- the stage order, under the exact simulation ---------------------------------------------------------

    def refine(self, assignment: np.ndarray) -> np.ndarray:
        """The assignment's stage groups in the stage order the simulation likes best (pipelines re-matched).

        The closed form does not see where a group sits, the simulation does: a slow all-reduce late in
        the pipeline overlaps the backward pass still running through the earlier stages, one at stage 0
        does not (on the "spot" network of 8 devices, Megatron's order is 1.4 times faster than its mirror). So
        the search's groups are put in their best order: every order up to ``MAX_PERMUTED_STAGES`` stages,
        beyond that the mirror image and pairwise exchanges of positions, first improvement, at most
        ``MAX_REFINE_EVALUATIONS`` simulations.
        """
        sigma = check_assignment(assignment, self.num_replicas, self.num_stages, len(self.hop_link_s))
        s = self.num_stages
        if s == 1:
            return sigma
        groups = [sigma[:, j] for j in range(s)]
        best_order, best = tuple(range(s)), self.simulate(sigma).predicted_s
        if s <= MAX_PERMUTED_STAGES:
            for order in itertools.permutations(range(s)):
                cost = self.simulate(self._chain(groups, order)).predicted_s
                if cost < best * (1 - REL_GAIN):
                    best_order, best = order, cost
            return self._chain(groups, best_order) if best_order != tuple(range(s)) else sigma
        evaluations, improved = 0, True
        candidates = [tuple(reversed(best_order))]
        while improved and evaluations < MAX_REFINE_EVALUATIONS:
            improved = False
            for order in candidates:
                evaluations += 1
                cost = self.simulate(self._chain(groups, order)).predicted_s
                if cost < best * (1 - REL_GAIN):
                    best_order, best, improved = order, cost, True
                    break
            candidates = [_swapped(best_order, a, b) for a in range(s) for b in range(a + 1, s)]
        return self._chain(groups, best_order) if best_order != tuple(range(s)) else sigma

    def _chain(self, groups: list[np.ndarray], order: Sequence[int]) -> np.ndarray:
        """Pipelines through ``groups`` in ``order``: one bottleneck matching of ``hop_link_s`` per hop."""
        current = groups[order[0]]
        columns = [current]
        for g in order[1:]:
            nxt = groups[g]
            _, _, cols = bottleneck_matching(self.hop_link_s[np.ix_(current, nxt)], self._tau)
            current = nxt[cols]
            columns.append(current)
        return np.stack(columns, axis=1)

    # -- the exact event simulation -------------------------------------------------------------------------

    def evaluate(self, assignment: np.ndarray) -> CostBreakdown:
        sim = self.simulate(assignment)
        return CostBreakdown(cost_s=sim.predicted_s, data_parallel_s=sim.data_parallel_s, pipeline_s=sim.pipeline_s)

    def simulate(self, assignment: np.ndarray, steps: int | None = None) -> SimulatedSteps:
        """Run ``steps`` (default: the profile's) steps of ``assignment`` through the event model."""
        sigma = check_assignment(assignment, self.num_replicas, self.num_stages, len(self.hop_link_s))
        h = self.profile.sync_every
        if h == 1 or self.num_replicas == 1:
            return simulate_steps(self, sigma, steps or self.profile.steps)
        local = simulate_steps(self, sigma, steps or self.profile.steps, all_reduce=False)
        if self.profile.sync_overlap:
            # the τ steps that carry the round's all-reduce are this much longer, so is the round
            extra = self.profile.streamed_steps * max(0.0, self.streamed_floor_s(sigma) - local.predicted_s)
        else:  # the round's end: its all-reduce after the clip and the update
            synced = simulate_steps(self, sigma, steps or self.profile.steps, round_end=True)
            extra = max(0.0, synced.predicted_s - local.predicted_s)
        return dataclasses.replace(local, data_parallel_s=local.data_parallel_s + extra / h, sync_every=h,
                                   sync_extra_s=extra)

    def streamed_floor_s(self, assignment: np.ndarray) -> float:
        """The busiest queue's seconds per step with a DiLoCo round's all-reduce streamed over its H steps
        (``sync_overlap``, docs/simulated.md): each queue's share of one step's bytes, pipeline and 1/H of the
        round's shards (2·(D−1) shards of g_j/D out of and into every member of stage j's group)."""
        sigma = check_assignment(assignment, self.num_replicas, self.num_stages, len(self.hop_link_s))
        d, m, n = self.num_replicas, self.micro_batches, len(self.hop_link_s)
        pair_gb = np.zeros((n, n))  # GB a step sends a→b
        a, b = sigma[:, :-1], sigma[:, 1:]
        pair_gb[a, b] += m * self.activation_gb
        pair_gb[b, a] += m * self.activation_grad_gb
        if d > 1:
            cols = sigma.T  # [j, i]
            shards = (2 * self.gradient_gb / d / self.profile.streamed_steps)[:, None, None]
            pair_gb[cols[:, :, None], cols[:, None, :]] += np.where(np.eye(d, dtype=bool)[None], 0.0, shards)
        busiest = float((pair_gb * self.send_s_per_gb).max())
        if self.access:
            busiest = max(busiest, float((pair_gb.sum(axis=1) * self.up_s_per_gb).max()),
                          float((pair_gb.sum(axis=0) * self.down_s_per_gb).max()))
        return busiest

    def compute_s(self, assignment: np.ndarray) -> float:
        """The busiest device's compute per step: M forwards and backwards of its stage and its update, at its
        speed (a plan's compute utilisation is this over its step time; the recompute check's is left out: it
        trains nothing)."""
        sigma = check_assignment(assignment, self.num_replicas, self.num_stages, len(self.hop_link_s))
        per_stage = self.micro_batches * (self.forward_s + self.backward_s) + self.update_s
        return float((per_stage[None, :] * self.slowdown[sigma]).max())


def _swapped(order: tuple[int, ...], a: int, b: int) -> tuple[int, ...]:
    out = list(order)
    out[a], out[b] = out[b], out[a]
    return tuple(out)


def _access(capacity_gbps: np.ndarray | None, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Which devices have this access link, and its seconds per GB (0 where they have none)."""
    if capacity_gbps is None:
        return np.zeros(n, dtype=bool), np.zeros(n)
    has = np.isfinite(capacity_gbps)
    return has, np.where(has, GBIT_PER_GB / capacity_gbps, 0.0)


def _slowdown(cluster: Cluster, reference_tflops: float | None) -> np.ndarray:
    """Per device: how many times longer than the reference device it computes (1 when unknown)."""
    if reference_tflops is None:
        return np.ones(cluster.num_devices)
    return np.array([reference_tflops / d.tflops if d.tflops else 1.0 for d in cluster.devices])
