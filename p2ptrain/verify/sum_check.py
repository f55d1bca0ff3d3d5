"""The sum check of a stage's data-parallel all-reduce, live, every step: commit, seed, attest, check.

``runtime.buckets`` hands a ``SumChecker`` the step's records (``allreduce.ReduceRecord``: the messages a
member sent and received, what it added up as owner) once every bucket is summed and before any sum is
applied. Every member of the group then, over the step's link (kinds ``commit`` and ``sketch``):

1. **commits**: signs the digests (``commit.message_digest``) of the tensor messages it sent in the step's
   all-reduce, per bucket its reduce shard to every other owner then its own reduced shard, and sends that
   statement (``statement``) to the group;
2. derives the step's **seed** from every member's digests (``sketch.challenge_seed``): it exists only once
   the last message is committed, so nobody knew the sketches' signs when it summed or sent;
3. **attests**, as owner of shard r of every bucket: the sketch of the reduced shard ``D`` it sent (decoded),
   ``‖D‖``, ``‖slack‖`` (the codec's bound of ``D``'s message plus that of its previous one, which bounds the
   error-feedback residual it added), and for every replica j the sketch and norm of what it added for j;
   signed, kind ``sketch``;
4. **checks**, for every other owner k and bucket b: (a) k's reduced message is the one k committed to (the
   same to every member), and so is every reduce shard another member sent us (checked before step 3, so an
   honest member never attests a message that contradicts its sender's commitment); (b) k's claims about ``D`` are what this member computes from the ``D`` it holds;
   (c) k's entry for this member's own contribution is the sketch of what it sent k ((b) and (c) at once, by the
   sketch of their difference, ``sketch.difference_sketch``, and apart only where that fails); (d) the sum:
   ``sketch.judge_sum`` of k's attested numbers. A failure of (d) is proven by k's signed statement alone
   (k's own numbers do not add up, beyond a tolerance an honest owner exceeds with probability
   ``false_alarm``): that statement is the evidence a finder sends the leader (``attest.judge_evidence``).
   A failure of (b) (the sketch or norm of ``D``) or (c) is proven by the disputed message with every member's
   signed commitment and k's statement: the message matches its sender's commitment, the step's seed (in k's
   statement) is made of those commitments, so k accepted that message, and its sketch is not what k signed.
   That bulk (a shard) goes to the leader, announced in the heartbeat (``evidence.ShardHeader``,
   ``dispute.judge_shard``). (a), (b)'s slack and the running sums' (b) and (c) are named with a reason and
   no transferable evidence (a receiver cannot prove which bytes it received; the slack and running sums take
   earlier steps' messages).

With ``running`` each owner also attests, and each member checks the same way, the running sums since the
epoch began (``sketch.RunningSum``: ``Σ_u D_u`` against ``Σ_u c_{j,u}``; the error-feedback residuals
telescope, so only the present message's bound remains and a bias inside the codec's error every step grows
against a fixed tolerance): check ``running``, proven by the same statement.

A failure raises ``VerificationFailed`` (a ``ProtocolError`` naming the member): the step's sums are never
applied, the epoch halts blaming it. A statement that does not parse, is not signed by its sender, or is for
another run, epoch, step or stage is a failure of its sender (check ``statement``), refused with a one-line
reason. What this cannot see: an owner's own contribution is its word (a corruption folded into it, with a
matching sketch, passes); that is the recompute check's part (``recompute``).
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch
from hivemind.utils.crypto import RSAPrivateKey

from p2ptrain.errors import ProtocolError
from p2ptrain.futures import wait_all
from p2ptrain.net.transport.messages import MessageKind
from p2ptrain.runtime.allreduce import GroupExchange, ReduceRecord
from p2ptrain.runtime.wire import Codec
from p2ptrain.verify import statement
from p2ptrain.verify.attest import (
    Attestation,
    commit_bytes,
    parse_sketch_body,
    said,
    sketch_bytes,
    statement_header,
)
from p2ptrain.verify.bounds import error_bound
from p2ptrain.verify.commit import message_digest
from p2ptrain.verify.config import runs_sums
from p2ptrain.verify.evidence import Bulk, ShardHeader, pack
from p2ptrain.verify.sketch import (
    FALSE_ALARM,
    SKETCH_ROWS,
    RunningSum,
    challenge_seed,
    derive_seed,
    difference_sketch,
    judge_sum,
    sketch_rounding,
    sketches_and_norms,
)

logger = logging.getLogger(__name__)

_U64 = 2.0**-53


@dataclass(frozen=True)
class Finding:
    """A check a member failed: who, at which step, which check, by how much (statistic / tolerance; inf where
    it is a mismatch), why, and the evidence a third party re-checks (None: the finder's word only)."""

    member: str
    epoch: int
    step: int
    check: str  # "sum", "running", "claim", "attest", "commit", "statement"; "pipeline", "reveal", "recompute"
    ratio: float
    reason: str
    evidence: bytes | None = None
    # evidence too large for a heartbeat, sent to the leader (a failed recompute's: ``verify.evidence``); then
    # ``evidence`` is its header
    bulk: bytes | None = field(default=None, repr=False)


class VerificationFailed(ProtocolError):
    """A member of our group failed a check of this step: the step is refused and the epoch halts blaming it."""

    def __init__(self, finding: Finding, also: tuple[str, ...] = ()):
        super().__init__(f"peer {finding.member} failed the {finding.check} check of step {finding.step}: "
                         f"{finding.reason}")
        self.finding = finding
        self.peer = finding.member
        self.also = also  # the other members that failed a check of the same step (``ProgressRecord.also``)


class SumChecker:
    """The sum check of one stage's replica group for one epoch (``__call__`` is ``buckets.Verifier``)."""

    def __init__(self, key: RSAPrivateKey, run: str, stage: int, group: Sequence[str], codec: Codec, *,
                 rows: int = SKETCH_ROWS, false_alarm: float = FALSE_ALARM, running: bool = True,
                 on_finding: Callable[[Finding], None] | None = None,
                 device: torch.device | str | None = None):
        self.key, self.run, self.stage, self.group, self.codec = key, run, stage, tuple(group), codec
        # where the sketches are made and the running sums kept: the trainer's accelerator, if it has one (on
        # a GPU the CPU's sketches of a stage's gradient cost more than its step, ``benchmarks/README.md``)
        self.device = device
        self.rows, self.false_alarm, self.on_finding = rows, false_alarm, on_finding
        self.epoch = self.step = 0
        self._previous: dict[tuple[int, int], torch.Tensor] = {}  # (bucket, owner) -> last message's bound
        # the running sums since the epoch began (its executor's residuals started at zero): as owner, per
        # bucket D and what we added per replica; as member, per (bucket, owner) its D and what we sent it
        self.running = runs_sums(running, codec.name)
        self._owned: dict[int, tuple[RunningSum, list[RunningSum]]] = {}
        self._seen: dict[tuple[int, int], tuple[RunningSum, RunningSum]] = {}
        self._commits: dict[int, bytes] = {}  # rank -> its signed commitment of the step (trimmed): evidence's
        self._step: dict[tuple[str, int, int], torch.Tensor] = {}  # the step's decoded shards and bounds, made once
        self.checked_steps = 0
        self.seconds = 0.0  # spent in the step's hook: the rounds, sketches and judgements
        self.cpu_seconds = 0.0  # of which this thread's CPU time: the work, none of the waits for the others

    def begin_step(self, epoch: int, step: int) -> None:
        self.epoch, self.step = epoch, step

    def __call__(self, records: list[ReduceRecord], rank: int, n: int, exchange: GroupExchange) -> None:
        started, cpu = time.perf_counter(), time.thread_time()
        try:
            self._check(records, rank, n, exchange)
        finally:
            self._step = {}
            self.seconds += time.perf_counter() - started
            self.cpu_seconds += time.thread_time() - cpu

    def _check(self, records: list[ReduceRecord], rank: int, n: int, exchange: GroupExchange) -> None:
        me = self.group[rank]
        numels = [sum(record.sizes) for record in records]  # the buckets'; a sketch statement says its shards'
        owned = [record.sizes[rank] for record in records]
        sends: list[Future] = []
        # 1. commit
        digests = self._digests(records, rank, n)
        body = statement_header("commit", self.run, self.epoch, self.step, self.stage, me, rank, n, numels, self.rows,
                       None) + b"".join(d for bucket in digests for d in bucket)
        blob = statement.sign(self.key, body)
        self._commits = {rank: blob}
        commit_size = commit_bytes(len(records), n)
        for k in range(n):
            if k != rank:
                sends.append(exchange.send(k, MessageKind.COMMIT, 0, statement.to_message(blob, commit_size)))
        committed: dict[int, list[list[bytes]]] = {rank: digests}
        findings: list[Finding] = []
        for j in range(n):
            if j == rank:
                continue
            size = statement.wire_size(commit_size)
            received = exchange.recv(j, MessageKind.COMMIT, 0, (size,), torch.uint8)
            try:
                committed[j] = self._open_commit(received, j, n, numels)
            except ValueError as e:
                findings.append(self._finding(j, "statement", math.inf, f"its commitment is refused: {e}"))
        findings += self._check_received(records, rank, n, committed)
        if findings:  # before we attest: nothing we sign describes a message its sender did not commit to
            self._fail(findings)
        # 2. the seed, from every member's digests
        seed = challenge_seed(f"{self.run}/{self.epoch}/{self.stage}", self.step,
                              [d for j in range(n) for bucket in committed[j] for d in bucket])
        # 3. attest our own shards (and their running sums)
        steps = self._add_running(records, rank, n) if self.running else 0
        floats = [self._attest(record, b, rank, n, seed) for b, record in enumerate(records)]
        values = torch.cat(floats).numpy().tobytes()
        body = statement_header("sketch", self.run, self.epoch, self.step, self.stage, me, rank, n, owned, self.rows,
                       seed, steps) + values
        blob = statement.sign(self.key, body)
        sketch_size = len(body)  # the same for every member: the layout depends on the bucket count only
        assert sketch_size == sketch_bytes(len(records), n, self.rows, self.running)  # what the planner prices
        for k in range(n):
            if k != rank:
                sends.append(exchange.send(k, MessageKind.SKETCH, 0, statement.to_message(blob, sketch_size)))
        # 4. check every other owner's
        for k in range(n):
            if k == rank:
                continue
            received = exchange.recv(k, MessageKind.SKETCH, 0, (statement.wire_size(sketch_size),), torch.uint8)
            findings += self._check_owner(records, k, rank, n, seed, steps, committed[k], received)
        if findings:
            self._fail(findings)
        for b, record in enumerate(records):  # the bounds of this step's messages: next step's residuals
            for k in range(n):
                if self.codec.name != "fp32":  # exact: no residual
                    self._previous[(b, k)] = self._bound(record, b, k)
        self.checked_steps += 1
        wait_all(sends)

    # -- the parts

    def _tag(self, kind: str, b: int, shard: int, sender: int) -> str:
        return message_tag(self.run, self.epoch, self.step, self.stage, kind, b, shard, sender)

    def _digests(self, records: list[ReduceRecord], rank: int, n: int) -> list[list[bytes]]:
        out = []
        for b, record in enumerate(records):
            bucket = [message_digest(record.sent[k], self._tag("reduce", b, k, rank)) for k in range(n) if k != rank]
            bucket.append(message_digest(record.gathered[rank], self._tag("gather", b, rank, rank)))
            out.append(bucket)
        return out

    def _check_received(self, records: list[ReduceRecord], rank: int, n: int,
                        committed: dict[int, list[list[bytes]]]) -> list[Finding]:
        """Check (a), before this member attests anything: every message it received in the step's all-reduce
        (each other member's reduce shard to us, and its reduced shard) is the one its sender committed to. So
        an honest member never signs a statement about a message that contradicts its sender's commitment, and
        a member caught here has no statement of ours to accuse us with: its own checks stop at a failed call."""
        findings = []
        for j in range(n):
            if j == rank or j not in committed:
                continue
            wrong = []
            for b, record in enumerate(records):
                digests = committed[j][b]  # j's reduce shards to every other owner in rank order, then its own
                if j in record.received and message_digest(record.received[j], self._tag("reduce", b, rank, j)) \
                        != digests[rank if rank < j else rank - 1]:
                    wrong.append(f"its reduce shard of bucket {b} to us")
                if message_digest(record.gathered[j], self._tag("gather", b, j, j)) != digests[-1]:
                    wrong.append(f"its reduced shard of bucket {b}")
            if wrong:
                more = f" (and {len(wrong) - 1} more of its messages)" if len(wrong) > 1 else ""
                findings.append(self._finding(j, "commit", math.inf, f"{wrong[0]} is not the message it committed "
                                                                     f"to{more}"))
        return findings

    def _open_commit(self, message: torch.Tensor, j: int, n: int, numels: list[int]) -> list[list[bytes]]:
        blob = statement.from_message(message)
        body = statement.open_signed(blob, self.group[j])
        want = statement_header("commit", self.run, self.epoch, self.step, self.stage, self.group[j], j, n, numels,
                       self.rows, None)
        if body[: len(want)] != want:
            raise ValueError(f"it is for another run, epoch, step, stage or bucket layout: {said(body)}")
        raw = body[len(want):]
        self._commits[j] = statement.trimmed(blob)
        return [[raw[(b * n + i) * 32: (b * n + i + 1) * 32] for i in range(n)] for b in range(len(numels))]

    def _decoded(self, record: ReduceRecord, b: int, kind: str, k: int) -> torch.Tensor:
        """Bucket b's shard k as its owner reduced it (``gathered``) or as we sent it to owner k (``sent``: what it
        decoded from us, and added), decoded once a step."""
        key = (kind, b, k)
        if key not in self._step:
            message = record.gathered[k] if kind == "gathered" else record.sent[k]
            self._step[key] = self.codec.decode(message, (record.sizes[k],))
        return self._step[key]

    def _bound(self, record: ReduceRecord, b: int, k: int) -> torch.Tensor:
        """``error_bound`` of owner k's reduced shard of bucket b, once a step: ValueError for a message no honest
        encoder makes."""
        key = ("bound", b, k)
        if key not in self._step:
            self._step[key] = error_bound(self.codec, record.gathered[k], (record.sizes[k],))
        return self._step[key]

    def _slack_norm(self, record: ReduceRecord, b: int, k: int) -> float:
        if self.codec.name == "fp32":  # exact: no slack, no residual (a non-finite value: the sketch refuses it)
            return 0.0
        slack = self._bound(record, b, k)
        previous = self._previous.get((b, k))
        if previous is not None and previous.shape == slack.shape:
            slack = slack + previous
        return float(torch.linalg.vector_norm(slack))

    def _add_running(self, records: list[ReduceRecord], rank: int, n: int) -> int:
        """Add this step's shards to the running sums; returns the steps they hold."""
        for b, record in enumerate(records):
            if b not in self._owned:  # (not ``setdefault``: its default, made every step, is a float64 shard each)
                self._owned[b] = (RunningSum(record.sizes[rank], self.device),
                                  [RunningSum(record.sizes[rank], self.device) for _ in range(n)])
            own_d, added = self._owned[b]
            own_d.add(self._decoded(record, b, "gathered", rank))
            for j in range(n):
                added[j].add(record.added[j])
            for k in range(n):
                if k != rank:
                    if (b, k) not in self._seen:
                        self._seen[(b, k)] = (RunningSum(record.sizes[k], self.device),
                                              RunningSum(record.sizes[k], self.device))
                    seen_d, sent = self._seen[(b, k)]
                    seen_d.add(self._decoded(record, b, "gathered", k))
                    sent.add(self._decoded(record, b, "sent", k))
        return self._owned[0][0].steps

    def _attest(self, record: ReduceRecord, b: int, rank: int, n: int, seed: int) -> torch.Tensor:
        shard_seed = derive_seed(seed, "reduce", self.stage, b, rank)
        total = self._decoded(record, b, "gathered", rank)
        slack = torch.tensor([self._slack_norm(record, b, rank)], dtype=torch.float64)
        vectors = [total, *(record.added[j] for j in range(n))]
        if self.running:
            own_d, added = self._owned[b]
            vectors += [own_d.total, *(added[j].total for j in range(n))]
        made, norms = sketches_and_norms(vectors, shard_seed, self.rows, device=self.device)  # one pass for all
        sketches = iter(made)
        parts = [next(sketches), _scalar(norms[0]), slack]
        for j in range(n):
            parts += [next(sketches), _scalar(norms[1 + j])]
        if self.running:  # over the epoch the residuals telescope: only the present message's bound remains
            current = float(torch.linalg.vector_norm(self._bound(record, b, rank)))
            parts += [next(sketches), _scalar(own_d.norm), _scalar(current)]
            for j in range(n):
                parts += [next(sketches), _scalar(added[j].norm)]
        return torch.cat([p.reshape(-1) for p in parts])

    def _check_owner(self, records: list[ReduceRecord], k: int, rank: int, n: int, seed: int, steps: int,
                     committed: list[list[bytes]], message: torch.Tensor) -> list[Finding]:
        owner = self.group[k]
        try:
            blob = statement.from_message(message)
            body = statement.open_signed(blob, owner)
            parsed = parse_sketch_body(body)
        except ValueError as e:
            return [self._finding(k, "statement", math.inf, f"its sketch statement is refused: {e}")]
        expected = {"kind": "sketch", "run": self.run, "epoch": self.epoch, "step": self.step, "stage": self.stage,
                    "member": owner, "rank": k, "n": n, "rows": self.rows, "seed": seed, "steps": steps,
                    "numels": [record.sizes[k] for record in records]}
        wrong = {key: parsed.header.get(key) for key, value in expected.items() if parsed.header.get(key) != value}
        if wrong or len(parsed.buckets) != len(records):
            return [self._finding(k, "statement", math.inf, f"its sketch statement is for something else: {wrong}")]
        findings = []
        for b, (record, att) in enumerate(zip(records, parsed.buckets, strict=True)):
            try:
                finding = self._check_bucket(record, att, b, k, rank, seed, blob)
                if finding is None and parsed.running:
                    finding = self._check_running(parsed.running[b], b, k, rank, seed, steps, record, blob)
            except ValueError as e:  # a reduced message no honest encoder makes (``bounds.error_bound``)
                finding = self._finding(k, "claim", math.inf, f"its reduced shard of bucket {b} is refused: {e}")
            if finding is not None:
                findings.append(finding)
        return findings

    def _check_bucket(self, record: ReduceRecord, att: Attestation, b: int, k: int, rank: int, seed: int,
                      blob: bytes) -> Finding | None:
        """Checks (b) to (d) of owner k's shard of bucket b (see the module; (a), that its message is the one k
        committed to, is ``_check_received``'s); ``blob``: its signed statement.

        (b) and (c) at once: ``S·(D − c)`` (``c`` what we sent it), one matrix product where the two sketches
        took two, against its ``S·D − S·c``, with both norms. Only where that differs are the two sketches made
        apart, to say which claim is wrong, with the evidence (``_misclaimed``)."""
        numel = record.sizes[k]
        shard_seed = derive_seed(seed, "reduce", self.stage, b, k)
        total = self._decoded(record, b, "gathered", k)
        mine = self._decoded(record, b, "sent", k)
        own = att.added[rank]
        made, total_norm, mine_norm, apart = difference_sketch(total, mine, shard_seed, self.rows, self.device)
        if not (_near(att.total_norm, total_norm, numel) and _near(own.norm, mine_norm, numel)
                and _difference_close(att.total - own.sketch, made, total_norm + mine_norm + apart, numel)):
            finding = self._misclaimed(record, att, b, k, rank, shard_seed, blob, total, mine)
            if finding is not None:
                return finding
        if not _near(att.slack_norm, self._slack_norm(record, b, k), numel):
            return self._finding(k, "claim", math.inf, f"its slack of bucket {b}'s reduced shard is not that of the "
                                                        "shard it sent")
        # (d) the sum
        result = judge_sum(att.total, att.total_norm, att.slack_norm, numel, att.added, false_alarm=self.false_alarm)
        if not result.passed:
            return self._finding(k, "sum", result.ratio, f"its reduced shard of bucket {b} is not the sum of what "
                                 f"it added ({result.ratio:.3g}× the tolerance)", blob)
        return None

    def _misclaimed(self, record: ReduceRecord, att: Attestation, b: int, k: int, rank: int, shard_seed: int,
                    blob: bytes, total: torch.Tensor, mine: torch.Tensor) -> Finding | None:
        """Which of owner k's claims (b) about D and (c) about what we sent it is wrong, from the two sketches made
        apart, with the evidence a third party re-checks; None if neither is (the two claims' difference was off
        by a rounding both allowances cover)."""
        (total_sketch, mine_sketch), (total_norm, mine_norm) = sketches_and_norms(
            [total, mine], shard_seed, self.rows, device=self.device)
        numel = record.sizes[k]
        if not (_close(att.total, total_sketch, total_norm, numel) and _near(att.total_norm, total_norm, numel)):
            return self._proven(k, rank, b, "claim", record.gathered[k], blob, f"its sketch or norm of bucket {b}'s "
                                                                               "reduced shard is not that of the shard it sent")
        own = att.added[rank]
        if not (_close(own.sketch, mine_sketch, own.norm, numel) and _near(own.norm, mine_norm, numel)):
            return self._proven(k, rank, b, "attest", record.sent[k], blob, f"it attests another contribution of "
                                                                             f"ours to bucket {b} than the one we sent")
        return None

    def _check_running(self, att: Attestation, b: int, k: int, rank: int, seed: int, steps: int,
                       record: ReduceRecord, blob: bytes) -> Finding | None:
        """Checks (b) to (d) of owner k's running sums of bucket b since the epoch began, (b) and (c) at once as
        ``_check_bucket``'s, apart only where they fail (no transferable evidence: the sums take every step's
        messages)."""
        seen_d, sent = self._seen[(b, k)]
        numel = record.sizes[k]
        shard_seed = derive_seed(seed, "reduce", self.stage, b, k)
        current = float(torch.linalg.vector_norm(self._bound(record, b, k)))
        scale = seen_d.norm + sent.norm  # at least the two running sums' norms
        own = att.added[rank]
        claims = _near(att.total_norm, seen_d.norm, numel * steps) and _near(att.slack_norm, current, numel)
        ours = _near(own.norm, sent.norm, numel * steps)
        if claims and ours:
            made, _, _, apart = difference_sketch(seen_d.total, sent.total, shard_seed, self.rows, self.device)
            if not _difference_close(att.total - own.sketch, made, scale + apart, numel):
                (total_sketch, sent_sketch), _ = sketches_and_norms([seen_d.total, sent.total], shard_seed, self.rows,
                                                                    device=self.device)
                claims = _close(att.total, total_sketch, scale, numel)
                ours = _close(own.sketch, sent_sketch, scale, numel)
        if not claims:
            return self._finding(k, "claim", math.inf, f"its running sum of bucket {b}'s reduced shards is not the "
                                                        "sum of the shards it sent")
        if not ours:
            return self._finding(k, "attest", math.inf, f"it attests another running sum of our contributions to "
                                                         f"bucket {b} than the one we sent")
        result = judge_sum(att.total, att.total_norm, att.slack_norm, numel, att.added, steps=steps,
                           false_alarm=self.false_alarm)
        if not result.passed:
            return self._finding(k, "running", result.ratio, f"its reduced shards of bucket {b} since the epoch "
                                 f"began are not the sum of what it added ({result.ratio:.3g}× the tolerance, "
                                 f"{steps} steps)", blob)
        return None

    def _proven(self, k: int, rank: int, b: int, check: str, message: torch.Tensor, blob: bytes,
                reason: str) -> Finding:
        """A finding of check ``claim`` or ``attest`` against owner k with the evidence a third party re-checks:
        the step's commitments, k's statement (``blob``) and the disputed ``message`` (``dispute.judge_shard``)."""
        statements = b"".join(self._commits[j] for j in range(len(self.group))) + statement.trimmed(blob)
        bulk = pack(Bulk(statements, {("shard", check, b): message}, []))
        header = ShardHeader(self.epoch, self.step, self.stage, b, self.group[k], self.group[rank], check, len(bulk),
                             hashlib.sha256(bulk).hexdigest())
        return Finding(self.group[k], self.epoch, self.step, check, math.inf, reason, header.to_bytes(), bulk)

    def _finding(self, k: int, check: str, ratio: float, reason: str, evidence: bytes | None = None) -> Finding:
        return Finding(self.group[k], self.epoch, self.step, check, ratio, reason,
                       statement.trimmed(evidence) if evidence is not None else None)

    def _fail(self, findings: list[Finding]) -> None:
        fail(findings, self.on_finding)


def fail(findings: list[Finding], on_finding: Callable[[Finding], None] | None) -> None:
    """Name every member that failed a check (a log line, ``on_finding``) and raise ``VerificationFailed`` for
    the first with evidence, else the first."""
    for finding in findings:
        logger.warning("verification: peer %s failed the %s check of epoch %d step %d: %s", finding.member,
                       finding.check, finding.epoch, finding.step, finding.reason)
        if on_finding is not None:
            on_finding(finding)
    raise refusal(findings)


def refusal(findings: list[Finding]) -> VerificationFailed:
    """The refusal of ``findings`` (not empty): the first with evidence, else the first, naming the others."""
    proven = [f for f in findings if f.evidence is not None]
    first = (proven or findings)[0]
    return VerificationFailed(first, tuple(dict.fromkeys(f.member for f in findings if f.member != first.member)))


def _scalar(x: float) -> torch.Tensor:
    return torch.tensor([x], dtype=torch.float64)


def message_tag(run: str, epoch: int, step: int, stage: int, kind: str, b: int, shard: int, sender: int) -> str:
    """The tag a message of the all-reduce is committed under (``commit.message_digest``): ``kind`` (``reduce``,
    ``gather``) of bucket ``b``'s shard ``shard``, sent by rank ``sender``."""
    return f"{run}/{epoch}/{step}/{stage}/{kind}/{b}/{shard}/{sender}"


def sketch_ratio(a: torch.Tensor, b: torch.Tensor, norm: float, numel: int) -> float:
    """How far apart two sketches are against what float64 rounding allows two sketches of one vector (norm
    ``norm``) made on two machines: at most 1 for one vector."""
    allowed = 2 * sketch_rounding(numel) * norm + 1e-300
    return float((a - b).abs().max()) / allowed


def norm_ratio(a: float, b: float, numel: int) -> float:
    """How far apart two norms are against what rounding allows two float64 norms of one vector: at most 1."""
    return abs(a - b) / (4 * (numel + 2) * _U64 * max(abs(a), abs(b)) + 1e-300)


def _difference_close(claimed: torch.Tensor, made: torch.Tensor, scale: float, numel: int) -> bool:
    """Whether an owner's ``S·D − S·c`` (``claimed``) is our ``S·(D − c)`` (``made``) within what rounding allows
    them: its two sketches each within ``sketch_rounding`` of exact (times ``‖D‖``, ``‖c‖``), ours and our
    subtraction within twice that of ``‖D − c‖``, its subtraction within less than its sketches' own; ``scale``
    at least ``‖D‖ + ‖c‖ + ‖D − c‖``."""
    return float((claimed - made).abs().max()) <= 2 * sketch_rounding(numel) * scale + 1e-300


def _close(a: torch.Tensor, b: torch.Tensor, norm: float, numel: int) -> bool:
    return sketch_ratio(a, b, norm, numel) <= 1


def _near(a: float, b: float, numel: int) -> bool:
    return norm_ratio(a, b, numel) <= 1
