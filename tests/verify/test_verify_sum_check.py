"""The live sum check of a group (``verify.sum_check``) in one process: the real all-reduce of every member, real
signatures, the messages through in-process queues. Honest steps pass under every bounded codec; an owner that
scales or negates the shards it sums is named by every other member with evidence that a third party re-checks,
and so is one whose statement misdescribes what it sent or received (a shard dispute: the message with the
step's commitments); garbled, forged and wrong-step statements are refused with a reason and blame their sender."""

from __future__ import annotations

import dataclasses
import hashlib
import queue
import threading
from collections import defaultdict
from concurrent.futures import Future, ThreadPoolExecutor

import pytest
import torch

from p2ptrain.net.identity import generate_identity
from p2ptrain.runtime.allreduce import ReduceRecord, sharded_all_reduce
from p2ptrain.runtime.calibration import verify_volumes
from p2ptrain.runtime.config import TrainConfig
from p2ptrain.runtime.wire import Codec, ErrorFeedback
from p2ptrain.verify import statement
from p2ptrain.verify.attest import judge_evidence
from p2ptrain.verify.config import VerifyConfig, runs_sums
from p2ptrain.verify.dispute import judge_shard
from p2ptrain.verify.evidence import Bulk, ShardHeader, pack, unpack
from p2ptrain.verify.sum_check import SumChecker, VerificationFailed

RUN = "verify-group"
IDENTITIES = [generate_identity() for _ in range(3)]
GROUP = tuple(i.peer_id for i in IDENTITIES)
RECV_S = 8.0  # only a member whose peers halted waits this long


class Queues:
    def __init__(self):
        self.lock = threading.Lock()
        self.queues: dict[tuple, queue.Queue] = defaultdict(queue.Queue)
        self.tamper = None  # (sender, kind) -> a function of the message

    def q(self, key):
        with self.lock:
            return self.queues[key]


class Exchange:
    def __init__(self, queues: Queues, rank: int, space: int):
        self.queues, self.rank, self.space = queues, rank, space

    def send(self, to_rank, kind, part, tensor):
        if self.queues.tamper is not None and (self.rank, str(kind)) in self.queues.tamper:
            tensor = self.queues.tamper[(self.rank, str(kind))](tensor)
        self.queues.q((self.space, self.rank, to_rank, str(kind), part)).put(tensor)
        done: Future = Future()
        done.set_result(None)
        return done

    def recv(self, from_rank, kind, part, shape, dtype):
        try:
            message = self.queues.q((self.space, from_rank, self.rank, str(kind), part)).get(timeout=RECV_S)
        except queue.Empty:
            raise TimeoutError(f"nothing from {from_rank}") from None  # its peers halted: the transport's deadline
        assert tuple(message.shape) == tuple(shape) and message.dtype == dtype  # what the transport refuses
        return message


class Scaling(ErrorFeedback):
    """An owner that scales (or negates) every shard it sums before it sends it back, from step ``start`` on."""

    def __init__(self, codec, factor, start):
        super().__init__(codec)
        self.factor, self.start, self.step = factor, start, 0

    def encode(self, key, x):
        if isinstance(key, tuple) and "gather_shard" in map(str, key) and self.step >= self.start:
            x = x * self.factor
        return super().encode(key, x)


