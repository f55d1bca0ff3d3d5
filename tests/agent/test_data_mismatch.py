"""Every agent of a run trains the same data: an agent whose dataset (tokenizer and content digest) differs
from the run's is left out by the others and refuses to take part, with a one-line reason."""

from __future__ import annotations

import sys

import pytest
from agent_helpers import events, run_agents

from p2ptrain.agent.leadership.membership import MembershipTracker
from p2ptrain.model.prepare import PrepareConfig, prepare_dataset
from p2ptrain.model.prepared import PreparedDataset
from p2ptrain.net.dht.records import PeerRecord, RecordError
from p2ptrain.swarm.agent_launcher import SwarmConfig

A, B, C, D, E = "QmA", "QmB", "QmC", "QmD", "QmE"
OURS, THEIRS = "bpe-8000:0123456789abcdef", "byte-256:fedcba9876543210"


def record(data: str) -> PeerRecord:
    return PeerRecord(device_name="cpu", memory_gb=8.0, tflops=0.1, data=data)


def test_peers_with_other_data_are_left_out_and_only_several_of_them_refuse_this_agent():
    tracker = MembershipTracker(A, data=OURS)
    view = tracker.update({A: record(OURS), B: record(THEIRS), C: record(OURS)})
    assert view.ids == (A, C) and tracker.other_data == {B: THEIRS}
    assert tracker.refusal() is None  # one peer's word: a rogue that claims the run trains other data
    tracker.update({A: record(OURS), B: record(THEIRS), D: record(THEIRS), C: record(OURS)})
    reason = tracker.refusal()  # two agree, one shares ours: the run trains theirs
    assert reason is not None and THEIRS in reason and OURS in reason and "\n" not in reason
    assert reason.startswith("2 live peers agree that this run trains data")
    tracker.update({A: record(OURS), B: record(THEIRS), D: record(THEIRS), C: record(OURS), E: record(OURS)})
    assert tracker.refusal() is None  # as many share ours: we keep training with them
    alone = MembershipTracker(A, data=OURS)
    alone.update({A: record(OURS), B: record(THEIRS), D: record("byte-256:0000000000000000")})
    assert alone.refusal() is None  # two others, but not agreeing with each other


def test_the_data_field_is_checked_and_optional_on_the_wire():
    assert PeerRecord.decode(record(OURS).encode()).data == OURS
    assert PeerRecord.decode(PeerRecord("cpu", 8.0, 0.1).encode()).data == ""
    with pytest.raises(RecordError):
        record("not a data id\n")


@pytest.mark.integration
@pytest.mark.timeout(420)
def test_an_agent_with_another_dataset_is_refused_in_one_line(tmp_path):
    for name, text in (("ours", "the run's own corpus. " * 4000), ("theirs", "another corpus entirely! " * 4000)):
        (tmp_path / f"{name}.txt").write_text(text)
        prepare_dataset(PrepareConfig(str(tmp_path / f"{name}.txt"), str(tmp_path / name)))
    config = SwarmConfig(agents=3, stages=2, steps=40, scenario=None, workdir=str(tmp_path), run="data-mismatch")
    odd = [sys.executable, "-m", "p2ptrain", "agent", "--data", str(tmp_path / "theirs"), "--config"]
    started = {}
    agents, codes, _ = run_agents(tmp_path, config, {2: odd},
                                  {"train": {"data": str(tmp_path / "ours")}, "membership": {"expect": 2}}, 360,
                                  on_start=lambda group, agents: started.update(group=group))
    assert all(code == 0 for code in codes.values()), codes  # the run trained without it
    assert started["group"].children[agents[2].name].poll() == 1  # it left by itself, refused
    errors = [line for line in agents[2].log_path.read_text().splitlines() if line.startswith("Error:")]
    theirs, ours = PreparedDataset(tmp_path / "theirs").data_id, PreparedDataset(tmp_path / "ours").data_id
    assert len(errors) == 1 and f"this run trains data {ours} but this agent's is {theirs}" in errors[0], errors
    plans = [e for a in agents[:2] for e in events(a.events.path) if e["event"] == "plan"]  # by the leader
    assert plans and all(agents[2].peer_id not in p["devices"] + p.get("spares", []) for p in plans)
