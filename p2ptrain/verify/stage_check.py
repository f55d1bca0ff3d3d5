"""The recompute check of a stage's members, live, every step: commit to the pipeline, seed, reveal, recompute.

``RecordingLink`` records, around the step's link, every pipeline message a member sends and receives
(activations and activation gradients, as they travelled, per micro-batch). Once the step's sums are checked
and before anything is applied (``runtime.buckets``' verifier hook, after ``group.GroupVerifier``), every member
of a replica group of stage j, over the step's link:

1. **commits** (kind ``pipe_commit``): signs the digests (``commit.message_digest``) of every pipeline message
   it sent and received in the step, in an order both ends know (``entries``), and sends that statement to
   the other replicas of its stage and to its pipeline neighbours;
2. **checks its neighbours' commitments**: each neighbour's digests of the messages it exchanged with us must be
   those of the messages we hold (what travelled): a member cannot later reveal another message than the one
   it sent or received (check ``pipeline``, named by the neighbour);
3. derives the step's **seed** from its group's commitments (``sketch.challenge_seed``): it exists only once
   every member has committed, so no member knew, when it computed and sent, which micro-batch is checked.
   From it: member k's verifier (``verifier_of``: the group rotated by 1 + σ, σ drawn from the seed) and its
   challenged micro-batches (``commit.Challenge`` at ``rate``; a member on probation, ``PlanRecord.probation``,
   at ``PROBATION_FACTOR`` times it, at most every micro-batch);
4. **reveals** (kind ``reveal``) to its verifier, for each challenged micro-batch, the messages it received and
   sent for it;
5. **recomputes**, as the verifier of a member: the revealed messages must match their digests (check
   ``reveal``); then ``recompute.recompute`` redoes the micro-batch on its own parameters (bit-identical to the
   member's: the step's update is not applied yet) from the member's input (its tokens on stage 0, which every
   peer derives; else the activation it received) and the output gradient it received, and ``check_message``
   compares what the member sent with what it should have, under ``recompute.allowance`` (check
   ``recompute``).

A failure raises ``group.VerificationFailed`` after every message of ours is sent (so the others are not left
waiting on us): the step is never applied here and the epoch halts blaming the member. The evidence is the
member's revealed tensors (a micro-batch's activations: far over a heartbeat's 16 KiB), so a failed recompute
is the finder's word (an ordinary blame, ``trust.md``). A stage that computed on a corrupt message of a
neighbour passes its own checks and may apply the step; it keeps the state before it (``churn.keep_states``)
and the re-plan restarts from there (docs/verification.md).
"""

from __future__ import annotations

import json
import logging
import math
import struct
import time
from collections.abc import Callable
from concurrent.futures import Future

import torch
from hivemind.utils.crypto import RSAPrivateKey

from p2ptrain.futures import wait_all
from p2ptrain.model.data import TrainData, inputs_and_targets, micro_batches, shard_of
from p2ptrain.net.transport.messages import MessageKind
from p2ptrain.runtime.topology import Role, Topology
from p2ptrain.runtime.wire import WireFormat
from p2ptrain.verify import statement
from p2ptrain.verify.commit import Challenge, message_digest
from p2ptrain.verify.group import Finding, fail
from p2ptrain.verify.recompute import allowance, check_message, recompute
from p2ptrain.verify.sketch import challenge_seed, derive_seed

logger = logging.getLogger(__name__)

ACT, GRAD = MessageKind.ACTIVATION.value, MessageKind.ACTIVATION_GRAD.value
SENT, RECEIVED = "sent", "received"
_HEADER = struct.Struct("<I")
HEADER_BYTES = 512  # a commitment's header (its length, then JSON, space-padded)
PROBATION_FACTOR = 4  # a member on probation (no work shown yet) is recomputed this many times as often


def entries(stage: int, num_stages: int, num_micro_batches: int) -> list[tuple[str, str, int]]:
    """The pipeline messages of a member of ``stage`` in one step, in the order it commits to them: per
    micro-batch, the activation it received, the one it sent, the gradient it received, the one it sent."""
    out = []
    for m in range(num_micro_batches):
        if stage > 0:
            out.append((RECEIVED, ACT, m))
        if stage < num_stages - 1:
            out += [(SENT, ACT, m), (RECEIVED, GRAD, m)]
        if stage > 0:
            out.append((SENT, GRAD, m))
    return out