def run_steps(codec_name, steps, feedbacks=None, tamper=None, numels=(1000, 517), seed=0, running=True,
              drift=None):
    """Every member's steps; returns per member the list of per-step outcomes (None: passed, else the error).
    ``drift``: each member's gradients are a fixed direction plus this much noise (a training run's gradients
    share a direction from step to step), else fresh every step."""
    n = len(GROUP)
    codec = Codec(codec_name)
    feedbacks = feedbacks or [ErrorFeedback(codec) for _ in range(n)]
    verifiers = [SumChecker(IDENTITIES[r].private_key, RUN, 0, GROUP, codec, running=running) for r in range(n)]
    gen = torch.Generator().manual_seed(seed)
    base = [[torch.randn(m, generator=gen) for m in numels] for _ in range(n)]
    outcomes = [[] for _ in range(n)]
    for step in range(steps):
        queues = Queues()
        queues.tamper = tamper(step) if tamper else None
        if drift is None:
            flats = [[torch.randn(m, generator=gen) for m in numels] for _ in range(n)]
        else:
            flats = [[x + drift * torch.randn(x.numel(), generator=gen) for x in member] for member in base]
        for f in feedbacks:
            if isinstance(f, Scaling):
                f.step = step

        def member(r, flats=flats, queues=queues, step=step):
            records = [ReduceRecord() for _ in numels]
            for b in range(len(numels)):
                sharded_all_reduce(flats[r][b], r, n, Exchange(queues, r, b), feedbacks[r], key=b, record=records[b])
            verifiers[r].begin_step(0, step)
            try:
                verifiers[r](records, r, n, Exchange(queues, r, len(numels) + 1))
            except (VerificationFailed, TimeoutError) as e:
                return e
            return None

        with ThreadPoolExecutor(n) as pool:
            for r, outcome in enumerate(pool.map(member, range(n))):
                outcomes[r].append(outcome)
        if any(o is not None for member_outcomes in outcomes for o in member_outcomes[-1:]):
            break
    return outcomes


@pytest.mark.parametrize("codec", ["fp32", "bf16", "int8", "int4", "int2"])
@pytest.mark.parametrize("drift", [None, 0.1])
def test_honest_steps_pass(codec, drift):
    outcomes = run_steps(codec, 8, drift=drift)
    assert all(o is None for member in outcomes for o in member), outcomes


@pytest.mark.parametrize("codec", ["int8", "int4"])
def test_a_small_bias_every_step_is_caught_by_the_running_sums_only(codec):
    """×1.02 on every sum: inside int8's and int4's own error in any one step, not over the epoch."""
    feedbacks = [ErrorFeedback(Codec(codec)) for _ in GROUP]
    feedbacks[1] = Scaling(Codec(codec), 1.02, start=0)
    alone = run_steps(codec, 6, [ErrorFeedback(Codec(codec)) for _ in GROUP[:1]] + feedbacks[1:2] +
                      [ErrorFeedback(Codec(codec))], running=False, drift=0.1)
    assert all(o is None for member in alone for o in member), "a per-step check saw it after all"
    feedbacks[1] = Scaling(Codec(codec), 1.02, start=0)  # fresh residuals
    outcomes = run_steps(codec, 30, feedbacks, drift=0.1)
    caught = [member[-1] for r, member in enumerate(outcomes) if r != 1]
    assert all(isinstance(e, VerificationFailed) and e.finding.check == "running" for e in caught), caught
    assert all(e.finding.member == GROUP[1] and judge_evidence(e.finding.evidence, GROUP[1], RUN) is None
               for e in caught)
    assert len(outcomes[0]) <= {"int8": 4, "int4": 30}[codec], len(outcomes[0])


def test_under_fp32_the_steps_check_alone_catches_a_bias_so_no_running_sums_are_kept():
    """fp32 messages are exact: no slack, no residual. ×1.0001 on every sum is caught in its first step by the
    step's check, where the running sums (twice the sketches) would add nothing; the planner prices the
    statement without them."""
    assert not runs_sums(True, "fp32") and runs_sums(True, "bf16") and not runs_sums(False, "int8")
    checker = SumChecker(IDENTITIES[0].private_key, RUN, 0, GROUP, Codec("fp32"), running=True)
    assert not checker.running
    feedbacks = [ErrorFeedback(Codec("fp32")) for _ in GROUP]
    feedbacks[1] = Scaling(Codec("fp32"), 1.0001, start=0)
    outcomes = run_steps("fp32", 4, feedbacks, drift=0.1)
    caught = [member[-1] for r, member in enumerate(outcomes) if r != 1]
    assert len(outcomes[0]) == 1 and all(isinstance(e, VerificationFailed) and e.finding.check == "sum"
                                         for e in caught), caught
    train = TrainConfig(model="tiny", wire="fp32")
    sizes = verify_volumes(VerifyConfig(), train, 2, 2)["verify_gb"]
    lossy = verify_volumes(VerifyConfig(), dataclasses.replace(train, wire="bf16"), 2, 2)["verify_gb"]
    assert sizes[0] == lossy[0] and sizes[1] < lossy[1]  # the same commitments; a sketch statement half as long


