"""The recompute check of a stage's members, live, every step: commit to the pipeline, seed, reveal, recompute.

``RecordingLink`` records, around the step's link, every pipeline message a member sends and receives
(activations and activation gradients, as they travelled, per micro-batch). Once the step's sums are checked
and before anything is applied (``runtime.buckets``' verifier hook, after ``sum_check.SumChecker``), every member
of a replica group of stage j, over the step's link:

1. **commits** (kind ``pipe_commit``): signs the digests (``commit.message_digest``) of every pipeline message
   it sent and received in the step, in an order both ends know (``entries``), and sends that statement to
   the other replicas of its stage and to its pipeline neighbours;
2. **checks its neighbours' commitments**: each neighbour's digests of the messages it exchanged with us must be
   those of the messages we hold (what travelled): a member cannot later reveal another message than the one
   it sent or received (check ``pipeline``, named by the neighbour);
3. derives the step's **seed** from its group's commitments (``sketch.challenge_seed``): it exists only once
   every member has committed, so no member knew, when it computed and sent, which micro-batch is checked.
   From it: member k's verifiers (``verifiers_of``: the group rotated by 1 + σ, σ drawn from the seed, and by
   the next offsets up to ``[verify] verifiers``, 2: two colluders of a group of three never check each other
   alone) and its
   challenged micro-batches (``commit.Challenge`` at ``rate``; a member on probation, ``PlanRecord.probation``,
   at ``PROBATION_FACTOR`` times it, at most every micro-batch);
4. **reveals** (kind ``reveal``) to each of its verifiers, for each challenged micro-batch, the messages it received and
   sent for it;
5. **recomputes**, as the verifier of a member: the revealed messages must match their digests (check
   ``reveal``); then ``recompute.recompute`` redoes the micro-batch on its own parameters (bit-identical to the
   member's: the step's update is not applied yet), on its own stage module, so compiled like the member's
   where the run compiles (``[train] compile``), from the member's input (its tokens on stage 0, which every
   peer derives; else the activation it received) and the output gradient it received, and ``check_message``
   compares what the member sent with what it should have, under ``recompute.allowance`` (check
   ``recompute``).

**In the shadow of the next step** (``last_step``: how the agents run it). Steps 1-5 are rounds and a
reveal of activation-sized messages across the group: in the step's hook, on a world-wide network, they cost
a third of a step (``bench e2e``, benchmarks/README.md). So the hook of step t only copies the parameters the
step computed with (one more copy of the stage's parameters) and keeps its records; steps 1-5 for step t run
on a thread of their own during step t + 1, over step t + 1's link (the statements say which step they
check), while the data-parallel links are idle in its forward pass; step t + 1's hook waits for them before
its update, so a failure is raised there (the finding names step t) and step t + 1 is never applied. Step t
was: the re-plan restarts from the state before it (``epoch._halt`` reports the states up to step t; a
trainer keeps one more state, ``churn.keep_states`` + 1, since its peers may have applied step t + 1 too),
and a trainer that halts for any other reason reports only its checked states. The run's last step is
checked in its own hook.

A failure raises ``sum_check.VerificationFailed`` after every message of ours is sent (so the others are not left
waiting on us): the step is never applied here and the epoch halts blaming the member. A failed recompute
comes with evidence a third party re-checks (``verify.evidence``): the member's commitment signs the digest of
the parameters it computed with (``evidence.param_digest``) besides its messages', so the revealed messages,
the verifier's copy of the parameters (when its digest is the member's) and the commitment are all a judge
needs to redo the micro-batch (``verify.dispute``, the leader's); the other checks' findings are the finder's
word (an ordinary blame, ``trust.md``). A stage that computed on a corrupt message of a
neighbour passes its own checks and may apply the step; it keeps the state before it (``churn.keep_states``)
and the re-plan restarts from there (docs/verification.md).
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import math
import struct
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, replace

import torch
from hivemind.utils.crypto import RSAPrivateKey

from p2ptrain.futures import in_thread, wait_all
from p2ptrain.model.data import TrainData, inputs_and_targets, micro_batches, shard_of
from p2ptrain.net.transport.messages import MessageKind
from p2ptrain.runtime.topology import Role, Topology
from p2ptrain.runtime.wire import WireFormat
from p2ptrain.verify import statement
from p2ptrain.verify.commit import Challenge, message_digest
from p2ptrain.verify.evidence import Bulk, DisputeHeader, pack, param_digest
from p2ptrain.verify.recompute import RecomputeCheck, allowance, check_message, recompute
from p2ptrain.verify.sketch import challenge_seed, derive_seed
from p2ptrain.verify.sum_check import Finding, VerificationFailed, fail

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
    return verifiers_of(seed, stage, rank, n, 1)[0]


def verifiers_of(seed: int, stage: int, rank: int, n: int, count: int) -> list[int]:
    """The ``min(count, n − 1)`` replicas of the stage that recompute member ``rank``'s micro-batches this step:
    the group rotated by 1 + σ, 1 + σ + 1, … (mod n − 1), σ uniform from the seed; never the member itself. With
    ``count`` ≥ 2, c colluding members of a group escape only if every one of their verifiers is one of them:
    a group of three with two rogues has each rogue recomputed by the honest replica every step."""
    assert n >= 2 and 0 <= rank < n and count >= 1
    sigma = derive_seed(seed, "verifier", stage) % (n - 1)
    return [(rank + 1 + (sigma + i) % (n - 1)) % n for i in range(min(count, n - 1))]


def _toward_next(entry: tuple[str, str, int]) -> bool:
    """Whether a member's pipeline message goes between it and the next stage (an activation it sent, a
    gradient it received) rather than the stage before it."""
    return (entry[0] == SENT) == (entry[1] == ACT)


def pipe_tag(run: str, epoch: int, step: int, topology: Topology, replica: int, stage: int,
             entry: tuple[str, str, int]) -> str:
    """The digest tag of a pipeline message of the member (stage, replica), the same at both ends: its sender
    and receiver by peer ID."""
    direction, kind, m = entry
    row = topology.pipelines[replica]
    member, other = row[stage], row[stage + 1 if _toward_next(entry) else stage - 1]
    sender, receiver = (member, other) if direction == SENT else (other, member)
    return f"{run}/{epoch}/{step}/pipe/{kind}/{m}/{sender}/{receiver}"


def commitment_header(run: str, epoch: int, step: int, stage: int, replica: int, member: str,
                      num_micro_batches: int) -> bytes:
    """The first ``HEADER_BYTES`` of a member's commitment: what it is for (its length, then JSON, padded)."""
    fields = {"kind": "pipe_commit", "run": run, "epoch": epoch, "step": step, "stage": stage, "replica": replica,
              "member": member, "micro_batches": num_micro_batches}
    text = json.dumps(fields, sort_keys=True).encode()
    assert len(text) <= HEADER_BYTES - _HEADER.size, "a run ID too long for a pipeline commitment"
    return _HEADER.pack(HEADER_BYTES) + text.ljust(HEADER_BYTES - _HEADER.size)


