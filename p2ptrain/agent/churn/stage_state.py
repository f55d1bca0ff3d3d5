"""A stage's training state across epochs: the states an agent keeps, and their transfer between agents.

``StateKeeper`` holds this agent's stage's state (parameters and AdamW moments, ``runtime.checkpoint``'s
names) after each of its last ``keep`` completed steps: what it rolls back to, and what it sends to a peer
that takes over the stage (``restart.py`` says why two suffice).

On the wire a state is one float32 vector: the tensors of ``state_names`` (a fixed order both sides derive
from the stage they build) flattened, sent as messages of kind ``state`` tagged with the new epoch and its
start step, in parts of at most ``PART_NUMEL`` elements (the transport chunks each part). The receiver
knows every shape from its own module, so a state of the wrong size is refused by the transport.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future

import torch

from p2ptrain.errors import MessageRejected, PeerFailed
from p2ptrain.model.outer import OuterOptimizer
from p2ptrain.net.transport.endpoint import Transport
from p2ptrain.net.transport.messages import MessageKind, Refusal, Tag
from p2ptrain.runtime.allreduce import flatten, shard_bounds
from p2ptrain.runtime.checkpoint import ADAM_KEYS, OUTER, PARAM, state_names, state_tensors

logger = logging.getLogger(__name__)

PART_NUMEL = 16 << 20  # 64 MiB of float32 per message
# A receiver refusing a hand-over this long, until the epoch is aborted, is blamed for it (``_Refusals``): an
# honest one takes up a new plan within a poll or two of halting its last epoch.
REFUSED_BLAME_S = 2.0


class StateKeeper:
    """The states of one stage after its last ``keep`` completed steps (CPU copies).

    ``record`` runs on the training thread after every step. From a GPU it only queues the copy, into pinned
    host memory on a stream of its own that starts after the optimizer step, and returns: the next step's
    forward and backward passes run beside it, and ``fence`` (which the trainer calls before its next
    optimizer step, ``StageExecutor.before_update``) makes that update wait for the copy on the device, not
    on the host. A synchronous copy of a GPT-3 XL stage of 151 M parameters (1.8 GB with its moments) took
    0.8-1.5 s a step on an H200 host, where the stage's step took 0.09 s (``benchmarks/keeper_copy.py``).
    ``get`` and ``digest`` wait for the copy they return."""

    def __init__(self, keep: int = 2):
        assert keep >= 1
        self.keep = keep
        self.stage: int | None = None
        self.num_stages: int | None = None
        self._states: OrderedDict[int, dict[str, torch.Tensor]] = OrderedDict()
        self._copying: dict[int, torch.cuda.Event] = {}  # step -> done when its copy is
        self._streams: dict[torch.device, torch.cuda.Stream] = {}  # the copies' own stream, per device
        self._device: torch.device | None = None  # the GPU of the copies in ``_copying``
        self._held: tuple[int, dict[str, torch.Tensor]] | None = None  # ``hold``: a state waiting for its mean

    def reset(self, stage: int, num_stages: int, step: int, tensors: dict[str, torch.Tensor]) -> None:
        self.stage, self.num_stages = stage, num_stages
        self._states = OrderedDict([(step, tensors)])
        self._copying = {}
        self._held = None

    def hold(self, step: int, module: torch.nn.Module, optimizer: torch.optim.Optimizer,
             outer: OuterOptimizer) -> None:
        """DiLoCo ``overlap``: copy the state after ``step``, a round's end whose mean is still in flight; it is
        not kept (not restarted from) until ``complete`` sets the parameters and outer momentum that mean gives
        (the inner moments are this copy's)."""
        self._held = (step, state_tensors(module, optimizer, outer=outer))

    @property
    def held_step(self) -> int | None:
        return self._held[0] if self._held is not None else None

    def complete(self, outer: dict[str, torch.Tensor]) -> int | None:
        """Keep the held state with the parameters and outer momentum its round's mean gave
        (``checkpoint.outer_tensors``); its step (None: none held)."""
        if self._held is None:
            return None
        (step, tensors), self._held = self._held, None
        tensors.update(outer)
        self._states[step] = tensors
        self._trim()
        return step

    def record(self, step: int, module: torch.nn.Module, optimizer: torch.optim.Optimizer,
               outer: OuterOptimizer | None = None) -> None:
        """Keep the state after ``step`` (with DiLoCo: a round's end, its outer momentum with it)."""
        device = next((p.device for p in module.parameters()), torch.device("cpu"))
        if device.type != "cuda":
            self._states[step] = state_tensors(module, optimizer, outer=outer)
        else:
            stream = self._streams.get(device) or self._streams.setdefault(device, torch.cuda.Stream(device))
            stream.wait_stream(torch.cuda.current_stream(device))  # after the optimizer step
            with torch.cuda.stream(stream):
                self._states[step] = state_tensors(module, optimizer, outer=outer, non_blocking=True)
                for tensor in _sources(module, optimizer, outer):
                    tensor.record_stream(stream)  # not reused by the allocator before the copy is done
            event = torch.cuda.Event()
            event.record(stream)
            self._copying[step] = event
            self._device = device
        self._trim()

    def _trim(self) -> None:
        while len(self._states) > self.keep:
            dropped, _ = self._states.popitem(last=False)
            self._copying.pop(dropped, None)

    def get(self, stage: int, num_stages: int, step: int) -> dict[str, torch.Tensor] | None:
        if (stage, num_stages) != (self.stage, self.num_stages):
            return None
        state = self._states.get(step)
        if state is not None:
            self._settle(step)
        return state

    def fence(self) -> None:
        """Make the device's next work (the optimizer step that changes the parameters) wait for the copies
        still reading them; the host does not wait."""
        for event in list(self._copying.values()):
            if not event.query():
                torch.cuda.current_stream(self._device).wait_event(event)

    def _settle(self, step: int) -> None:
        """Wait until the copy of ``step``'s state is done (at once for a CPU stage's, or a copy done before).
        The event stays until its state is dropped: another thread may ask for the same state meanwhile."""
        event = self._copying.get(step)
        if event is not None:
            event.synchronize()

    @property
    def kept(self) -> int:
        """How many consecutive states up to the latest one are kept."""
        return len(self._states)

    @property
    def latest_step(self) -> int | None:
        return next(reversed(self._states)) if self._states else None

    def digest(self) -> str | None:
        """SHA-256 of the latest state's parameters (name, then bytes, in name order): replicas of a stage
        hold identical parameters, so their digests are equal."""
        if not self._states:
            return None
        h = hashlib.sha256()
        step = next(reversed(self._states))
        self._settle(step)
        state = self._states[step]
        for name in sorted(n for n in state if n.startswith(PARAM)):
            h.update(name.encode())
            h.update(state[name].numpy().tobytes())
        return h.hexdigest()


def _sources(module: torch.nn.Module, optimizer: torch.optim.Optimizer,
             outer: OuterOptimizer | None) -> list[torch.Tensor]:
    """The device tensors a state copy reads: parameters, their optimizer state, the outer momentum."""
    out = []
    for param in module.parameters():
        out.append(param)
        out.extend(v for v in optimizer.state.get(param, {}).values() if isinstance(v, torch.Tensor) and v.is_cuda)
    return out + [m for m in outer.momentum if m.is_cuda] if outer is not None else out  # (host memory, usually)


def state_shapes(module: torch.nn.Module, with_optimizer: bool,
                 with_outer: bool = False) -> list[tuple[str, tuple[int, ...]]]:
    """``state_names`` with each tensor's shape; ``with_outer``: DiLoCo's outer momentum too."""
    params = dict(module.named_parameters())
    out = []
    for name in state_names(module, with_optimizer, with_outer):
        if name.startswith(PARAM):
            out.append((name, tuple(params[name[len(PARAM):]].shape)))
        elif name.startswith(OUTER):
            out.append((name, tuple(params[name[len(OUTER):]].shape)))
        else:
            _, key, param_name = name.split("/", 2)
            assert key in ADAM_KEYS
            out.append((name, () if key == "step" else tuple(params[param_name].shape)))
    return out


def state_parts(numel: int) -> list[tuple[int, int]]:
    return shard_bounds(numel, max(1, -(-numel // PART_NUMEL)))


def send_state(
    transport: Transport, peer: str, run: str, epoch: int, step: int, tensors: dict[str, torch.Tensor],
    module: torch.nn.Module, timeout_s: float, stage: int = 0, with_outer: bool = False,
) -> list[Future]:
    """Send ``tensors`` (a state of stage ``stage``, which ``module`` is) to ``peer``; futures of the sends.
    The stage goes in the tags' micro-batch field: one peer may send several stages to the same receiver.

    A receiver still in an older epoch may refuse a message as too far ahead; the send is retried until
    ``timeout_s`` (it moves its window when it takes up the new plan)."""
    names = [n for n, _ in state_shapes(module, with_optimizer=step > 0, with_outer=with_outer and step > 0)]
    flat = flatten([tensors[n] for n in names])
    futures = []
    for part, (start, end) in enumerate(state_parts(flat.numel())):
        tag = Tag(run, epoch, step, MessageKind.STATE, stage, part)
        futures.append(send_retrying(transport, peer, tag, flat[start:end].contiguous(), timeout_s))
    return futures


def send_retrying(transport: Transport, peer: str, tag: Tag, tensor: torch.Tensor, timeout_s: float) -> Future:
    result: Future = Future()
    deadline = time.monotonic() + timeout_s
    refusals = _Refusals()

    def attempt() -> None:
        try:
            future = transport.send_async(peer, tag, tensor, max(0.1, deadline - time.monotonic()))
        except Exception as e:  # a transport shut down under us: the hand-over fails, the epoch halts on it
            result.set_exception(e)
            return

        def done(f: Future) -> None:
            error = f.exception()
            if isinstance(error, MessageRejected) and error.code in (Refusal.REFUSED, Refusal.AHEAD):
                refusals.note(error)
                if time.monotonic() < deadline - 0.5:
                    logger.info("peer %s refused %s (%s); sending again", peer, tag, error)
                    threading.Timer(0.25, attempt).start()  # not on the transport's loop thread
                    return
            if error is not None:
                result.set_exception(refusals.blame(peer, tag, error))
            else:
                result.set_result(None)

        future.add_done_callback(done)

    attempt()
    return result


class _Refusals:
    """The refusals one hand-over met. A receiver that refused every attempt for ``REFUSED_BLAME_S`` or more
    (too far ahead: it never took up the plan that names it), until our epoch was aborted for something
    else, is the peer our halt blames (``epoch.blamed_peer``): our epoch waited on it alone."""

    def __init__(self) -> None:
        self.first: float | None = None
        self.last: float | None = None
        self.why: MessageRejected | None = None

    def note(self, error: MessageRejected) -> None:
        self.last, self.why = time.monotonic(), error
        self.first = self.first if self.first is not None else self.last

    def blame(self, peer: str, tag: Tag, error: BaseException) -> BaseException:
        if not isinstance(error, PeerFailed) or self.first is None or self.last - self.first < REFUSED_BLAME_S:
            return error
        return MessageRejected(f"peer {peer} refused {tag} for {self.last - self.first:.1f} s until the epoch was "
                               f"aborted ({error}); last: {self.why}", peer=peer, code=Refusal.REFUSED)


def recv_state(
    transport: Transport, peer: str, run: str, epoch: int, step: int, module: torch.nn.Module, timeout_s: float,
    stage: int = 0, with_outer: bool = False,
) -> dict[str, torch.Tensor]:
    """The state of ``module``'s stage (``stage``) after ``step`` steps, from ``peer`` (see ``send_state``);
    ``with_outer``: a DiLoCo run's, with the outer momentum."""
    shapes = state_shapes(module, with_optimizer=step > 0, with_outer=with_outer and step > 0)
    numel = sum(int(torch.Size(s).numel()) for _, s in shapes)
    pieces = [
        transport.recv(Tag(run, epoch, step, MessageKind.STATE, stage, part), peer, (end - start,), torch.float32, timeout_s)
        for part, (start, end) in enumerate(state_parts(numel))
    ]
    return unflatten_state(torch.cat(pieces) if len(pieces) > 1 else pieces[0], shapes)


def unflatten_state(flat: torch.Tensor, shapes: list[tuple[str, tuple[int, ...]]]) -> dict[str, torch.Tensor]:
    """The named tensors of a flat state vector (``state_shapes`` order)."""
    out, offset = {}, 0
    for name, shape in shapes:
        n = int(torch.Size(shape).numel())
        out[name] = flat[offset : offset + n].reshape(shape).clone()
        offset += n
    return out