@pytest.mark.parametrize("codec,factor", [("fp32", 8.0), ("fp32", -1.0), ("int8", 8.0), ("int8", -1.0)])
def test_an_owner_that_scales_its_sums_is_named_by_everyone_with_evidence(codec, factor):
    feedbacks = [ErrorFeedback(Codec(codec)) for _ in GROUP]
    feedbacks[1] = Scaling(Codec(codec), factor, start=2)
    outcomes = run_steps(codec, 4, feedbacks)
    assert all(o is None for member in outcomes for o in member[:2])  # honest until step 2
    for r in (0, 2):
        error = outcomes[r][2]
        assert isinstance(error, VerificationFailed), outcomes[r]
        finding = error.finding
        assert (finding.member, finding.step, finding.check) == (GROUP[1], 2, "sum") and finding.ratio > 1
        assert judge_evidence(finding.evidence, GROUP[1], RUN) is None  # a third party sees it too
        assert judge_evidence(finding.evidence, GROUP[0], RUN) is not None  # not signed by the one it is used against
        assert judge_evidence(finding.evidence, GROUP[1], "another-run") is not None
        forged = bytearray(finding.evidence)
        forged[len(forged) // 3] ^= 0x40
        assert judge_evidence(bytes(forged), GROUP[1], RUN) is not None
    assert outcomes[1][2] is None  # the owner's own checks of the others pass


class MemoryStepLink:
    """A step's link in memory (``runtime.link.StepLink``): a message waits in the receiver's queue for its step."""

    def __init__(self, queues: Queues, me: str, step: int):
        self.queues, self.me, self.step = queues, me, step

    def send(self, peer, kind, micro_batch, part, tensor):
        self.queues.q((self.step, self.me, peer, str(kind), micro_batch, part)).put(tensor)
        done: Future = Future()
        done.set_result(None)
        return done

    def recv(self, peer, kind, micro_batch, part, shape, dtype):
        try:
            return self.queues.q((self.step, peer, self.me, str(kind), micro_batch, part)).get(timeout=RECV_S)
        except queue.Empty:
            raise TimeoutError(f"nothing from {peer}") from None


def run_shadowed_steps(codec_name, steps, feedbacks, numels=(1000, 517)):
    """Every member's steps with the sum check in the next step's shadow (``ShadowSums``, as the agents run it):
    per member the list of per-step outcomes of the step's hook (None, or the error it raised) and the step the
    shadow held unverified then."""
    from p2ptrain.runtime.link import GroupOverLink
    from p2ptrain.verify.sum_shadow import ShadowSums

    n, codec = len(GROUP), Codec(codec_name)
    shadows = [ShadowSums(SumChecker(IDENTITIES[r].private_key, RUN, 0, GROUP, codec), GROUP, len(numels) + 2,
                          steps - 1) for r in range(n)]
    gen = torch.Generator().manual_seed(3)
    queues = Queues()
    outcomes = [[] for _ in range(n)]
    for step in range(steps):
        flats = [[torch.randn(m, generator=gen) for m in numels] for _ in range(n)]
        for f in feedbacks:
            if isinstance(f, Scaling):
                f.step = step

        def member(r, flats=flats, step=step):
            link = MemoryStepLink(queues, GROUP[r], step)
            shadows[r].begin_step(0, step)
            shadows[r].wrap(link)  # the step before's check begins, over this step's link
            records = [ReduceRecord() for _ in numels]
            for b in range(len(numels)):
                sharded_all_reduce(flats[r][b], r, n, GroupOverLink(link, GROUP, b), feedbacks[r], key=b,
                                   record=records[b])
            try:
                shadows[r](records, r, n, GroupOverLink(link, GROUP, len(numels) + 1))
            except (VerificationFailed, TimeoutError) as e:
                return e, shadows[r].unverified
            return None, shadows[r].unverified

        with ThreadPoolExecutor(n) as pool:
            for r, outcome in enumerate(pool.map(member, range(n))):
                outcomes[r].append(outcome)
        if any(error is not None for member_outcomes in outcomes for error, _ in member_outcomes[-1:]):
            break
    return outcomes, shadows


def test_in_the_next_steps_shadow_the_sums_are_checked_one_step_late_and_a_failure_stops_the_step_after():
    """``ShadowSums``: a step's hook sets its sums aside, their check runs during the next step over that step's
    link, and the next step's hook raises its failure (naming the step checked) before that step is applied; the
    step applied unchecked is ``unverified`` until its check passes; the last step is checked in its own hook."""
    honest, shadows = run_shadowed_steps("int8", 4, [ErrorFeedback(Codec("int8")) for _ in GROUP])
    assert all(outcome == (None, step if step < 3 else None) for member in honest for step, outcome in
               enumerate(member)), honest
    assert all(s.checked_steps == 4 and s.unverified is None for s in shadows)
    feedbacks = [ErrorFeedback(Codec("fp32")) for _ in GROUP]
    feedbacks[1] = Scaling(Codec("fp32"), 8.0, start=1)
    outcomes, _ = run_shadowed_steps("fp32", 4, feedbacks)
    for r in (0, 2):
        assert [error for error, _ in outcomes[r][:2]] == [None, None]  # step 1's hook: its sums set aside
        error, unverified = outcomes[r][2]  # step 2's hook: step 1's check failed
        assert isinstance(error, VerificationFailed), outcomes[r]
        assert (error.finding.member, error.finding.step, error.finding.check) == (GROUP[1], 1, "sum")
        assert unverified == 1 and judge_evidence(error.finding.evidence, GROUP[1], RUN) is None


def test_an_honest_statement_is_no_evidence():
    """What a liar would forward: an honest member's real statement proves nothing against it."""
    captured = {}

    def capture(step):
        def keep(message):
            captured.setdefault(step, statement.from_message(message))
            return message
        return {(1, "sketch"): keep}

    outcomes = run_steps("fp32", 2, tamper=capture)
    assert all(o is None for member in outcomes for o in member)
    assert judge_evidence(statement.trimmed(captured[1]), GROUP[1], RUN) == "the accused's attested sums add up"


@pytest.mark.parametrize("kind,how,check", [
    ("sketch", "garble", "statement"), ("commit", "garble", "statement"), ("commit", "resign", "statement"),
])
def test_bad_statements_are_refused_and_blame_their_sender(kind, how, check):
    def garble(message):
        out = message.clone()
        out[100] ^= 0x01
        return out

    def resign(message):  # a well-signed statement by someone else (member 0's key) in member 2's name
        body = statement.open_signed(statement.from_message(message), GROUP[2])
        return statement.to_message(statement.sign(IDENTITIES[0].private_key, body), message.numel() - 4108)

    tamper = {"garble": garble, "resign": resign}[how]
    outcomes = run_steps("fp32", 2, tamper=lambda step: {(2, kind): tamper} if step == 1 else {})
    for r in (0, 1):
        error = outcomes[r][1]
        assert isinstance(error, VerificationFailed) and error.finding.member == GROUP[2], outcomes[r]
        assert error.finding.check == check and error.finding.evidence is None
        assert "refused" in error.finding.reason


@pytest.mark.parametrize("kind", ["reduce_shard", "gather_shard"])
def test_a_member_that_sends_other_messages_than_it_commits_to_is_named_before_anyone_attests(kind, monkeypatch):
    """Member 2 multiplies what it sends by -8 below its record (it commits to the clean messages): every member
    that received one names it (check ``commit``) before attesting anything, so member 2's own honest checks
    have no statement to accuse anyone with: it is left waiting on statements that never come (a failed call)."""
    monkeypatch.setitem(globals(), "RECV_S", 2.0)  # member 2 waits this long for the statements
    outcomes = run_steps("fp32", 3, tamper=lambda step: {(2, kind): lambda m: m * -8.0} if step == 1 else {})
    receivers = (0, 1)  # a gather shard goes to every member, a reduce shard to every other owner
    for r in receivers:
        error = outcomes[r][1]
        assert isinstance(error, VerificationFailed), outcomes[r]
        assert (error.finding.member, error.finding.check, error.finding.evidence) == (GROUP[2], "commit", None)
        assert "not the message it committed to" in error.finding.reason
    assert isinstance(outcomes[2][1], TimeoutError), outcomes[2]  # no statement of theirs to accuse them with


def test_a_commitment_for_another_step_is_refused():
    n = len(GROUP)
    codec = Codec("fp32")
    verifiers = [SumChecker(IDENTITIES[r].private_key, RUN, 0, GROUP, codec) for r in range(n)]
    queues = Queues()
    flats = [torch.randn(100) for _ in range(n)]

    def member(r):
        record = ReduceRecord()
        sharded_all_reduce(flats[r], r, n, Exchange(queues, r, 0), ErrorFeedback(codec), record=record)
        verifiers[r].begin_step(0, 5 if r == 2 else 4)  # member 2 signs for step 5
        try:
            verifiers[r]([record], r, n, Exchange(queues, r, 9))
        except VerificationFailed as e:
            return e

    with ThreadPoolExecutor(n) as pool:
        results = list(pool.map(member, range(n)))
    for r in (0, 1):
        assert results[r].finding.member == GROUP[2] and "another run, epoch, step" in results[r].finding.reason


def test_evidence_that_does_not_parse_is_refused_with_a_reason():
    key = IDENTITIES[1].private_key
    for body in (b"", b"\x00" * 3, b"\xff\xff\xff\xff", (600).to_bytes(4, "little") + b"[" * 596,
                 (20).to_bytes(4, "little") + b'{"kind": "sketch"}  '):
        why = judge_evidence(statement.sign(key, body), GROUP[1], RUN)
        assert isinstance(why, str) and "\n" not in why, why
    assert judge_evidence(b"garbage", GROUP[1], RUN) is not None


class HidingOwner(SumChecker):
    """An owner that scales its sums and attests the sketch of the honest sum (what a careful cheat would say)."""

    def _attest(self, record, b, rank, n, seed):
        honest = record.gathered[rank].clone() / 8.0  # fp32: the message is the (scaled) sum itself
        record = ReduceRecord(record.sent, record.added, {**record.gathered, rank: honest}, record.sizes)
        return super()._attest(record, b, rank, n, seed)


class Misreporting(SumChecker):
    """An owner that attests a contribution of member 0 other than the one it received."""

    def _attest(self, record, b, rank, n, seed):
        added = {**record.added, 0: record.added[0] * 1.5}
        return super()._attest(ReduceRecord(record.sent, added, record.gathered, record.sizes), b, rank, n, seed)


class Censoring(SumChecker):
    """Checks and attests honestly what its all-reduce did; paired with ``censor`` below, which drops member 0's
    contribution to the shards it owns (adds zeros for it): its sums add up, only member 0 sees its entry wrong."""


class CensoringExchange:
    """An owner's exchange that hands its all-reduce zeros for ``victim``'s reduce shard (keeping the real one)."""

    def __init__(self, inner, victim):
        self.inner, self.victim, self.real = inner, victim, None

    def send(self, to_rank, kind, part, tensor):
        return self.inner.send(to_rank, kind, part, tensor)

    def recv(self, from_rank, kind, part, shape, dtype):
        message = self.inner.recv(from_rank, kind, part, shape, dtype)
        if from_rank == self.victim and str(kind) == "reduce_shard":
            self.real = message
            return torch.zeros_like(message)  # fp32: the message of zeros
        return message


def censor(victim: int):
    """An owner's all-reduce that adds nothing for member ``victim``, its real message recorded as received."""
    def reduce(flat, r, n, exchange, feedback=None, key=0, record=None):
        censoring = CensoringExchange(exchange, victim)
        out = sharded_all_reduce(flat, r, n, censoring, feedback, key, record)
        record.received[victim] = censoring.real
        return out
    return reduce


def _run_cheat(cheat):
    n, codec = len(GROUP), Codec("fp32")
    feedbacks = [ErrorFeedback(codec) for _ in range(n)]
    if cheat is HidingOwner:
        feedbacks[1] = Scaling(codec, 8.0, start=0)
    verifiers = [(cheat if r == 1 else SumChecker)(IDENTITIES[r].private_key, RUN, 0, GROUP, codec)
                 for r in range(n)]
    queues = Queues()
    flats = [torch.randn(300, generator=torch.Generator().manual_seed(r)) for r in range(n)]

    def member(r):
        record = ReduceRecord()
        reduce = censor(0) if cheat is Censoring and r == 1 else sharded_all_reduce
        reduce(flats[r], r, n, Exchange(queues, r, 0), feedbacks[r], record=record)
        verifiers[r].begin_step(0, 0)
        try:
            verifiers[r]([record], r, n, Exchange(queues, r, 9))
        except (VerificationFailed, TimeoutError) as e:
            return e

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(member, range(n)))


