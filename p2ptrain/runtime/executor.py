"""One stage of one pipeline, for one step: the paper's GPipe schedule, then the group's all-reduce.

Schedule of a step on the peer holding (stage j, replica i), with M micro-batches:

1. forward, micro-batch 0 … M−1: stage 0 embeds its own tokens (every peer derives the global batch of the
   step from the seed, so tokens never travel); later stages receive activations from stage j−1 of the
   same pipeline; all but the last send their output to stage j+1; the last computes the micro-batch loss
   of ``p2ptrain.model.loss`` (token CE summed, over the global batch's token count);
2. backward, micro-batch M−1 … 0: the last stage back-propagates its loss, the others the gradient received
   from stage j+1; all but stage 0 send the gradient of their input back to stage j−1;
3. the stage's gradients (and, on the last stage, the summed loss) are flattened and summed over the
   replica group with the sharded all-reduce; the optimizer steps. Every replica applies the same sum, so
   replicas stay bit-identical.

The executor knows nothing of libp2p: it talks to a ``StepLink`` bound to (run, epoch, step).
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Protocol

import torch

from p2ptrain.model.data import TrainData, inputs_and_targets, micro_batches, shard_of
from p2ptrain.model.loss import micro_batch_loss
from p2ptrain.runtime.allreduce import GroupExchange, flatten, sharded_all_reduce, unflatten_into
from p2ptrain.runtime.compute_speed import NO_PACING, ComputePacer
from p2ptrain.runtime.topology import Role, Topology

logger = logging.getLogger(__name__)

ACTIVATION = "activation"
ACTIVATION_GRAD = "activation_grad"


class StepLink(Protocol):
    """Messages of one step to and from named peers."""

    def send(self, peer: str, kind: str, micro_batch: int, part: int, tensor: torch.Tensor) -> Future: ...

    def recv(
        self, peer: str, kind: str, micro_batch: int, part: int, shape: tuple[int, ...], dtype: torch.dtype
    ) -> torch.Tensor: ...


@dataclass(frozen=True)
class StepOutcome:
    step: int
    loss: float | None  # the global mean loss, known on the last stage only


class _GroupOverLink:
    """Adapts a StepLink to the all-reduce's rank addressing inside stage ``stage``'s group."""

    def __init__(self, link: StepLink, group: tuple[str, ...]):
        self.link, self.group = link, group

    def send(self, to_rank: int, kind: str, part: int, tensor: torch.Tensor) -> Future:
        return self.link.send(self.group[to_rank], kind, 0, part, tensor)

    def recv(self, from_rank: int, kind: str, part: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return self.link.recv(self.group[from_rank], kind, 0, part, (numel,), dtype)


class StageExecutor:
    """Holds a stage module and its optimizer; runs steps for one role of one topology."""

    def __init__(
        self,
        module: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        data: TrainData,
        num_micro_batches: int,
        hidden_size: int,
        pacer: ComputePacer = NO_PACING,
    ):
        self.pacer = pacer  # emulated compute speed (``compute_speed``): forward, backward, update stretched
        self.module = module
        self.optimizer = optimizer
        self.data = data
        self.num_micro_batches = num_micro_batches
        self.hidden_size = hidden_size
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.device = self.params[0].device if self.params else torch.device("cpu")

    def run_step(self, step: int, role: Role, topology: Topology, link: StepLink) -> StepOutcome:
        micro = self._micro_batches(step, role)
        prev_peer, next_peer = topology.prev_peer(role), topology.next_peer(role)
        sends: list[Future] = []
        inputs: list[torch.Tensor | None] = []
        outputs: list[torch.Tensor] = []
        rows, seq_len = micro[0].shape[0], micro[0].shape[1] - 1
        act_shape = (rows, seq_len, self.hidden_size)
        self.optimizer.zero_grad(set_to_none=False)

        for m, tokens in enumerate(micro):
            inputs_m, targets = inputs_and_targets(tokens)
            if role.is_first:
                x = inputs_m.to(self.device)
                inputs.append(None)
            else:
                x = link.recv(prev_peer, ACTIVATION, m, 0, act_shape, torch.float32).to(self.device)
                x.requires_grad_(True)
                inputs.append(x)
            with self.pacer.compute():
                out = self.module(x)
                if role.is_last:
                    out = micro_batch_loss(out, targets.to(self.device), self.data.tokens_per_batch)
            if not role.is_last:
                sends.append(link.send(next_peer, ACTIVATION, m, 0, out.detach().cpu()))
            outputs.append(out)

        loss_sum = torch.zeros((), dtype=torch.float32)
        for m in reversed(range(len(micro))):
            if role.is_last:
                with self.pacer.compute():
                    outputs[m].backward()
                loss_sum += outputs[m].detach().cpu()
            else:
                grad = link.recv(next_peer, ACTIVATION_GRAD, m, 0, act_shape, torch.float32).to(self.device)
                with self.pacer.compute():
                    outputs[m].backward(grad)
            if not role.is_first:
                sends.append(link.send(prev_peer, ACTIVATION_GRAD, m, 0, inputs[m].grad.detach().cpu()))
            outputs[m] = inputs[m] = None  # free the activations of this micro-batch

        loss = self._all_reduce_and_step(role, topology, link, loss_sum)
        for future in sends:
            future.result()
        return StepOutcome(step, loss)

    def _micro_batches(self, step: int, role: Role) -> list[torch.Tensor]:
        shard = shard_of(self.data.global_batch(step), role.replica, role.num_replicas)
        return micro_batches(shard, self.num_micro_batches)

    def _all_reduce_and_step(
        self, role: Role, topology: Topology, link: StepLink, loss_sum: torch.Tensor
    ) -> float | None:
        with self.pacer.compute():
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
            vectors = [g.detach().cpu() for g in grads]
            if role.is_last:
                vectors.append(loss_sum.reshape(1))
            flat = flatten(vectors)
        exchange: GroupExchange = _GroupOverLink(link, topology.group(role.stage))
        total = sharded_all_reduce(flat, role.replica, role.num_replicas, exchange)
        loss = None
        if role.is_last:
            loss = float(total[-1])
            total = total[:-1]
        with self.pacer.compute(), torch.no_grad():
            slots = [p.grad if p.grad is not None else p.new_zeros(p.shape) for p in self.params]
            unflatten_into(total.to(self.device), slots)
            for p, g in zip(self.params, slots, strict=False):
                p.grad = g
            self.optimizer.step()
        return loss
