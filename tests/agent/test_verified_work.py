"""Verified work in a real swarm (real agents as processes, real DHT, real libp2p on loopback; tiny model, 2
stages × 2 replicas, fp32): a member whose sums are wrong is named by its group within 2 steps of its first
corrupt message, with evidence the leader re-checks, quarantined at once, and the run finishes with the
single-process losses; a member that blames an honest peer with forged evidence is the one quarantined; an
honest run blames nobody. A member whose pipeline messages are wrong (noise on its activations or their
gradients, skipped compute, clean messages revealed in place of the corrupt ones it sent) is named by its
verifier at its first corrupt step (the recompute check, ``verify.recompute_check``), the step is rolled back
everywhere, it is quarantined at once (on evidence the leader redoes, or on the leader's own finding where the
leader is its verifier), and the run finishes with the single-process losses.

The corrupt members are ``corrupt_member.py`` (the real agent with its own runtime patched in its process).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from agent_helpers import events, run_agents, sorted_identities
from corrupt_member import FIRST_CORRUPT_STEP
from test_untrusted_members import assert_reference

from p2ptrain.swarm.agent_launcher import SwarmConfig

pytestmark = pytest.mark.integration

HERE = Path(__file__).resolve().parent
ROGUE = 1  # the second-lowest peer ID: a trainer, never the leader


def swarm(tmp_path, run: str, steps: int, mode: str | None, rogue: int | tuple[int, ...] = ROGUE, agents: int = 4,
          **settings):
    sorted_identities(tmp_path, agents)
    config = SwarmConfig(agents=agents, stages=2, steps=steps, scenario=None, workdir=str(tmp_path), run=run,
                         call_timeout_s=15.0, **settings)
    rogues = (rogue,) if isinstance(rogue, int) else rogue
    commands = {r: [sys.executable, str(HERE / "corrupt_member.py"), mode] for r in rogues} if mode else {}
    agents, codes, train = run_agents(tmp_path, config, commands, {}, 300)
    assert all(code == 0 for code in codes.values()), codes
    return agents, train


def all_events(agents, kind: str) -> list[dict]:
    return [e for a in agents for e in events(a.events.path) if e["event"] == kind]


@pytest.mark.timeout(360)
def test_a_member_that_scales_the_sums_it_sends_is_caught_quarantined_and_nothing_wrong_is_kept(tmp_path):
    # negated sums are caught alike (``corrupt_member.py negate``; tests/verify/test_verify_sum_check.py)
    agents, train = swarm(tmp_path, "corrupt-scale", 6, "scale")
    rogue, leader = agents[ROGUE].peer_id, agents[0]
    honest = [a for a in agents if a.index != ROGUE]
    found = all_events(honest, "verify_failed")
    assert found and {e["peer"] for e in found} == {rogue}, found
    assert {e["check"] for e in found} == {"sum"} and all(e["evidence"] and e["ratio"] > 1 for e in found)
    assert min(e["step"] for e in found) == FIRST_CORRUPT_STEP  # its first corrupt message, before it is applied
    log = events(leader.events.path)
    judged = [e for e in log if e["event"] == "evidence"]
    assert judged and all(e["accused"] == rogue and e["holds"] for e in judged), judged
    quarantined = [e for e in log if e["event"] == "quarantined"]
    assert [e["peer"] for e in quarantined] == [rogue] and "failed the sum check" in quarantined[0]["reason"]
    plans = [e for e in log if e["event"] == "plan"]
    assert rogue in plans[0]["devices"] and rogue not in plans[-1]["devices"] + plans[-1]["spares"]
    assert f"peer {rogue} failed the sum check" in "".join(a.log_path.read_text() for a in honest)
    assert_reference(honest, train)  # every step's loss the single-process one: the wrong sums were never kept


@pytest.mark.timeout(360)
def test_an_owner_that_drops_a_members_gradient_is_proven_wrong_by_its_victim_and_quarantined_at_once(tmp_path):
    """``censor``: its sums add up, so only its victim (agent 2, the other replica of stage 1 in Megatron's
    placement) sees it, by its own contribution's entry (check ``attest``); its evidence (the message with the
    step's signed commitments, a shard) goes to the leader, which re-makes the sketch: it holds, the owner is
    quarantined in the first epoch it failed (a word would need two), and nothing it summed is kept."""
    rogue_index, victim = 3, 2
    agents, train = swarm(tmp_path, "corrupt-censor", 6, "censor", rogue=rogue_index, strategy="megatron")
    rogue, leader = agents[rogue_index].peer_id, agents[0]
    honest = [a for a in agents if a.index != rogue_index]
    found = all_events(honest, "verify_failed")
    assert found and {e["peer"] for e in found} == {rogue}, found
    assert {e["check"] for e in found} == {"attest"} and all(e["evidence"] for e in found), found
    assert {a.index for a in honest if any(e["event"] == "verify_failed" for e in events(a.events.path))} == {victim}
    assert min(e["step"] for e in found) == FIRST_CORRUPT_STEP
    log = events(leader.events.path)
    judged = [e for e in log if e["event"] == "evidence"]
    assert judged and all((e["accused"], e["holds"], e["check"]) == (rogue, True, "attest") for e in judged), judged
    quarantined = [e for e in log if e["event"] == "quarantined"]
    assert [e["peer"] for e in quarantined] == [rogue] and "failed the attest check" in quarantined[0]["reason"]
    assert quarantined[0]["epoch"] == 0  # at once, on evidence
    plans = [e for e in log if e["event"] == "plan"]
    assert rogue in plans[0]["devices"] and rogue not in plans[-1]["devices"] + plans[-1]["spares"]
    assert_reference(honest, train)  # every step's loss the single-process one: the censored sums were never kept


# mode -> (the swarm's settings, what the leader's judgement says of the evidence)
FORGED = {
    # the sum check's evidence: an honest group-mate's real statement, doctored (it blames the leader with it)
    "forge": ({}, "sign"),
    # a failed recompute's: the leader's own honest work, which the liar says it redid and found wrong (agents 0
    # and 1 hold stage 0 in Megatron's placement; at 8 micro-batches one of each is recomputed every step)
    "lie": ({"strategy": "megatron", "micro_batches": 8}, "its work holds"),
}


@pytest.mark.timeout(360)
@pytest.mark.parametrize("mode", FORGED)
def test_a_member_that_blames_an_honest_peer_with_forged_evidence_is_the_one_quarantined(tmp_path, mode):
    settings, why = FORGED[mode]
    agents, train = swarm(tmp_path, f"forged-{mode}", 6, mode, **settings)
    rogue, leader = agents[ROGUE].peer_id, agents[0]
    honest = [a for a in agents if a.index != ROGUE]
    log = events(leader.events.path)
    judged = [e for e in log if e["event"] == "evidence"]
    assert [(e["blamer"], e["holds"]) for e in judged] == [(rogue, False)], judged
    accused = judged[0]["accused"]
    assert accused == leader.peer_id and why in judged[0]["reason"]  # it blamed the leader with what does not hold
    roles = [e for a in honest for e in events(a.events.path) if e["event"] == "role"]
    assert {e["leader"] for e in roles} == {leader.peer_id}  # who believed nothing: no follower passed it over
    quarantined = [e for e in log if e["event"] == "quarantined"]
    assert [e["peer"] for e in quarantined] == [rogue] and "does not hold" in quarantined[0]["reason"]
    assert not [e for e in log if e["event"] == "blamed" and e["peer"] == accused]  # not counted against it
    assert not all_events(honest, "verify_failed")
    assert_reference(honest, train)


@pytest.mark.timeout(360)
def test_an_honest_run_blames_nobody(tmp_path):
    steps = 20
    agents, train = swarm(tmp_path, "honest-verified", steps, None)
    assert not all_events(agents, "verify_failed") and not all_events(agents, "quarantined")
    assert not all_events(agents, "evidence")
    checked = "".join(a.log_path.read_text() for a in agents)
    assert checked.count(f"held in the {steps} step(s) checked") == 4  # every trainer checked every step
    # and recomputed its group-mate's challenged micro-batches: 2 each a step, at 1/8 (P(none in all) ~ 1e-10)
    recomputed = [int(n) for n in re.findall(r"every one of the (\d+) micro-batch\(es\)", checked)]
    assert len(recomputed) == 4 and sum(recomputed) > 0, recomputed
    assert_reference(agents, train)


# mode -> (the rogue: agent 1 holds stage 0 in the first plan, agent 2 stage 1 (``megatron``: agents in peer-ID
# order fill stage 0, then stage 1), the check that names it)
PIPELINE_CASES = {
    "act_noise": (1, "recompute"),
    "grad_noise": (2, "recompute"),
    "skip": (1, "recompute"),  # sends another token's activations: plausible values, not its compute's
    # corrupts every activation it sends and, once it knows which are checked, shows its verifier clean ones
    "clean_reveal": (1, "reveal"),
    # corrupts the activations of every micro-batch but those it guesses are checked (the ones it last revealed):
    # with 16 micro-batches 2 are checked a step, so it escapes a step only if both are its 2 clean ones (1/120)
    "guess": (1, "recompute"),
}
# the swarm's settings of a case beyond the rogue: ``grad_noise`` trains a model whose residual stream is in a
# subspace (``model.subspace``): the activation gradients it corrupts are 8 values a token, and the recompute of
# its stage 1 lifts them with the micro-batch's token ids
PIPELINE_SETTINGS = {"grad_noise": {"subspace": 8}}


@pytest.mark.timeout(360)
@pytest.mark.parametrize("mode", [
    # the same rogue, check and path after it as ``act_noise``; what it sends is caught in process by the test named
    pytest.param(mode, marks=pytest.mark.extended(
        "tests/verify/test_verify_recompute_check.py::test_a_corrupt_member_is_named_in_the_step_it_starts"))
    if mode == "skip" else mode for mode in PIPELINE_CASES])
def test_a_member_whose_pipeline_messages_are_wrong_is_caught_and_nothing_wrong_is_kept(tmp_path, mode):
    index, check = PIPELINE_CASES[mode]
    # 8 micro-batches per replica: at the default rate 1/8 one of each member's is recomputed every step
    shape = {"micro_batches": 16, "batch_size": 32} if mode == "guess" else {"micro_batches": 8}
    agents, train = swarm(tmp_path, f"corrupt-{mode}", 6, mode, index, strategy="megatron", **shape,
                          **PIPELINE_SETTINGS.get(mode, {}))
    rogue, leader = agents[index].peer_id, agents[0]
    honest = [a for a in agents if a.index != index]
    found = all_events(honest, "verify_failed")
    assert found and {e["peer"] for e in found} == {rogue}, found
    assert {e["check"] for e in found} == {check}, found
    assert min(e["step"] for e in found) <= FIRST_CORRUPT_STEP + 1  # within 2 steps of its first corrupt message
    log = events(leader.events.path)
    quarantined = [e for e in log if e["event"] == "quarantined"]
    assert {e["peer"] for e in quarantined} == {rogue}, quarantined
    judged = [e for e in log if e["event"] == "evidence"]
    if check == "recompute":  # the finder's evidence, redone by the leader: quarantined at its first failure
        assert judged and all(e["holds"] and e["accused"] == rogue and e["blamer"] != rogue for e in judged), judged
        assert "failed the recompute check" in quarantined[0]["reason"]
        assert [e["epoch"] for e in quarantined] == [0]
    else:  # its finder's word, here the leader's (agent 0 recomputes agent 1's): its own finding quarantines at once
        assert not judged and "a check of the leader's own" in quarantined[0]["reason"]
        assert [e["epoch"] for e in quarantined] == [0]
    plans = [e for e in log if e["event"] == "plan"]
    assert rogue in plans[0]["devices"] and rogue not in plans[-1]["devices"] + plans[-1]["spares"]
    assert f"peer {rogue} failed the {check} check" in "".join(a.log_path.read_text() for a in honest)
    assert_reference(honest, train)  # every step's loss the single-process one: nothing wrong was kept


@pytest.mark.timeout(360)
def test_a_member_that_sends_other_pipeline_messages_than_it_commits_to_goes_and_its_honest_receiver_stays(tmp_path):
    """The rogue (agent 3, stage 1; ``corrupt_member.py clean_commit``) sends noisy activation gradients and
    commits to the clean ones; its receiver (agent 1, not the leader) commits to what it received. Each one's
    check refuses the other's commitment: word against word (no receiver can prove what it received). The leader
    counts the dispute by counterpart and plans the two apart; the rogue meets a new receiver, disputes with it
    too and is quarantined; its first receiver is not (before: planned together again, both were blamed in two
    epochs and both quarantined), and the run ends on the single-process losses. (The rogue sorts last: were it
    next in line to lead, a leader judged gone under load would hand it the run, whose own finding then decides;
    docs/trust.md.)"""
    index, receiver_index = 3, 1  # megatron: pipelines [0, 2] and [1, 3]
    agents, train = swarm(tmp_path, "corrupt-clean-commit", 6, "clean_commit", index, strategy="megatron",
                          micro_batches=8)
    rogue, receiver, leader = agents[index].peer_id, agents[receiver_index].peer_id, agents[0]
    honest = [a for a in agents if a.index != index]
    found = all_events(honest, "verify_failed")
    assert found and {e["peer"] for e in found} == {rogue} and {e["check"] for e in found} == {"pipeline"}, found
    log = events(leader.events.path)
    assert [e["peer"] for e in log if e["event"] == "quarantined"] == [rogue]
    disputes = [e for e in log if e["event"] == "blamed" and e.get("dispute")]
    assert {(e["peer"], e["dispute"]) for e in disputes} >= {(rogue, receiver), (receiver, rogue)}, disputes
    plans = [e for e in log if e["event"] == "plan"]
    assert rogue in plans[0]["devices"] and rogue not in plans[-1]["devices"] + plans[-1]["spares"]
    first = min(e["epoch"] for e in disputes if e["peer"] == receiver)
    after = next(p for p in plans if p["epoch"] == first + 1)  # the plan after their dispute keeps them apart
    where = {after["devices"][d]: (i, j) for i, row in enumerate(after["plan"]["pipelines"]) for j, d in enumerate(row)}
    if rogue in where and receiver in where:
        (i, j), (i2, j2) = where[rogue], where[receiver]
        assert i != i2 and j != j2, after  # neither pipeline neighbours nor replicas of one stage
    assert_reference(honest, train)


@pytest.mark.timeout(420)
def test_two_colluders_that_dispute_with_whoever_they_meet_go_and_no_honest_peer_goes_with_them(tmp_path):
    """Agents 1 and 2 (stage 0 of 2 × 3, megatron) both send noisy activations and commit to clean ones. Each
    disputes with its receiver in epoch 0; kept apart from them, each meets a new receiver in epoch 1, and one
    honest receiver is the new counterpart of the *other* rogue: two counterparts, as each rogue has (the
    campaign's ``clean_commit @ colluding``: counted by counterpart alone, that honest peer was quarantined
    with the rogues in 3 seeds of 3). The disputes are explained by the two rogues alone (``churn.cover``):
    both go, nobody else does, and the run ends on the single-process losses."""
    rogues = (1, 2)
    agents, train = swarm(tmp_path, "corrupt-colluding", 6, "clean_commit", rogues, agents=6, strategy="megatron",
                          micro_batches=8, batch_size=24)
    bad = {agents[r].peer_id for r in rogues}
    honest = [a for a in agents if a.index not in rogues]
    log = events(agents[0].events.path)
    disputes = [e for e in log if e["event"] == "blamed" and e.get("dispute")]
    assert {e["peer"] for e in disputes} > bad, disputes  # honest peers were in disputes too
    assert {e["peer"] for e in log if e["event"] == "quarantined"} == bad, log
    assert_reference(honest, train)


@pytest.mark.timeout(360)
def test_in_a_diloco_run_a_member_that_scales_the_pseudo_gradients_it_sums_is_caught_before_the_outer_step(tmp_path):
    """DiLoCo (rounds of 2): the sum check runs on each round's all-reduce of pseudo-gradients, before the outer
    step. The rogue (agent 2: stage 0 of pipeline 1 in Megatron's placement) scales the shards it sums from step 2
    on: its group names it at the round ending at step index 3 with its own statement, the leader quarantines it
    at once, the round is redone from the round before (step 2) without it, and the run gives the losses of its
    reference replaying that re-plan (``test_swarm_diloco``)."""
    from test_swarm_diloco import replans_of

    from p2ptrain.model.outer import DiLoCoConfig
    from p2ptrain.runtime.reference import train_reference
    from p2ptrain.swarm.report import _run_loss

    rogue = 2
    agents, train = swarm(tmp_path, "corrupt-diloco", 8, "scale", rogue, strategy="megatron", sync="diloco",
                          diloco=DiLoCoConfig(inner_steps=2))
    culprit, leader = agents[rogue].peer_id, agents[0]
    honest = [a for a in agents if a.index != rogue]
    found = all_events(honest, "verify_failed")
    assert found and {e["peer"] for e in found} == {culprit} and {e["check"] for e in found} == {"sum"}, found
    assert {e["step"] for e in found} == {3} and all(e["evidence"] for e in found)  # the first corrupt round's end
    log = events(leader.events.path)
    assert [e["peer"] for e in log if e["event"] == "quarantined"] == [culprit]
    plans = [e for e in log if e["event"] == "plan"]
    assert len(plans) == 2 and plans[1]["start_step"] == 2 and culprit not in plans[1]["devices"] + plans[1]["spares"]
    final: dict[int, list[dict]] = {}  # per step, its events from the last epoch that trained it
    for e in (e for a in agents for e in events(a.events.path) if e["event"] == "step"):
        if e["step"] not in final or e["epoch"] > final[e["step"]][0]["epoch"]:
            final[e["step"]] = [e]
        elif e["epoch"] == final[e["step"]][0]["epoch"]:
            final[e["step"]].append(e)
    got = [loss for step in sorted(final) if (loss := _run_loss(final[step])) is not None]
    want = train_reference(train, replans=replans_of(plans)).losses
    assert len(got) == len(want) and all(abs(g - w) <= 1e-4 * abs(w) for g, w in zip(got, want, strict=True)), (got, want)
