"""The evidence of a failed recompute and its judgement by a third party (``verify.evidence``, ``verify.dispute``),
on the live check's own findings (``test_verify_recompute_check.run_swarm``: 3 stages × 2 replicas in threads, real
signatures): a finder's evidence against a member whose messages are wrong holds; evidence against an honest member
(a finder that lies) does not, and neither does evidence a finder doctored (a message, the parameters, the bulk
announced, the member named) or garbage; nothing in it crashes the judge."""

from __future__ import annotations

import dataclasses
import hashlib

import pytest
import torch
from test_verify_recompute_check import CASES, CFG, RUN, run_swarm

from p2ptrain.model.stage import build_stage
from p2ptrain.runtime.reference import build_data
from p2ptrain.runtime.wire import wire_format
from p2ptrain.verify import dispute, recompute_check
from p2ptrain.verify.evidence import Bulk, DisputeHeader, pack, param_digest, unpack
from p2ptrain.verify.recompute import RecomputeCheck


def view(topology, cfg=CFG) -> dispute.RunView:
    def build(stage):
        return build_stage(cfg.shape, stage, cfg.stages, cfg.seed, precision=cfg.precision)

    return dispute.RunView(RUN, 0, topology, cfg.micro_batches, cfg.precision, wire_format(cfg.wire),
                           build_data(cfg), cfg.shape.hidden_size, build)