@pytest.mark.parametrize("cheat,check,who", [(HidingOwner, "claim", (0, 2)), (Misreporting, "attest", (0,)),
                                             (Censoring, "attest", (0,))])
def test_an_owner_whose_statement_misdescribes_what_it_sent_or_received_is_proven_wrong(cheat, check, who):
    """Checks (b) and (c) come with the evidence a third party re-checks (``dispute.judge_shard``): the step's
    signed commitments, the owner's statement and the disputed message."""
    results = _run_cheat(cheat)
    for r in who:
        finding = results[r].finding
        assert (finding.member, finding.check) == (GROUP[1], check), finding
        header = ShardHeader.from_bytes(finding.evidence)
        assert (header.member, header.finder, header.check) == (GROUP[1], GROUP[r], check)
        verdict = judge_shard(header, finding.bulk, GROUP[1], RUN, GROUP, Codec("fp32"))
        assert verdict.holds is True and verdict.ratio > 2, verdict
    if cheat is Misreporting:  # the others see its numbers not add up: proven
        assert results[2].finding.check == "sum" and judge_evidence(results[2].finding.evidence, GROUP[1], RUN) is None
    if cheat is Censoring:  # its sums add up: only its victim sees it
        assert results[2] is None or not isinstance(results[2], VerificationFailed), results[2]


