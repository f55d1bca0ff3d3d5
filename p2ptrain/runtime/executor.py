"""One stage of one pipeline, for one step: a pipeline schedule, then the group's all-reduce.

Schedule of a step on the peer holding (stage j, replica i), with M micro-batches, in the order of
``schedule.schedule_ops`` (``gpipe``: every forward then every backward; ``1f1b``: at most S − j micro-batches
in flight):

* forward of micro-batch m: stage 0 embeds its own tokens (every peer derives the global batch of the step
  from the seed, so tokens never travel); later stages receive activations from stage j−1 of the same
  pipeline; all but the last send their output to stage j+1; the last computes the micro-batch loss of
  ``p2ptrain.model.loss`` (token CE summed, over the global batch's token count);
* backward of micro-batch m: the last stage back-propagates its loss, the others the gradient received
  from stage j+1; all but stage 0 send the gradient of their input back to stage j−1;
* the stage's gradients (and, on the last stage, the summed loss) are summed over the replica group with the
  sharded all-reduce, bucket by bucket (``buckets``): with ``overlap`` each bucket starts during the last
  backward as soon as its gradients are final (on stages after 0, once the input's gradient of that backward
  is handed to the link: it is what the stage before waits for); then the optimizer steps. Every replica applies the same sum,
  so replicas stay bit-identical;
* with clipping (``clip`` > 0, ``model.clip``): the stage's squared gradient norm goes to every other stage
  of its pipeline (kind ``grad_norm``, one float32 each) and theirs come back; every peer adds the S
  values in stage order and scales its gradients by the same coefficient before the update. The last
  stages finish their backward first, so their values wait at stage 0 and stage 0's reaches the others
  while they would wait for the next step's first activation anyway.

Tensors travel in the run's wire format (``wire``): activations, activation gradients and data-parallel
gradients each by their codec; ``fp32`` sends today's tensors unchanged. Sends are asynchronous: compute
never waits for a send, only for what it receives. The executor measures its saved activations
(``memory.ActivationMeter``) and reports the step's peak.

The executor knows nothing of libp2p: it talks to a ``StepLink`` bound to (run, epoch, step).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from p2ptrain.futures import wait_all
from p2ptrain.model.clip import clip_coefficient, scale_gradients, squared_norm, total_norm
from p2ptrain.model.data import TrainData, inputs_and_targets, micro_batches, shard_of
from p2ptrain.model.loss import micro_batch_loss
from p2ptrain.model.lr_schedule import set_lr
from p2ptrain.model.outer import DiLoCoConfig
from p2ptrain.net.transport.messages import MessageKind
from p2ptrain.runtime.buckets import BucketedAllReduce
from p2ptrain.runtime.compute_speed import NO_PACING, ComputePacer
from p2ptrain.runtime.link import GroupOverLink, StepLink
from p2ptrain.runtime.memory import ActivationMeter
from p2ptrain.runtime.outer_rounds import OuterRounds
from p2ptrain.runtime.schedule import FORWARD, schedule_ops
from p2ptrain.runtime.topology import Role, Topology
from p2ptrain.runtime.wire import WireError, wire_format

logger = logging.getLogger(__name__)


DEFAULT_BUCKET_ELEMENTS = 1 << 18  # gradient elements per all-reduce bucket: 1 MiB of fp32


@dataclass(frozen=True)
class StepOutcome:
    step: int
    loss: float | None  # the global mean loss, known on the last stage only
    peak_activation_bytes: int = 0  # saved-for-backward bytes held at once (``memory.ActivationMeter``)
    peak_in_flight: int = 0  # micro-batches forwarded and not yet back-propagated, at most at once
    waits: StepWaits | None = None  # where the step waited (None: not measured)


@dataclass(frozen=True)
class StepWaits:
    """Seconds a step's thread spent waiting, not computing: for a message from the pipeline (``recv_s``), for
    the data-parallel all-reduce after the last backward and the clipping norms (``reduce_s``), for its own sends at the end
    (``send_s``). A step's time is about its compute, these, and the rest (encoding, hand-offs)."""

    recv_s: float = 0.0
    reduce_s: float = 0.0
    send_s: float = 0.0


