"""The queues of a simulation over access links (``docs/simulated.md``, "Access links"): each device's uplink
and downlink in front of its pairs' FIFOs, the all-reduce's shards and the pipeline's messages in hand-over
order on every uplink and arrival order on every downlink (``Access``), and the max-plus FIFO they are
computed with (``_fifo``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from p2ptrain.planning.simulated.objective import SimulatedObjective

ALL_REDUCE_ROUNDS = 6  # fixed-point rounds of the all-reduce's link order (``_all_reduce``)


class Access:
    """The queues of a simulation over access links (docs/simulated.md): each slot's uplink and downlink
    (``up_free``, ``down_free``: [pipeline, stage], −inf where the device has none), and the pairs' FIFOs,
    shared with ``simulate_steps`` (its arrays, updated in place)."""

    def __init__(self, obj: SimulatedObjective, sigma: np.ndarray, free_f: np.ndarray, free_b: np.ndarray,
                 free_g: np.ndarray):
        self.obj, self.sigma, self.free_b, self.free_g = obj, sigma, free_b, free_g
        self.up_free = np.full(sigma.shape, -np.inf)
        self.down_free = np.full(sigma.shape, -np.inf)

    def send(self, free: np.ndarray, col: int, j_from: int, j_to: int, gb: float, hand_over: np.ndarray) -> np.ndarray:
        """One message per pipeline from its stage ``j_from`` to ``j_to`` on the pair FIFO ``free[:, col]``,
        through the sender's uplink and the receiver's downlink; returns when each is delivered."""
        obj, up = self.obj, self.up_free
        a, b = self.sigma[:, j_from], self.sigma[:, j_to]
        start = np.maximum(np.maximum(hand_over, free[:, col]), up[:, j_from])
        free[:, col] = start + gb * obj.send_s_per_gb[a, b]
        up[:, j_from] = np.where(obj.has_up[a], start + gb * obj.up_s_per_gb[a], -np.inf)
        return self._receive(b, j_to, start + obj.delay_s[a, b], free[:, col] + obj.delay_s[a, b], gb)

    def reveal(self, j: int, rows: np.ndarray, verifier: np.ndarray, gb: float, at: np.ndarray) -> None:
        """Member ``rows`` of stage j's group sends ``gb`` to member ``verifier`` (a permutation) at ``at``: on the
        group's pair FIFO, the sender's uplink and the receiver's downlink (``simulate_steps``'s ``_reveal``)."""
        obj, up, pair = self.obj, self.up_free, self.free_g[j]
        a, b = self.sigma[rows, j], self.sigma[verifier, j]
        start = np.maximum(np.maximum(at, pair[rows, verifier]), up[:, j])
        pair[rows, verifier] = start + gb * obj.send_s_per_gb[a, b]
        up[:, j] = np.where(obj.has_up[a], start + gb * obj.up_s_per_gb[a], -np.inf)
        first, last = np.empty_like(start), np.empty_like(start)  # by receiving row
        first[verifier], last[verifier] = start + obj.delay_s[a, b], pair[rows, verifier] + obj.delay_s[a, b]
        self._receive(self.sigma[:, j], j, first, last, gb)

    def _receive(self, b: np.ndarray, j_to: int, first: np.ndarray, last: np.ndarray, gb: float) -> np.ndarray:
        """A message per pipeline whose bytes reach stage ``j_to`` from ``first`` to ``last``: delivered once
        its downlink let it through too."""
        obj, down = self.obj, self.down_free
        through = np.maximum(first, down[:, j_to]) + gb * obj.down_s_per_gb[b]
        down[:, j_to] = np.where(obj.has_down[b], through, -np.inf)
        return np.maximum(last, down[:, j_to])

    def all_reduce(self, j: int, last_start: np.ndarray, bwd: np.ndarray, backward_done: np.ndarray,
                   round_end: bool = False) -> tuple[np.ndarray, np.ndarray | None]:
        """Stage j's all-reduce ([pipeline] of its members) over the access links, its last backward pass's
        gradient to stage j − 1 queued among the shards on each uplink: when each member has its gradients
        reduced and its shards taken, and when that gradient is delivered (None at stage 0).

        Each member's messages are its gradient (handed over when the pass is done), a reduce-scatter shard
        of each bucket to every other member (when the bucket is ready: after the gradient at stages after 0)
        and an all-gather shard to each (when
        it has every shard of the bucket it owns). Its uplink serves them in hand-over order, each also
        waiting for its pair's FIFO; each downlink in the order their first bytes come. The all-gather's
        hand-over depends on other members' deliveries: iterated from the buckets' readiness to a fixed point
        (``ALL_REDUCE_ROUNDS`` at most, as ``_all_reduce``); a pair slower than its sender's uplink holds the
        uplink's next messages (FIFO), found by iterating the pair FIFOs and the uplink to a fixed point
        (exact after as many rounds as a member sends messages; usually two). ``round_end``: a DiLoCo round's
        all-reduce, every bucket at ``backward_done`` (the update's end), no gradient among them."""
        obj, sigma = self.obj, self.sigma
        d, k_all = obj.num_replicas, obj.buckets
        me = sigma[:, j]
        valid = obj.bucket_share[j] > 0  # [k]
        if obj.overlap and j == 0 and not round_end:  # later stages hold their buckets until the gradient is sent
            ready = last_start[:, None] + obj.bucket_ready[j][None, :] * bwd[:, None]  # [i, k]
        else:
            ready = np.repeat(backward_done[:, None], k_all, axis=1)
        ready = np.where(valid[None, :], ready, -np.inf)
        gb = np.tile(obj.gradient_gb[j] * obj.bucket_share[j] / d, 2)  # [q]: reduce-scatter k, then all-gather k
        sent = np.tile(valid, 2)[None, None, :] & ~np.eye(d, dtype=bool)[:, :, None]  # [i, r, q]: i → r
        lat = obj.delay_s[me[:, None], me[None, :]][:, :, None]
        pair_s = np.where(sent, gb * obj.send_s_per_gb[me[:, None], me[None, :]][:, :, None], 0.0)
        up_s = np.where(sent, gb * obj.up_s_per_gb[me][:, None, None], 0.0)
        down_s = np.where(sent, gb * obj.down_s_per_gb[me][None, :, None], 0.0)  # at the receiver r
        pair_free = self.free_g[j]  # [i, r]
        has_up = obj.has_up[me]
        # the gradient to stage j − 1 leads each member's queue (column 0); a padding message at stage 0 (and at
        # a round's end)
        tail = j > 0 and not round_end
        prev = sigma[:, j - 1] if tail else me
        tail_gb = obj.activation_grad_gb if tail else 0.0
        tail_pair = tail_gb * obj.send_s_per_gb[me, prev]
        tail_at = backward_done if tail else np.full(d, -np.inf)
        tail_eff = np.maximum(tail_at, self.free_b[:, j - 1]) if tail else tail_at  # its pair's FIFO
        binds = bool((has_up[:, None] & (obj.send_s_per_gb[me[:, None], me[None, :]] > obj.up_s_per_gb[me][:, None])
                      & ~np.eye(d, dtype=bool)).any())  # a pair slower than its sender's uplink
        rs_encoded = ready + obj.rs_encode_s[j][None, :]  # the codecs' time (docs/simulated.md, "Codecs")
        reduced = ready
        for _ in range(ALL_REDUCE_ROUNDS):
            encoded = reduced + obj.ag_encode_s[j][None, :]
            handed = np.where(sent, np.concatenate([rs_encoded, encoded], axis=1)[:, None, :], -np.inf)  # [i, r, q]
            tail_start, shard_start, up_after = self._senders(handed, tail_at, tail_eff, pair_free, pair_s, up_s,
                                                              tail_gb * obj.up_s_per_gb[me], self.up_free[:, j],
                                                              has_up, binds)
            shard_start = np.where(sent, shard_start, -np.inf)
            arrive, down_after = self._receivers(me, j, shard_start + lat, shard_start + pair_s + lat, down_s)
            arrive = np.where(sent, arrive, -np.inf)
            # [owner, k]: every shard of k is in and decoded
            settled = np.maximum(ready, arrive[..., :k_all].max(axis=0) + obj.rs_decode_s[j][None, :])
            if np.array_equal(settled, reduced):
                break
            reduced = settled
        gathered = np.maximum(reduced + obj.ag_encode_s[j][None, :],
                              arrive[..., k_all:].max(axis=0) + obj.ag_decode_s[j][None, :])  # [i, k]
        sends_taken = arrive.max(axis=(1, 2))
        self.free_g[j] = np.maximum(pair_free, np.where(sent, shard_start + pair_s, -np.inf).max(axis=2))
        self.up_free[:, j] = np.where(has_up, up_after, -np.inf)
        self.down_free[:, j] = down_after
        delivered = None
        if tail:
            self.free_b[:, j - 1] = tail_start + tail_pair
            wire = tail_start + obj.delay_s[me, prev]
            delivered = self._receive(prev, j - 1, wire, wire + tail_pair, tail_gb)
        return np.maximum(backward_done, np.maximum(gathered.max(axis=1), sends_taken)), delivered

    def _senders(self, handed: np.ndarray, tail_at: np.ndarray, tail_eff: np.ndarray, pair_free: np.ndarray,
                 pair_s: np.ndarray, up_s: np.ndarray, tail_up_s: np.ndarray, up_free: np.ndarray,
                 has_up: np.ndarray, binds: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """When each member's gradient ([i]) and shards ([i, r, q]; ``handed`` −inf where none is sent) start,
        and its uplink's free time after them. A member without an uplink: each pair's FIFO alone (in
        hand-over order on the pair). With one: its uplink in hand-over order (at equal times the gradient,
        then bucket by bucket each phase's shards to members 0, 1, …, the runtime's order), a message
        starting no sooner than its pair's FIFO lets it (iterated when a pair is slower than the uplink)."""
        d, is_sent = len(handed), np.isfinite(handed)
        pair_order = np.argsort(handed, axis=2, kind="stable")
        alone, _ = _fifo(np.take_along_axis(handed, pair_order, axis=2),
                         np.take_along_axis(pair_s, pair_order, axis=2), pair_free)
        alone = _unsort(alone, pair_order)
        if not has_up.any():
            return tail_eff, alone, np.full(d, -np.inf)

        def queue(x: np.ndarray, first: np.ndarray) -> np.ndarray:  # [i, r, q] → [i, 1 + q·r], the gradient first
            return np.concatenate([first[:, None], x.transpose(0, 2, 1).reshape(d, -1)], axis=1)

        order = np.argsort(queue(handed, tail_at), axis=1, kind="stable")
        service = np.take_along_axis(queue(up_s, tail_up_s), order, axis=1)
        effective = np.where(is_sent, np.maximum(handed, pair_free[:, :, None]), -np.inf)
        for _ in range(service.shape[1]):  # the n-th message in uplink order is exact after n rounds
            begun, after = _fifo(np.take_along_axis(queue(effective, tail_eff), order, axis=1), service, up_free)
            begun = _unsort(begun, order)
            shared = begun[:, 1:].reshape(d, handed.shape[2], d).transpose(0, 2, 1)
            if not binds:
                break
            ends = np.where(is_sent, shared + pair_s, -np.inf)
            in_pair = np.take_along_axis(ends, pair_order, axis=2)  # the pair's FIFO: free after its earlier ones
            before = np.maximum.accumulate(np.concatenate([pair_free[:, :, None], in_pair[..., :-1]], axis=2), axis=2)
            again = np.where(is_sent, np.maximum(handed, _unsort(before, pair_order)), -np.inf)
            if np.array_equal(again, effective):
                break
            effective = again
        up = has_up[:, None, None]
        return np.where(has_up, begun[:, 0], tail_eff), np.where(up, shared, alone), after[:, -1]

    def _receivers(self, me: np.ndarray, j: int, first: np.ndarray, last: np.ndarray, down_s: np.ndarray
                   ) -> tuple[np.ndarray, np.ndarray]:
        """When each shard ([i, r, q], i → r; −inf where none) is delivered: receiver r's downlink serves them
        in the order their first bytes come; and each downlink's free time after them."""
        obj, d = self.obj, len(me)
        has_down = obj.has_down[me]
        if not has_down.any():
            return last, np.full(d, -np.inf)
        first_r, service_r = first.transpose(1, 0, 2).reshape(d, -1), down_s.transpose(1, 0, 2).reshape(d, -1)
        order = np.argsort(first_r, axis=1, kind="stable")
        begun, after = _fifo(np.take_along_axis(first_r, order, axis=1), np.take_along_axis(service_r, order, axis=1),
                             self.down_free[:, j])
        through = _unsort(begun + np.take_along_axis(service_r, order, axis=1), order)
        through = through.reshape(d, d, -1).transpose(1, 0, 2)  # back to [i, r, q]
        delivered = np.where(has_down[None, :, None], np.maximum(last, through), last)
        return delivered, np.where(has_down, after[:, -1], -np.inf)


def _fifo(hand_over: np.ndarray, service_s: np.ndarray, free: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A FIFO queue serving messages in the order of the last axis: message q starts at max(its hand-over,
    when message q − 1 is through) and is through ``service_s`` later; ``free`` is when the queue is free
    before the first. Returns each message's start and the queue's free time after it. The recurrence
    t_q = max(h_q, t_{q−1}) + u_q, unrolled: t_q = C_q + max(free, max_{p≤q}(h_p − C_{p−1})), C the running
    sum of u (max-plus, so it vectorises). A padding message (hand-over −inf, service 0) changes nothing."""
    through = np.cumsum(service_s, axis=-1)
    before = np.concatenate([np.zeros_like(through[..., :1]), through[..., :-1]], axis=-1)
    after = through + np.maximum(free[..., None], np.maximum.accumulate(hand_over - before, axis=-1))
    return np.maximum(hand_over, np.concatenate([free[..., None], after[..., :-1]], axis=-1)), after


def _unsort(values: np.ndarray, order: np.ndarray) -> np.ndarray:
    out = np.empty_like(values)
    np.put_along_axis(out, order, values, axis=-1)
    return out