def test_shard_evidence_that_does_not_hold_clears_the_accused():
    """What a liar could forward against an honest owner: its real statement with a doctored message, another
    member's commitment, another accused or bulk; each is refused with a one-line reason."""
    results = _run_cheat(Censoring)
    finding = results[0].finding
    header = ShardHeader.from_bytes(finding.evidence)
    codec = Codec("fp32")
    assert judge_shard(header, finding.bulk, GROUP[1], RUN, GROUP, codec).holds is True

    def verdict(bulk=finding.bulk, accused=GROUP[1], run=RUN, **changes):
        changed = dataclasses.replace(header, **changes)
        if bulk is not finding.bulk and "bulk_sha256" not in changes:
            changed = dataclasses.replace(changed, bulk_bytes=len(bulk), bulk_sha256=hashlib.sha256(bulk).hexdigest())
        out = judge_shard(changed, bulk, accused, run, GROUP, codec)
        assert isinstance(out.reason, str) and "\n" not in out.reason, out
        return out

    unpacked = unpack(finding.bulk)
    message = unpacked.messages[("shard", "attest", 0)]
    honest = pack(Bulk(unpacked.commitment, {("shard", "attest", 0): message * 0}, []))  # what it "added"
    assert verdict(honest).holds is False and "committed to" in verdict(honest).reason
    assert verdict(accused=GROUP[2], member=GROUP[2]).holds is False  # not the one whose statement it is
    assert verdict(run="another-run").holds is False
    assert verdict(finding.bulk + b"x", bulk_sha256=header.bulk_sha256).holds is False  # not the bulk announced
    assert verdict(finder=GROUP[1]).holds is False
    assert verdict(check="claim").holds is False  # its own reduced shard is what it signed
    statements = statement.split(unpacked.commitment)
    swapped = pack(Bulk(b"".join([statements[1], statements[0], *statements[2:]]),
                        unpacked.messages, []))
    assert verdict(swapped).holds is False and "refused" in verdict(swapped).reason
    garbled = bytearray(finding.bulk)
    garbled[len(garbled) // 2] ^= 0x08
    assert verdict(bytes(garbled)).holds is False
    for blob in (b"", b"p2ptrain/shard-evidence/1\n{", b"p2ptrain/shard-evidence/1\n[]", finding.evidence[:-3]):
        with pytest.raises(ValueError):
            ShardHeader.from_bytes(blob)