def verifier_of(seed: int, stage: int, rank: int, n: int) -> int:
    """The replica of the stage that recomputes member ``rank``'s micro-batches this step: the group rotated by
    1 + σ, σ uniform in 0 … n − 2 from the seed (never the member itself; pairs rotate unpredictably)."""
    assert n >= 2 and 0 <= rank < n
    sigma = derive_seed(seed, "verifier", stage) % (n - 1)
    return (rank + 1 + sigma) % n


def _toward_next(entry: tuple[str, str, int]) -> bool:
    """Whether a member's pipeline message goes between it and the next stage (an activation it sent, a
    gradient it received) rather than the stage before it."""
    return (entry[0] == SENT) == (entry[1] == ACT)


class RecordingLink:
    """A ``StepLink`` that records the pipeline messages of the step it carries (the executor need not change)."""

    def __init__(self, link):
        self.link = link
        self.messages: dict[tuple[str, str, int], torch.Tensor] = {}  # (SENT or RECEIVED, kind, m) -> as travelled

    def send(self, peer: str, kind: str, micro_batch: int, part: int, tensor: torch.Tensor) -> Future:
        if kind in (ACT, GRAD):
            self.messages[(SENT, str(kind), micro_batch)] = tensor
        return self.link.send(peer, kind, micro_batch, part, tensor)

    def recv(self, peer: str, kind: str, micro_batch: int, part: int, shape: tuple[int, ...],
             dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
        tensor = self.link.recv(peer, kind, micro_batch, part, shape, dtype)
        if kind in (ACT, GRAD):
            self.messages[(RECEIVED, str(kind), micro_batch)] = tensor
        return tensor

    def for_step(self, step: int):
        return self.link.for_step(step)


class StageVerifier:
    """The recompute check of one member of a stage's replica group for one epoch (see the module).

    ``wrap`` goes around each step's link (``StageTrainer.link_wrapper``); ``check_step`` runs in the step's
    verifier hook, before the update."""

    def __init__(self, key: RSAPrivateKey, run: str, epoch: int, role: Role, topology: Topology, module: torch.nn.Module,
                 data: TrainData, wire: WireFormat, num_micro_batches: int, hidden_size: int, precision: str,
                 rate: float, on_finding: Callable[[Finding], None] | None = None,
                 probation: frozenset[str] = frozenset()):  # fmt: skip
        if role.num_stages < 2:
            raise ValueError("the recompute check needs a pipeline of at least 2 stages (one sends no messages)")
        self.key, self.run, self.epoch, self.role, self.topology = key, run, epoch, role, topology
        self.module, self.data, self.wire, self.hidden_size = module, data, wire, hidden_size
        self.num_micro_batches, self.precision, self.rate, self.on_finding = num_micro_batches, precision, rate, on_finding
        self.group = topology.group(role.stage)
        self.me = self.group[role.replica]
        # each member's challenge rate: the run's, or on probation (the plan's) ``PROBATION_FACTOR`` times it
        self.rates = [min(1.0, rate * PROBATION_FACTOR) if peer in probation else rate for peer in self.group]
        self.neighbours = {s: topology.pipelines[role.replica][s] for s in (role.stage - 1, role.stage + 1)
                           if 0 <= s < role.num_stages}  # fmt: skip
        self.step = 0
        self._batch: tuple[int, torch.Tensor | None] = (-1, None)
        self.link: RecordingLink | None = None
        self.recomputed = 0  # micro-batches of other members recomputed, every one held
        self.seconds = 0.0  # spent in ``check_step``: the check's rounds, reveals and recomputes

    def wrap(self, link) -> RecordingLink:
        self.link = RecordingLink(link)
        return self.link

    def begin_step(self, epoch: int, step: int) -> None:
        self.epoch, self.step = epoch, step

    # -- one step

    def check_step(self) -> None:
        started = time.perf_counter()
        try:
            self._check_step()
        finally:
            self.seconds += time.perf_counter() - started

    def _check_step(self) -> None:
        link = self.link
        assert link is not None, "check_step without a recorded step"
        self.link = None
        role, n = self.role, len(self.group)
        mine = entries(role.stage, role.num_stages, self.num_micro_batches)
        digests = [message_digest(link.messages[e], self._tag(role.replica, role.stage, e)) for e in mine]
        blob, body_bytes = self._commitment(role.stage, role.replica, digests), self._body_bytes(role.stage)
        sends: list[Future] = []
        for peer in [p for p in self.group if p != self.me] + list(self.neighbours.values()):
            sends.append(link.send(peer, MessageKind.PIPE_COMMIT, 0, 0, statement.to_message(blob, body_bytes)))
        findings: list[Finding] = []
        # 2. what our neighbours committed to of the messages we exchanged with them
        for stage, peer in self.neighbours.items():
            try:
                theirs = self._open(link, peer, stage, role.replica)
            except ValueError as e:
                findings.append(self._finding(peer, "statement", f"its pipeline commitment is refused: {e}"))
                continue
            for entry, digest in zip(entries(stage, role.num_stages, self.num_micro_batches), theirs, strict=True):
                direction, kind, m = entry
                if _toward_next(entry) != (stage < role.stage):
                    continue  # a message it exchanged with its other neighbour
                own = (RECEIVED if direction == SENT else SENT, kind, m)
                if message_digest(link.messages[own], self._tag(role.replica, stage, entry)) != digest:
                    findings.append(self._finding(peer, "pipeline", f"it committed to another {kind} of micro-batch "
                                                                    f"{m} than the one it {direction} with us"))  # fmt: skip
                    break
        # 3. the seed, from the group's commitments
        committed = {role.replica: digests}
        for k, peer in enumerate(self.group):
            if k != role.replica:
                try:
                    committed[k] = self._open(link, peer, role.stage, k)
                except ValueError as e:
                    findings.append(self._finding(peer, "statement", f"its pipeline commitment is refused: {e}"))
        if len(committed) < n:
            fail(findings, self.on_finding)  # no seed without every member's commitment
        seed = challenge_seed(f"{self.run}/{self.epoch}/{role.stage}/recompute", self.step,
                              [d for k in range(n) for d in committed[k]])  # fmt: skip
        # 4. reveal ours to our verifier
        verifier = self.group[verifier_of(seed, role.stage, role.replica, n)]
        for m in Challenge(seed, self.rates[role.replica]).micro_batches(role.stage, role.replica, self.num_micro_batches):
            for part, entry in enumerate(e for e in mine if e[2] == m):
                sends.append(link.send(verifier, MessageKind.REVEAL, m, part, link.messages[entry]))
        # 5. recompute the members we verify
        for k in range(n):
            if k != role.replica and verifier_of(seed, role.stage, k, n) == role.replica:
                for m in Challenge(seed, self.rates[k]).micro_batches(role.stage, k, self.num_micro_batches):
                    finding = self._verify(link, k, m, dict(zip(mine, committed[k], strict=True)))
                    if finding is not None:
                        findings.append(finding)
                        break
                    self.recomputed += 1
        if findings:
            fail(findings, self.on_finding)
        wait_all(sends)

    def _verify(self, link: RecordingLink, k: int, m: int, committed: dict) -> Finding | None:
        """Member k's micro-batch m: its revealed messages against its digests, then recomputed and compared."""
        role, peer = self.role, self.group[k]
        revealed = {}
        for part, entry in enumerate(e for e in committed if e[2] == m):
            codec = self.wire.activation if entry[1] == ACT else self.wire.activation_grad
            shape, dtype = codec.wire_spec(self._act_shape(k))
            message = link.recv(peer, MessageKind.REVEAL, m, part, shape, dtype)
            if message_digest(message, self._tag(k, role.stage, entry)) != committed[entry]:
                return self._finding(peer, "reveal", f"its revealed {entry[1]} of micro-batch {m} ({entry[0]}) is not "
                                                     "the message it committed to")  # fmt: skip
            revealed[entry[:2]] = message
        inputs, targets = inputs_and_targets(self._micro_batch(k, m))
        shape = self._act_shape(k)
        try:
            x = inputs if role.is_first else self.wire.activation.decode(revealed[(RECEIVED, ACT)], shape)
            grad_output = None if role.is_last else self.wire.activation_grad.decode(revealed[(RECEIVED, GRAD)], shape)
            own = recompute(self.module, x, grad_output=grad_output, targets=targets if role.is_last else None,
                            loss_tokens=self.data.tokens_per_batch if role.is_last else None)  # fmt: skip
            checks = []
            if not role.is_last:
                checks.append(("activation", check_message(self.wire.activation, revealed[(SENT, ACT)], own.output,
                                                           allowance(self.precision, "activation"))))  # fmt: skip
            if not role.is_first:
                checks.append(("activation gradient", check_message(
                    self.wire.activation_grad, revealed[(SENT, GRAD)], own.input_grad,
                    allowance(self.precision, "input_grad"))))  # fmt: skip
        except ValueError as e:  # a message that does not decode, or that no honest encoder makes
            return self._finding(peer, "recompute", f"its messages of micro-batch {m} are refused: {e}")
        for what, result in checks:
            if not result.passed:
                return self._finding(peer, "recompute", f"the {what} it sent for micro-batch {m} is not what its "
                                     f"input gives ({result.ratio:.3g}× the allowance, worst row {result.row})",
                                     result.ratio)  # fmt: skip
        return None

    # -- the parts

    def _micro_batch(self, k: int, m: int) -> torch.Tensor:
        if self._batch[0] != self.step:  # the step's global batch, derived once (a dataset read may be slow)
            self._batch = (self.step, self.data.global_batch(self.step))
        shard = shard_of(self._batch[1], k, len(self.group))
        return micro_batches(shard, self.num_micro_batches)[m]

    def _act_shape(self, k: int) -> tuple[int, int, int]:
        rows, width = self._micro_batch(k, 0).shape
        return rows, width - 1, self.hidden_size

    def _tag(self, replica: int, stage: int, entry: tuple[str, str, int]) -> str:
        """The digest tag of a pipeline message of the member (stage, replica), the same at both ends: its sender
        and receiver by peer ID."""
        direction, kind, m = entry
        row = self.topology.pipelines[replica]
        member, other = row[stage], row[stage + 1 if _toward_next(entry) else stage - 1]
        sender, receiver = (member, other) if direction == SENT else (other, member)
        return f"{self.run}/{self.epoch}/{self.step}/pipe/{kind}/{m}/{sender}/{receiver}"

    def _header(self, stage: int, replica: int) -> bytes:
        fields = {"kind": "pipe_commit", "run": self.run, "epoch": self.epoch, "step": self.step, "stage": stage,
                  "replica": replica, "member": self.topology.pipelines[replica][stage],
                  "micro_batches": self.num_micro_batches}  # fmt: skip
        text = json.dumps(fields, sort_keys=True).encode()
        assert len(text) <= HEADER_BYTES - _HEADER.size, "a run ID too long for a pipeline commitment"
        return _HEADER.pack(HEADER_BYTES) + text.ljust(HEADER_BYTES - _HEADER.size)

    def _body_bytes(self, stage: int) -> int:
        return HEADER_BYTES + 32 * len(entries(stage, self.role.num_stages, self.num_micro_batches))

    def _commitment(self, stage: int, replica: int, digests: list[bytes]) -> bytes:
        return statement.sign(self.key, self._header(stage, replica) + b"".join(digests))

    def _open(self, link: RecordingLink, peer: str, stage: int, replica: int) -> list[bytes]:
        """The digests ``peer`` (stage, replica) committed to; ValueError (one line) for a statement refused."""
        body_bytes = self._body_bytes(stage)
        message = link.recv(peer, MessageKind.PIPE_COMMIT, 0, 0, (statement.wire_size(body_bytes),), torch.uint8)
        body = statement.open_signed(statement.from_message(message), peer)
        want = self._header(stage, replica)
        if body[:HEADER_BYTES] != want or len(body) != body_bytes:
            raise ValueError("it is for another run, epoch, step, stage or micro-batch count")
        return [body[i: i + 32] for i in range(HEADER_BYTES, body_bytes, 32)]

    def _finding(self, peer: str, check: str, reason: str, ratio: float = math.inf) -> Finding:
        return Finding(peer, self.epoch, self.step, check, ratio, reason)