def commitment_bytes(stage: int, num_stages: int, num_micro_batches: int) -> int:
    """A commitment's body: its header, the parameters' digest, one digest per pipeline message (``entries``)."""
    return HEADER_BYTES + 32 + 32 * len(entries(stage, num_stages, num_micro_batches))


def open_commitment(blob: bytes, signer: str, header: bytes, body_bytes: int) -> tuple[bytes, list[bytes]]:
    """The parameters' digest and the messages' digests ``signer`` committed to in ``blob``, which must be for
    ``header``; ValueError (one line) for a statement refused."""
    body = statement.open_signed(blob, signer)
    if body[:HEADER_BYTES] != header or len(body) != body_bytes:
        raise ValueError("it is for another run, epoch, step, stage or micro-batch count")
    return body[HEADER_BYTES: HEADER_BYTES + 32], [body[i: i + 32] for i in range(HEADER_BYTES + 32, body_bytes, 32)]


def check_micro_batch(module: torch.nn.Module, stage: int, num_stages: int, wire: WireFormat, precision: str,
                      rows: torch.Tensor, revealed: dict[tuple[str, str], torch.Tensor], boundary_width: int,
                      loss_tokens: int) -> list[tuple[str, RecomputeCheck]]:
    """Redo micro-batch ``rows`` (its tokens, ``[rows, T + 1]``) of ``stage`` on ``module`` from the member's
    revealed messages (``(direction, kind)``: the input it received, the output gradient it received) and
    compare what it sent (its activation, its input gradient) with ours: each check by name. ValueError (one
    line) for a message that does not decode, or that no honest encoder makes."""
    first, last = stage == 0, stage == num_stages - 1
    inputs, targets = inputs_and_targets(rows)
    shape = (rows.shape[0], rows.shape[1] - 1, boundary_width)
    x = inputs if first else wire.activation.decode(revealed[(RECEIVED, ACT)], shape)
    grad_output = None if last else wire.activation_grad.decode(revealed[(RECEIVED, GRAD)], shape)
    own = recompute(module, x, tokens=inputs, grad_output=grad_output, targets=targets if last else None,
                    loss_tokens=loss_tokens if last else None, param_grads=False)
    checks = []
    if not last:
        checks.append(("activation", check_message(wire.activation, revealed[(SENT, ACT)], own.output,
                                                   allowance(precision, "activation"))))
    if not first:
        checks.append(("activation gradient", check_message(wire.activation_grad, revealed[(SENT, GRAD)],
                                                            own.input_grad, allowance(precision, "input_grad"))))
    return checks


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
             dtype: torch.dtype) -> torch.Tensor:
        tensor = self.link.recv(peer, kind, micro_batch, part, shape, dtype)
        if kind in (ACT, GRAD):
            self.messages[(RECEIVED, str(kind), micro_batch)] = tensor
        return tensor

    def for_step(self, step: int):
        return self.link.for_step(step)