def findings(errors):
    return [e.finding for e in errors.values() if e.finding.check == "recompute"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", ["activation noise", "activation gradient noise", "skipped compute"])
def test_the_evidence_against_a_member_whose_messages_are_wrong_holds(case):
    topology, _, errors, _ = run_swarm(CASES[case][0])
    found = findings(errors)
    assert found, errors
    for finding in found:
        header = DisputeHeader.from_bytes(finding.evidence)
        assert header.bulk_bytes == len(finding.bulk) and header.member == finding.member
        verdict = dispute.judge_recompute(header, finding.bulk, finding.member, view(topology))
        assert verdict.holds is True and verdict.ratio > 1, verdict
        assert verdict.ratio == pytest.approx(finding.ratio, rel=1e-3)  # the judge redid what the finder did


@pytest.fixture(scope="module")
def lie():
    """An honest run in which every verifier, at step 1, claims its member's first checked micro-batch failed:
    its evidence is the member's real, honest work."""
    real = recompute_check.check_micro_batch

    def lying(module, stage, num_stages, wire, precision, rows, *args):
        checks = real(module, stage, num_stages, wire, precision, rows, *args)
        return [(what, RecomputeCheck(9.9, 9.9, 0)) for what, _ in checks]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(recompute_check, "check_micro_batch", lying)
        topology, _, errors, _ = run_swarm()
    found = findings(errors)
    assert len(found) == CFG.stages * CFG.replicas  # every member blamed by its verifier
    return topology, found


@pytest.mark.timeout(120)
def test_evidence_against_an_honest_member_does_not_hold(lie):
    topology, found = lie
    for finding in found:
        verdict = dispute.judge_recompute(DisputeHeader.from_bytes(finding.evidence), finding.bulk, finding.member,
                                          view(topology))
        assert verdict.holds is False and verdict.ratio < dispute.LIAR_BELOW, verdict
        assert "its work holds" in verdict.reason


def _doctored(finding, change):
    """The finding's bulk changed by ``change`` (a function of the unpacked bulk), with a header that announces it."""
    bulk = pack(change(unpack(finding.bulk)))
    header = dataclasses.replace(DisputeHeader.from_bytes(finding.evidence), bulk_bytes=len(bulk),
                                 bulk_sha256=hashlib.sha256(bulk).hexdigest())
    return header, bulk


def _scaled_message(b: Bulk) -> Bulk:
    entry = next(e for e in b.messages if e[0] == "sent")
    return dataclasses.replace(b, messages={**b.messages, entry: b.messages[entry] * 1.5})


def _scaled_params(b: Bulk) -> Bulk:
    return dataclasses.replace(b, params=[(n, t * 1.01 if i == 0 else t) for i, (n, t) in enumerate(b.params)])


def _other_commitment(b: Bulk) -> Bulk:
    commitment = bytearray(b.commitment)
    commitment[600] ^= 1  # a digest the accused did not sign
    return dataclasses.replace(b, commitment=bytes(commitment))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("change, why", [
    (_scaled_message, "not the one the accused committed to"),
    (_scaled_params, "not the ones the accused committed to computing with"),
    (_other_commitment, "evidence is refused"),
])
def test_doctored_evidence_does_not_hold(lie, change, why):
    topology, found = lie
    finding = found[0]
    header, bulk = _doctored(finding, change)
    verdict = dispute.judge_recompute(header, bulk, finding.member, view(topology))
    assert verdict.holds is False and why in verdict.reason, verdict


@pytest.mark.timeout(120)
def test_a_bulk_or_header_that_is_not_the_one_announced_does_not_hold_and_garbage_never_crashes(lie):
    topology, found = lie
    finding, other = found[0], found[1]
    header = DisputeHeader.from_bytes(finding.evidence)
    v = view(topology)
    assert "not the one its header announced" in dispute.judge_recompute(header, other.bulk, finding.member, v).reason
    assert "names" in dispute.judge_recompute(header, finding.bulk, other.member, v).reason  # another accused
    wrong_place = dataclasses.replace(header, replica=1 - header.replica)
    assert dispute.judge_recompute(wrong_place, finding.bulk, finding.member, v).holds is False
    generator = torch.Generator().manual_seed(0)
    for n in (0, 7, 100, len(finding.bulk) // 2, len(finding.bulk)):
        noise = torch.randint(0, 256, (n,), generator=generator, dtype=torch.uint8).numpy().tobytes()
        garbled = finding.bulk[:n] + noise[: len(finding.bulk) - n] if n else noise
        for bulk in (garbled, finding.bulk[:n]):
            h = dataclasses.replace(header, bulk_bytes=len(bulk), bulk_sha256=hashlib.sha256(bulk).hexdigest())
            assert dispute.judge_recompute(h, bulk, finding.member, v).holds is False
    for blob in (b"", b"x" * 40, finding.evidence[:-3], finding.evidence.replace(b'"step"', b'"stop"')):
        with pytest.raises(ValueError):
            DisputeHeader.from_bytes(blob)


def test_a_ratio_between_the_liars_bound_and_the_allowance_is_the_finders_word(lie, monkeypatch):
    topology, found = lie
    finding = found[0]
    monkeypatch.setattr(dispute, "check_micro_batch", lambda *a: [("activation", RecomputeCheck(0.7, 0.2, 3))])
    verdict = dispute.judge_recompute(DisputeHeader.from_bytes(finding.evidence), finding.bulk, finding.member,
                                      view(topology))
    assert verdict.holds is None and verdict.ratio == 0.7


def test_a_bulk_round_trips_every_dtype_and_the_parameters_digest_binds_names_and_bytes():
    messages = {("sent", "activation", 3): torch.randn(2, 4, 8).to(torch.bfloat16),
                ("received", "activation_grad", 3): torch.randint(0, 255, (40,), dtype=torch.uint8)}
    params = [("a.weight", torch.randn(3, 5)), ("b", torch.zeros(0))]
    back = unpack(pack(Bulk(b"signed", messages, params)))
    assert back.commitment == b"signed" and back.messages.keys() == messages.keys()
    assert all(torch.equal(back.messages[k], v) and back.messages[k].dtype == v.dtype for k, v in messages.items())
    assert [(n, t.tolist()) for n, t in back.params] == [(n, t.tolist()) for n, t in params]
    assert param_digest(params) == param_digest(back.params)
    assert param_digest(params) != param_digest([("a.bias", params[0][1]), params[1]])
    assert param_digest(params) != param_digest([("a.weight", params[0][1] + 1e-7), params[1]])


@pytest.mark.timeout(120)
def test_a_member_whose_parameters_differ_in_the_last_bit_passes_and_its_failure_would_be_the_finders_word():
    """Replicas on another kind of device may round an update otherwise: the recompute's allowance covers what
    that changes, but the verifier's parameters are then no evidence of the member's (its digest is not ours)."""
    rogue = (1, 0)  # the middle stage's replica 0, as ``test_verify_recompute_check.ROGUE``
    topology, _, errors, members = run_swarm(nudged=rogue)
    assert not errors, errors
    peer = topology.pipelines[rogue[1]][rogue[0]]
    verifier = members[topology.pipelines[1 - rogue[1]][rogue[0]]][1]
    assert verifier.params_differ == {peer} and verifier.recomputed == CFG.steps  # checked, and it held
    _, _, errors, _ = run_swarm(CASES["activation noise"][0], nudged=rogue)
    found = findings(errors)
    assert found and all(f.member == peer and f.evidence is None and f.bulk is None for f in found), found
