"""DiLoCo's rounds on one replica of one stage (``model.outer``): at a round's end the group's mean
pseudo-gradient, then the outer step; with ``overlap`` the round's all-reduce runs in the background during the
next ``tau`` steps and corrects this replica when its mean is in; with fragments each fragment's round ends in
turn (Streaming DiLoCo).

    rounds = OuterRounds(module, params, reducer, diloco, total_steps)
    rounds.after_update(role, topology, link, step)  # the executor, after every optimizer step
    rounds.mean_pending(done)                        # a mean of a round that ended by ``done`` still in flight
    rounds.settle()                                  # wait for every mean in flight (an epoch that stops)

The all-reduce is the stage's own (``buckets.BucketedAllReduce``), in the run's gradient codec with its error
feedback: replicas end every round bit-identical. Plain DiLoCo's sums are checked by the reducer's verifier
(``verify.sum_check``) before the outer step; overlapped or fragmented rounds are not. The executor's thread
calls every method; an overlapped round's all-reduce runs on a thread of this object's own
(``p2ptrain-outer``), whose result only ``settle`` reads.
"""

from __future__ import annotations

import weakref
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from p2ptrain.futures import wait_all
from p2ptrain.model.outer import DiLoCoConfig, OuterOptimizer, fragment_parts
from p2ptrain.runtime.buckets import BucketedAllReduce
from p2ptrain.runtime.link import GroupOverLink, StepLink
from p2ptrain.runtime.topology import Role, Topology


class OuterRounds:
    """DiLoCo's rounds of one stage replica (module docstring)."""

    def __init__(self, module: torch.nn.Module, params: list[torch.nn.Parameter], reducer: BucketedAllReduce,
                 diloco: DiLoCoConfig, total_steps: int):
        self.params, self.reducer, self.diloco, self.total_steps = params, reducer, diloco, total_steps
        self.outer = OuterOptimizer(params, diloco)
        self.parts = _fragments(module, params, diloco)  # each fragment's parameter indices (``model.outer``)
        # ``overlap``, per fragment: its last round's all-reduce, running; the step after whose update its mean
        # corrects us; the state (steps done) that mean completes
        self._in_flight: dict[int, Future] = {}
        self._outer_thread: ThreadPoolExecutor | None = None
        self._correct_at: dict[int, int] = {}
        self._round_end: dict[int, int] = {}

    def after_update(self, role: Role, topology: Topology, link: StepLink, step: int) -> None:
        """After update ``step``: every fragment whose mean in flight is due corrects this replica, then every
        fragment whose round ends takes its outer step."""
        ends = [f for f in range(len(self.parts)) if self.diloco.fragment_ends(f, step, self.total_steps)]
        for f in sorted(self._in_flight):
            if f in ends or step == self._correct_at[f]:
                self._correct(f)
        for f in ends:
            if self.parts[f]:  # a stage may hold none of a fragment
                self._outer_step(f, role, topology, link, step)

    def mean_pending(self, done: int) -> bool:
        """Whether a mean of a round that ended at or before state ``done`` (steps done) is still in flight."""
        return any(end <= done for end in self._round_end.values())

    def _outer_step(self, fragment: int, role: Role, topology: Topology, link: StepLink, step: int) -> None:
        """Fragment ``fragment``'s round end: the group's mean pseudo-gradient (the sharded all-reduce, in the
        run's gradient wire format with its error feedback), then the outer optimizer; replicas end
        bit-identical. With ``overlap`` (``model.outer``): the all-reduce runs in the background for the next
        ``tau`` steps (``_correct`` then applies it), and this replica starts the fragment's next round from the
        outer step of its own pseudo-gradient; the run's last round waits for its own mean."""
        part, outer = self.parts[fragment], self.outer
        deltas = outer.pseudo_gradients(part=part)
        stride, count = len(self.reducer.buckets) + 1, len(self.parts)  # message tags: fragment f's sums use
        if not self.diloco.overlap or step + 1 == self.total_steps:  # f·stride + b, in flight (count + f)·stride + b
            # checked before the outer step (the reducer's verifier, ``verify.sum_check``): plain DiLoCo only, whose
            # round ends are the only all-reduces and happen on this thread; overlapped or fragmented rounds are not
            checked = len(self.parts) == 1 and not self.diloco.overlap
            outer.step(self._group_mean(deltas, role, topology, link, fragment * stride, fragment, part, checked), part)
            return
        correct_at = min(step + self.diloco.tau, step + self.diloco.inner_steps, self.total_steps - 1)
        self._correct_at[fragment], self._round_end[fragment] = correct_at, step + 1
        if role.num_replicas == 1:
            self._in_flight[fragment] = Future()
            self._in_flight[fragment].set_result(deltas)
        else:  # tagged with the step that applies it, past the synchronous rounds' numbers
            if self._outer_thread is None:
                self._outer_thread = ThreadPoolExecutor(1, thread_name_prefix="p2ptrain-outer")
                weakref.finalize(self, self._outer_thread.shutdown, wait=False)
            self._in_flight[fragment] = self._outer_thread.submit(
                self._group_mean, deltas, role, topology, link.for_step(correct_at), (count + fragment) * stride,
                fragment, part)
        starts = outer.tentative(deltas, part)
        for i, start in zip(part, starts, strict=True):
            outer.start[i] = start
        outer.reset(self.params, starts, part)

    def _correct(self, fragment: int) -> None:
        """``overlap``: the fragment's last mean is in (``settle_outer``); move this replica by the anchor minus
        the start it guessed, as if its round had started from the anchor."""
        self.settle(fragment)
        part, outer = self.parts[fragment], self.outer
        starts = [outer.start[i] for i in part]
        if part and all(s is not None for s in starts):
            outer.correct(self.params, starts, part)  # type: ignore[arg-type]
            for i in part:
                outer.start[i] = None

    def settle(self, fragment: int | None = None) -> None:
        """Wait for the all-reduce in flight (``overlap``) of ``fragment`` (default: every fragment's) and move
        the anchor and momentum by its mean: the state of that round's end is then complete (an epoch that
        stops there hands it on)."""
        for f in sorted(self._in_flight) if fragment is None else [fragment]:
            future = self._in_flight.pop(f, None)
            if future is not None:
                self.outer.advance(wait_all([future])[0], self.parts[f])
                del self._correct_at[f], self._round_end[f]

    def _group_mean(self, deltas: list[torch.Tensor], role: Role, topology: Topology, link: StepLink,
                    offset: int, fragment: int = 0, part: list[int] | None = None,
                    checked: bool = False) -> list[torch.Tensor]:
        """The mean of ``deltas`` (of ``part``'s parameters, one fragment's) over the stage's replica group;
        bucket b's messages tagged ``offset + b``; ``checked``: its sums checked by the reducer's verifier."""
        if role.num_replicas == 1:
            return deltas
        group = topology.group(role.stage)
        sums = self.reducer.sum_tensors(deltas, role.replica, role.num_replicas,
                                        lambda b: GroupOverLink(link, group, offset + b), part, fragment,
                                        checked=checked)
        return [s / role.num_replicas for s in sums]


def _fragments(module: torch.nn.Module, params: list[torch.nn.Parameter], diloco: DiLoCoConfig) -> list[list[int]]:
    """The indices into ``params`` of each of DiLoCo's fragments (``model.outer.fragment_parts``)."""
    if diloco.fragments == 1:
        return [list(range(len(params)))]
    names = {p: n for n, p in module.named_parameters()}
    return fragment_parts([names[p] for p in params], diloco.fragments, module.shape.num_layers)