@dataclass(frozen=True)
class _Checked:
    """What the check of one step needs once the step is over: its pipeline messages and the parameters it
    computed with (the member's module, or in the shadow mode the copy taken before the step's update)."""

    step: int
    messages: dict[tuple[str, str, int], torch.Tensor]
    module: torch.nn.Module
    lane: int = 0  # 1: checked over the next step's link, beside that step's own check (tags apart: ``_part``)


def _part(checked: _Checked, part: int) -> int:
    """A reveal's part: its place among a micro-batch's messages (at most 4), in its lane's own range."""
    return part + 4 * checked.lane


def _copy_into(shadow: torch.nn.Module, module: torch.nn.Module) -> None:
    with torch.no_grad():
        for mine, theirs in zip(shadow.parameters(), module.parameters(), strict=True):
            mine.copy_(theirs)
        for mine, theirs in zip(shadow.buffers(), module.buffers(), strict=True):
            mine.copy_(theirs)


class RecomputeChecker:
    """The recompute check of one member of a stage's replica group for one epoch (see the module).

    ``wrap`` goes around each step's link (``StageTrainer.link_wrapper``); ``check_step`` runs in the step's
    verifier hook, before the update. With ``last_step`` (the shadow mode, the agents'), the hook of step t
    copies the parameters step t computed with and the check of step t runs during step t + 1, over its link
    (begun by ``wrap``), beside its compute; step t + 1's hook waits for it (and raises its failure) before
    that step's update. The last step (``last_step``) is checked in its own hook. Without, every step is
    checked in its own hook."""

    def __init__(self, key: RSAPrivateKey, run: str, epoch: int, role: Role, topology: Topology, module: torch.nn.Module,
                 data: TrainData, wire: WireFormat, num_micro_batches: int, boundary_width: int, precision: str,
                 rate: float, on_finding: Callable[[Finding], None] | None = None,
                 probation: frozenset[str] = frozenset(), last_step: int | None = None,
                 verifiers: int = 2):
        if role.num_stages < 2:
            raise ValueError("the recompute check needs a pipeline of at least 2 stages (one sends no messages)")
        self.key, self.run, self.epoch, self.role, self.topology = key, run, epoch, role, topology
        self.module, self.data, self.wire, self.boundary_width = module, data, wire, boundary_width
        self.num_micro_batches, self.precision, self.rate, self.on_finding = num_micro_batches, precision, rate, on_finding
        self.group = topology.group(role.stage)
        self.me = self.group[role.replica]
        self.verifiers = verifiers  # replicas that recompute each member (``verifiers_of``)
        # each member's challenge rate: the run's, or on probation (the plan's) ``PROBATION_FACTOR`` times it
        self.rates = [min(1.0, rate * PROBATION_FACTOR) if peer in probation else rate for peer in self.group]
        self.neighbours = {s: topology.pipelines[role.replica][s] for s in (role.stage - 1, role.stage + 1)
                           if 0 <= s < role.num_stages}
        self.step = 0
        self._batch: tuple[int, torch.Tensor | None] = (-1, None)
        self.link: RecordingLink | None = None
        self.recomputed = 0  # micro-batches of other members recomputed, every one held
        self.seconds = 0.0  # spent in ``check_step`` (the step waited): the check's, or waiting for the shadow's
        self.shadow_seconds = 0.0  # spent checking in the shadow of the next step
        self.last_step = last_step
        # the shadow mode's copy of the parameters a step computed with (one more copy of the stage's parameters);
        # a compiled stage's copy compiles its blocks again (``model.compiled``): it recomputes as the member did
        self._shadow = copy.deepcopy(module) if last_step is not None else None
        self._pending: _Checked | None = None  # a step whose check waits for the next step's link
        self._running: Future | None = None  # ... that check, running
        self.unverified: int | None = None  # the step applied whose check has not passed yet (shadow mode)
        # members whose parameters' digest was not ours this epoch (replicas on another kind of device may round
        # an update otherwise): their failed recomputes are our word, without evidence
        self.params_differ: set[str] = set()

    def wrap(self, link) -> RecordingLink:
        self.link = recording = RecordingLink(link)
        if self._pending is not None:  # the step before's check, over this step's link (its messages are this step's)
            checked, self._pending = self._pending, None
            self._running = in_thread(lambda: self._shadow_check(checked, recording), f"recompute-check-{checked.step}")
        return recording

    def begin_step(self, epoch: int, step: int) -> None:
        self.epoch, self.step = epoch, step

    # -- one step

    def check_step(self) -> None:
        """The step's hook, before its update: the check of the step before ends (shadow mode; its failure is
        raised here, so this step is not applied), then this step's is done, or set aside for the next."""
        started = time.perf_counter()
        try:
            link = self.link
            assert link is not None, "check_step without a recorded step"
            self.link = None
            failed: VerificationFailed | None = None
            if self._running is not None:
                running, self._running = self._running, None
                try:
                    running.result()  # its own calls have deadlines
                    self.unverified = None
                except VerificationFailed as e:  # raised once this step's messages are sent too
                    failed = e
            checked = _Checked(self.step, link.messages, self.module)
            if self._shadow is None or self.step >= self.last_step:
                try:
                    self._check(checked, link)  # the others wait for our part of it
                except VerificationFailed:
                    if failed is None:
                        raise
            elif failed is None:
                _copy_into(self._shadow, self.module)
                self._pending, self.unverified = replace(checked, module=self._shadow, lane=1), self.step
            if failed is not None:
                raise failed
        finally:
            self.seconds += time.perf_counter() - started

    def _shadow_check(self, checked: _Checked, link) -> None:
        started = time.perf_counter()
        try:
            self._check(checked, link)
        finally:
            self.shadow_seconds += time.perf_counter() - started

    def _check(self, checked: _Checked, link) -> None:
        """Steps 1-5 of the module for step ``checked.step``, over ``link`` (its own, or the next step's)."""
        role, n, step = self.role, len(self.group), checked.step
        mine = entries(role.stage, role.num_stages, self.num_micro_batches)
        digests = [message_digest(checked.messages[e], self._tag(step, role.replica, role.stage, e)) for e in mine]
        params = param_digest(checked.module.named_parameters())  # what a judge holds the parameters to
        blob = self._commitment(step, role.stage, role.replica, params, digests)
        body_bytes = self._body_bytes(role.stage)
        sends: list[Future] = []
        for peer in [p for p in self.group if p != self.me] + list(self.neighbours.values()):
            sends.append(link.send(peer, MessageKind.PIPE_COMMIT, 0, checked.lane,
                                   statement.to_message(blob, body_bytes)))
        findings: list[Finding] = []
        # 2. what our neighbours committed to of the messages we exchanged with them
        for stage, peer in self.neighbours.items():
            try:
                _, _, theirs = self._open(link, step, checked.lane, peer, stage, role.replica)
            except ValueError as e:
                findings.append(self._finding(step, peer, "statement", f"its pipeline commitment is refused: {e}"))
                continue
            for entry, digest in zip(entries(stage, role.num_stages, self.num_micro_batches), theirs, strict=True):
                direction, kind, m = entry
                if _toward_next(entry) != (stage < role.stage):
                    continue  # a message it exchanged with its other neighbour
                own = (RECEIVED if direction == SENT else SENT, kind, m)
                if message_digest(checked.messages[own], self._tag(step, role.replica, stage, entry)) != digest:
                    findings.append(self._finding(step, peer, "pipeline", f"it committed to another {kind} of micro-batch "
                                                                    f"{m} than the one it {direction} with us"))
                    break
        # 3. the seed, from the group's commitments
        committed, blobs, same = {role.replica: digests}, {}, {}
        for k, peer in enumerate(self.group):
            if k != role.replica:
                try:
                    blobs[k], theirs_params, committed[k] = self._open(link, step, checked.lane, peer, role.stage, k)
                except ValueError as e:
                    findings.append(self._finding(step, peer, "statement", f"its pipeline commitment is refused: {e}"))
                    continue
                same[k] = theirs_params == params
                if not same[k] and peer not in self.params_differ:  # said once an epoch
                    self.params_differ.add(peer)
                    logger.warning("verification: peer %s computed step %d with parameters whose digest is not ours "
                                   "(another device type's update?): its failed recomputes are our word, without "
                                   "evidence", peer, step)
        if len(committed) < n:
            fail(findings, self.on_finding)  # no seed without every member's commitment
        seed = challenge_seed(f"{self.run}/{self.epoch}/{role.stage}/recompute", step,
                              [d for k in range(n) for d in committed[k]])
        # 4. reveal ours to our verifiers
        for verifier in verifiers_of(seed, role.stage, role.replica, n, self.verifiers):
            for m in Challenge(seed, self.rates[role.replica]).micro_batches(role.stage, role.replica,
                                                                            self.num_micro_batches):
                for part, entry in enumerate(e for e in mine if e[2] == m):
                    sends.append(link.send(self.group[verifier], MessageKind.REVEAL, m, _part(checked, part),
                                           checked.messages[entry]))
        # 5. recompute the members we verify
        for k in range(n):
            if k != role.replica and role.replica in verifiers_of(seed, role.stage, k, n, self.verifiers):
                for m in Challenge(seed, self.rates[k]).micro_batches(role.stage, k, self.num_micro_batches):
                    finding = self._verify(checked, link, k, m, dict(zip(mine, committed[k], strict=True)),
                                           blobs[k] if same[k] else None)
                    if finding is not None:
                        findings.append(finding)
                        break
                    self.recomputed += 1
        if findings:
            fail(findings, self.on_finding)
        wait_all(sends)

    def _verify(self, checked: _Checked, link, k: int, m: int, committed: dict, blob: bytes | None) -> Finding | None:
        """Member k's micro-batch m: its revealed messages against its digests, then recomputed and compared. A
        failed recompute comes with its evidence (``verify.evidence``): ``blob`` is member k's commitment, None
        where its parameters' digest is not ours (our parameters are then no evidence of what it computed with)."""
        role, peer, step = self.role, self.group[k], checked.step
        revealed = {}
        for part, entry in enumerate(e for e in committed if e[2] == m):
            codec = self.wire.activation if entry[1] == ACT else self.wire.activation_grad
            shape, dtype = codec.wire_spec(self._act_shape(step, k))
            message = link.recv(peer, MessageKind.REVEAL, m, _part(checked, part), shape, dtype)
            if message_digest(message, self._tag(step, k, role.stage, entry)) != committed[entry]:
                return self._finding(step, peer, "reveal", f"its revealed {entry[1]} of micro-batch {m} ({entry[0]}) is not "
                                                     "the message it committed to")
            revealed[entry] = message
        try:
            checks = check_micro_batch(checked.module, role.stage, role.num_stages, self.wire, self.precision,
                                       self._micro_batch(step, k, m), {e[:2]: t for e, t in revealed.items()},
                                       self.boundary_width, self.data.tokens_per_batch)
        except ValueError as e:  # a message that does not decode, or that no honest encoder makes
            reason, ratio = f"its messages of micro-batch {m} are refused: {e}", math.inf
        else:
            failed = [(what, result) for what, result in checks if not result.passed]
            if not failed:
                return None
            what, result = failed[0]
            reason = (f"the {what} it sent for micro-batch {m} is not what its input gives ({result.ratio:.3g}× the "
                      f"allowance, worst row {result.row})")
            ratio = result.ratio
        finding = self._finding(step, peer, "recompute", reason, ratio)
        if blob is None:
            return finding
        bulk = pack(Bulk(statement.trimmed(blob), revealed,
                         [(name, p.detach().to("cpu")) for name, p in checked.module.named_parameters()]))
        header = DisputeHeader(self.epoch, step, role.stage, k, peer, m, ratio, len(bulk), hashlib.sha256(bulk).hexdigest())
        return replace(finding, evidence=header.to_bytes(), bulk=bulk)

    # -- the parts

    def _micro_batch(self, step: int, k: int, m: int) -> torch.Tensor:
        if self._batch[0] != step:  # the step's global batch, derived once (a dataset read may be slow)
            self._batch = (step, self.data.global_batch(step))
        shard = shard_of(self._batch[1], k, len(self.group))
        return micro_batches(shard, self.num_micro_batches)[m]

    def _act_shape(self, step: int, k: int) -> tuple[int, int, int]:
        rows, width = self._micro_batch(step, k, 0).shape
        return rows, width - 1, self.boundary_width

    def _tag(self, step: int, replica: int, stage: int, entry: tuple[str, str, int]) -> str:
        return pipe_tag(self.run, self.epoch, step, self.topology, replica, stage, entry)

    def _header(self, step: int, stage: int, replica: int) -> bytes:
        return commitment_header(self.run, self.epoch, step, stage, replica, self.topology.pipelines[replica][stage],
                                 self.num_micro_batches)

    def _body_bytes(self, stage: int) -> int:
        return commitment_bytes(stage, self.role.num_stages, self.num_micro_batches)

    def _commitment(self, step: int, stage: int, replica: int, params: bytes, digests: list[bytes]) -> bytes:
        return statement.sign(self.key, self._header(step, stage, replica) + params + b"".join(digests))

    def _open(self, link, step: int, lane: int, peer: str, stage: int, replica: int) -> tuple[bytes, bytes, list[bytes]]:
        """What ``peer`` (stage, replica) committed to: its statement, its parameters' digest, its messages'
        digests; ValueError (one line) for a statement refused."""
        body_bytes = self._body_bytes(stage)
        message = link.recv(peer, MessageKind.PIPE_COMMIT, 0, lane, (statement.wire_size(body_bytes),), torch.uint8)
        blob = statement.from_message(message)
        params, digests = open_commitment(blob, peer, self._header(step, stage, replica), body_bytes)
        return blob, params, digests

    def _finding(self, step: int, peer: str, check: str, reason: str, ratio: float = math.inf) -> Finding:
        return Finding(peer, self.epoch, step, check, ratio, reason)