class StageExecutor:
    """Holds a stage module and its optimizer; runs steps for one role of one topology."""

    def __init__(
        self,
        module: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        data: TrainData,
        num_micro_batches: int,
        boundary_width: int,
        pacer: ComputePacer = NO_PACING,
        wire: str = "fp32",
        schedule: str = "gpipe",
        overlap: bool = True,
        bucket_elements: int = DEFAULT_BUCKET_ELEMENTS,
        learning_rate: Callable[[int], float] | None = None,
        clip: float = 0.0,
        diloco: DiLoCoConfig | None = None,
        total_steps: int = 0,
    ):
        self.clip = clip  # the global-norm threshold (``model.clip``); 0: none
        self.last_grad_norm: float | None = None  # the global norm before clipping, of the last step
        self.learning_rate = learning_rate  # the rate of each step's update (``model.lr_schedule``); None: as built
        self.pacer = pacer  # emulated compute speed (``compute_speed``): forward, backward, update stretched
        self.module = module
        self.optimizer = optimizer
        self.data = data
        self.num_micro_batches = num_micro_batches
        self.boundary_width = boundary_width  # values a token carries across a stage boundary
        self.wire = wire_format(wire)
        schedule_ops(schedule, 1, 0, 1)  # ValueError for an unknown name
        self.schedule = schedule
        self.overlap = overlap
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.device = self.params[0].device if self.params else torch.device("cpu")
        self.reducer = BucketedAllReduce(self.params, bucket_elements, self.wire.gradient)
        self.meter = ActivationMeter(self.params)
        self.before_update: Callable[[], None] | None = None  # called before the optimizer changes anything
        # DiLoCo (``model.outer``): no all-reduce per step; every round's end, the group averages pseudo-gradients
        self.rounds = OuterRounds(module, self.params, self.reducer, diloco, total_steps) if diloco is not None else None
        self.outer = self.rounds.outer if self.rounds is not None else None  # the outer optimizer's state
        self.parts = self.rounds.parts if self.rounds is not None else []  # each fragment's parameter indices

    def run_step(self, step: int, role: Role, topology: Topology, link: StepLink) -> StepOutcome:
        micro = self._micro_batches(step, role)
        rows, seq_len = micro[0].shape[0], micro[0].shape[1] - 1
        state = _StepState(role, topology.prev_peer(role), topology.next_peer(role), link, (rows, seq_len, self.boundary_width))
        # the loss's denominator: the global batch's tokens, or with DiLoCo the pipeline's own shard's
        state.tokens = self.data.tokens_per_batch // (role.num_replicas if self.outer is not None else 1)
        state.step = step
        every_step = role.num_replicas > 1 and self.outer is None
        self.optimizer.zero_grad(set_to_none=False)
        if self.learning_rate is not None:
            set_lr(self.optimizer, self.learning_rate(step))
        self.meter.reset(self.params)
        group = topology.group(role.stage)
        if every_step:
            self.reducer.begin(role.replica, role.num_replicas, lambda b: GroupOverLink(link, group, b))
        backwards_left = len(micro)
        try:
            for op, m in schedule_ops(self.schedule, role.num_stages, role.stage, len(micro)):
                if op == FORWARD:
                    self._forward(state, m, micro[m])
                    continue
                backwards_left -= 1
                last = backwards_left == 0 and self.overlap and every_step
                if last:  # this backward makes the gradients final; the input's gradient leaves before the buckets
                    self.reducer.arm(hold=not role.is_first)
                self._backward(state, m)
                if last and not role.is_first:
                    self.reducer.release()
            loss = self._all_reduce_and_step(role, topology, state)
        except BaseException:
            self.reducer.abandon()  # no hook of a later step may act for this one
            raise
        finally:
            started = time.perf_counter()
            wait_all(state.sends)
            state.send_s = time.perf_counter() - started
        return StepOutcome(step, loss, self.meter.peak_bytes, state.peak_in_flight,
                           StepWaits(state.recv_s, state.reduce_s, state.send_s))

    def _forward(self, state: _StepState, m: int, tokens: torch.Tensor) -> None:
        role, link = state.role, state.link
        inputs_m, targets = inputs_and_targets(tokens)
        if role.is_first:
            x = inputs_m.to(self.device)
            state.inputs[m] = None
        else:
            codec = self.wire.activation
            shape, dtype = codec.wire_spec(state.act_shape)
            received = state.recv(state.prev_peer, MessageKind.ACTIVATION, m, shape, dtype)
            x = codec.decode(received, state.act_shape).to(self.device)
            x.requires_grad_(True)
            state.inputs[m] = x
        with self.pacer.compute(), self.meter.saving():
            out = self.module(x, inputs_m.to(self.device))  # the token ids: a subspace model lifts with them
            if role.is_last:
                out = micro_batch_loss(out, targets.to(self.device), state.tokens)
        if not role.is_last:
            state.sends.append(link.send(state.next_peer, MessageKind.ACTIVATION, m, 0,
                                         self.wire.activation.encode(out.detach())))
        state.outputs[m] = out
        state.peak_in_flight = max(state.peak_in_flight, len(state.outputs))

    def _backward(self, state: _StepState, m: int) -> None:
        role, link = state.role, state.link
        out = state.outputs.pop(m)
        if role.is_last:
            with self.pacer.compute():
                out.backward()
            state.loss_sum += out.detach().cpu()
        else:
            codec = self.wire.activation_grad
            shape, dtype = codec.wire_spec(state.act_shape)
            received = state.recv(state.next_peer, MessageKind.ACTIVATION_GRAD, m, shape, dtype)
            grad = codec.decode(received, state.act_shape)
            with self.pacer.compute():
                out.backward(grad.to(self.device))
        x = state.inputs.pop(m)  # this micro-batch's activations are freed with its graph
        if not role.is_first:
            state.sends.append(link.send(state.prev_peer, MessageKind.ACTIVATION_GRAD, m, 0,
                                         self.wire.activation_grad.encode(x.grad.detach())))

    def _micro_batches(self, step: int, role: Role) -> list[torch.Tensor]:
        shard = shard_of(self.data.global_batch(step), role.replica, role.num_replicas)
        return micro_batches(shard, self.num_micro_batches)

    def _all_reduce_and_step(self, role: Role, topology: Topology, state: _StepState) -> float | None:
        loss_sum = state.loss_sum
        loss = float(loss_sum) if role.is_last else None
        if role.num_replicas > 1 and self.rounds is None:
            started = time.perf_counter()
            loss = self.reducer.finish(loss_sum if role.is_last else None)
            state.reduce_s = time.perf_counter() - started
        with torch.no_grad():
            for p in self.params:
                if p.grad is None:
                    p.grad = p.new_zeros(p.shape)
        if self.clip > 0:
            started = time.perf_counter()
            self._clip(role, topology, state)
            state.reduce_s += time.perf_counter() - started
        with self.pacer.compute(), torch.no_grad():
            if self.before_update is not None:
                self.before_update()  # e.g. a copy of the last state still reading the parameters
            self.optimizer.step()
        if self.rounds is not None:
            started = time.perf_counter()
            self.rounds.after_update(role, topology, state.link, state.step)
            state.reduce_s += time.perf_counter() - started
        return loss  # DiLoCo: this pipeline's own loss (the run's is the mean over the pipelines)

    def mean_pending(self, done: int) -> bool:
        """Whether a DiLoCo mean of a round that ended at or before state ``done`` is still in flight."""
        return self.rounds is not None and self.rounds.mean_pending(done)

    def settle_outer(self, fragment: int | None = None) -> None:
        """Wait for DiLoCo's all-reduces in flight (``OuterRounds.settle``)."""
        if self.rounds is not None:
            self.rounds.settle(fragment)

    def _clip(self, role: Role, topology: Topology, state: _StepState) -> None:
        """Scale the gradients by the global-norm coefficient, the stages' squared norms exchanged."""
        scaler = getattr(self.module, "loss_scaler", None)
        own = squared_norm(self.params, scaler.scale if scaler is not None else 1.0)
        row = topology.pipelines[role.replica]
        message = torch.tensor([own], dtype=torch.float32)
        for stage, peer in enumerate(row):
            if stage != role.stage:
                state.sends.append(state.link.send(peer, MessageKind.GRAD_NORM, 0, 0, message))
        squared = []
        for stage, peer in enumerate(row):
            if stage == role.stage:
                squared.append(float(message[0]))
                continue
            value = float(state.link.recv(peer, MessageKind.GRAD_NORM, 0, 0, (1,), torch.float32)[0])  # in reduce_s
            if not value >= 0:  # negative or NaN: no stage's squared norm (+inf is an fp16 overflow)
                raise WireError(f"grad_norm message from {peer} holds {value}, not a squared norm")
            squared.append(value)
        self.last_grad_norm = total_norm(squared)
        scale_gradients(self.params, clip_coefficient(self.last_grad_norm, self.clip))


class _StepState:
    """What one step holds between its forwards and backwards."""

    def __init__(self, role: Role, prev_peer: str | None, next_peer: str | None, link: StepLink,
                 act_shape: tuple[int, int, int]):
        self.role, self.prev_peer, self.next_peer, self.link, self.act_shape = role, prev_peer, next_peer, link, act_shape
        self.inputs: dict[int, torch.Tensor | None] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # forward done, backward not yet
        self.sends: list[Future] = []
        self.loss_sum = torch.zeros((), dtype=torch.float32)
        self.tokens = 1  # the loss's denominator (``StageExecutor.run_step``)
        self.step = 0
        self.peak_in_flight = 0
        self.recv_s = self.reduce_s = self.send_s = 0.0  # ``StepWaits``

    def recv(self, peer: str | None, kind: str, m: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        assert peer is not None
        started = time.perf_counter()
        try:
            return self.link.recv(peer, kind, m, 0, shape, dtype)
        finally:
            self.recv_s += time.perf_counter() - started
