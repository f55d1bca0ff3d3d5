"""The run settings (``agent.settings``, ``PlanRecord.wire/schedule/overlap/bucket_elements``,
``PeerRecord.settings``): pinned by each agent's config, carried by plans, and a plan that departs from them,
or names one a follower does not know, is refused."""

from __future__ import annotations

import dataclasses

import msgpack
import pytest
from agent_helpers import events, run_agents, sorted_identities

from p2ptrain.agent.config import EmulationSettings, PlanConfig
from p2ptrain.agent.leadership import settings
from p2ptrain.agent.leadership.plan_check import LeaderWatch, PlanGate, cost_check
from p2ptrain.agent.leadership.plan_maker import run_workload
from p2ptrain.net.dht.records import LinkMeasurement, LinksRecord, PeerRecord, PlanRecord, RecordError
from p2ptrain.net.identity import generate_identity
from p2ptrain.runtime.config import TrainConfig
from p2ptrain.runtime.reference import train_reference
from p2ptrain.runtime.wire import WIRE_FORMATS
from p2ptrain.swarm.agent_launcher import SwarmConfig

TRAIN = TrainConfig(model="tiny", steps=2, global_batch_size=8, micro_batches=2, stages=2)
PEERS = sorted(generate_identity().peer_id for _ in range(4))


def plan(**extra) -> PlanRecord:
    return PlanRecord(epoch=1, membership=tuple(PEERS), stages=2, replicas=2, pipelines=((0, 1), (2, 3)),
                      cost_s=1.0, **extra)


def test_a_leaders_settings_round_trip_and_a_plan_may_not_change_the_runs():
    run = dataclasses.replace(TRAIN, wire="int8", schedule="1f1b", overlap=False, bucket_elements=4096)
    record = PlanRecord.decode(plan(**settings.plan_fields(run)).encode())
    assert (record.wire, record.schedule, record.overlap, record.bucket_elements) == ("int8", "1f1b", False, 4096)
    assert settings.problem(record, run) is None
    why = settings.problem(record, TRAIN)  # a follower of an fp32 GPipe run
    assert why == ("it departs from the run's settings, which a plan may not change: wire int8 (the run's: fp32), "
                   "schedule 1f1b (the run's: gpipe), overlap 0 (the run's: 1), bucket_elements 4096 (the run's: "
                   "262144)")
    older = PlanRecord.decode(plan().encode())  # a leader that does not say: nothing on the wire, ours apply
    assert "wire" not in msgpack.unpackb(older.encode()) and settings.problem(older, run) is None


def test_the_settings_line_of_a_peer_record():
    line = settings.identity(TRAIN)
    digest = settings.training_digest(TRAIN)
    assert line == f"wire=fp32,schedule=gpipe,overlap=1,bucket_elements=262144,training={digest}"
    record = PeerRecord(device_name="dev", memory_gb=16.0, tflops=10.0, settings=line)
    assert PeerRecord.decode(record.encode()).settings == line
    assert PeerRecord.decode(PeerRecord("dev", 16.0, 10.0).encode()).settings == ""  # optional on the wire
    assert settings.described(line) == (f"wire fp32, schedule gpipe, overlap 1, bucket_elements 262144, training "
                                        f"{digest} (model shape, seed, steps, optimizer, precision, compile, initial "
                                        "weights)")
    other = settings.identity(dataclasses.replace(TRAIN, wire="bf16"))
    assert settings.described(other, line) == "wire bf16"  # only what differs
    for garbled in ("wire=fp32;rm -rf", "wire", "x" * 300, "Wire=FP32"):
        with pytest.raises(RecordError, match="settings"):
            PeerRecord(device_name="dev", memory_gb=16.0, tflops=10.0, settings=garbled)


def test_the_training_digest_names_what_every_stage_computes():
    """Optimizer, schedule length, seed, shape (activation included), precision and compile each change it; the
    run's stages, replicas and split (a plan's business) do not."""
    digest = settings.training_digest(TRAIN)
    assert len(digest) == 12 and int(digest, 16) >= 0
    same = dataclasses.replace(TRAIN, stages=1, replicas=2, layers=None, global_batch_size=8)
    assert settings.training_digest(same) == digest
    others = [dataclasses.replace(TRAIN, optimizer=dataclasses.replace(TRAIN.optimizer, clip=0.5)),
              dataclasses.replace(TRAIN, optimizer=dataclasses.replace(TRAIN.optimizer, lr=1e-3)),
              dataclasses.replace(TRAIN, steps=3), dataclasses.replace(TRAIN, seed=1),
              dataclasses.replace(TRAIN, activation="gelu_new"), dataclasses.replace(TRAIN, precision="bf16"),
              dataclasses.replace(TRAIN, compile=True)]
    assert len({settings.training_digest(o) for o in others} | {digest}) == len(others) + 1


def test_an_eager_run_keeps_the_digest_it_had_before_compile_joined():
    """``compile`` joins the digest only when on: agents of an eager run agree with agents that predate it."""
    assert settings.training_digest(TRAIN) == "2f302c1741f6"  # as computed before compile existed
    assert settings.training_digest(TrainConfig()) == "ce9b29f399e8"


@pytest.mark.parametrize("field, value", [("wire", "fp 32"), ("wire", 7), ("wire", None), ("schedule", "x" * 40),
                                          ("overlap", 1), ("overlap", "yes"), ("bucket_elements", -1),
                                          ("bucket_elements", 1.5)])
def test_garbled_settings_are_refused_on_decoding(field, value):
    fields = msgpack.unpackb(plan(wire="bf16", overlap=True, bucket_elements=64).encode())
    fields[field] = value
    with pytest.raises(RecordError, match=field):
        PlanRecord.decode(msgpack.packb(fields))


def test_a_plan_with_settings_unknown_or_other_than_the_runs_is_refused_even_unverified():
    rows = {a: LinksRecord.from_peers({b: LinkMeasurement(5.0, 1.0) for b in PEERS if b != a}) for a in PEERS}
    records = {p: PeerRecord(device_name="dev", memory_gb=16.0, tflops=10.0) for p in PEERS}
    refusals = []
    gate = PlanGate(PEERS[2], TRAIN, PlanConfig(verify=False), EmulationSettings(), LeaderWatch(10.0, 60.0), 0.0,
                    lambda: rows, lambda cluster, trainers, peers, train: run_workload(train, 2, 2),
                    lambda record, reason: refusals.append(reason))
    future = plan(wire="fp8")  # a newer leader's format
    assert not gate.accept(future, records, lambda p: 60.0, first=True) and gate.refused(future)
    assert refusals == [f"it asks for wire format 'fp8', which this agent does not know ({', '.join(WIRE_FORMATS)})"]
    assert settings.problem(plan(schedule="zb"), TRAIN).startswith("it asks for schedule 'zb'")
    int4 = plan(wire="int4")  # a rogue leader switching an fp32 run to int4: its plan even looks cheaper
    assert not gate.accept(int4, records, lambda p: 60.0, first=True) and gate.refused(int4)
    assert refusals[-1] == ("it departs from the run's settings, which a plan may not change: wire int4 (the "
                            "run's: fp32)")
    assert gate.accept(plan(**settings.plan_fields(TRAIN)), records, lambda p: 60.0, first=True)


def test_the_plan_check_prices_both_plans_with_the_runs_settings():
    rows = {a: LinksRecord.from_peers({b: LinkMeasurement(5.0, 1.0) for b in PEERS if b != a}) for a in PEERS}
    records = {p: PeerRecord(device_name="dev", memory_gb=16.0, tflops=10.0) for p in PEERS}
    seen = []

    def workload_for(cluster, trainers, peers, train):
        seen.append((train.wire, train.schedule, train.overlap))
        return run_workload(train, 2, 2)

    run = dataclasses.replace(TRAIN, wire="bf16", schedule="1f1b", overlap=False)
    cost_check(plan(wire="bf16", schedule="1f1b", overlap=False), records, rows, run, PlanConfig(),
               EmulationSettings(), workload_for, 0.1)
    assert seen == [("bf16", "1f1b", False)] * 2  # the leader's plan and our own alternative alike
    with pytest.raises(ValueError, match="departs from the run's settings"):
        cost_check(plan(wire="int4"), records, rows, run, PlanConfig(), EmulationSettings(), workload_for, 0.1)


@pytest.mark.integration
@pytest.mark.timeout(480)
def test_a_run_trains_with_its_pinned_settings_and_an_agent_with_others_refuses_in_one_line(tmp_path):
    # the run's config says bf16, 1F1B and small buckets (replicas cutting their gradients differently could
    # not all-reduce at all); agent-3 kept the defaults (fp32, GPipe, 2^18-element buckets): the others leave
    # it out, and it leaves with a line that says what to set
    sorted_identities(tmp_path, 4)
    config = SwarmConfig(agents=4, stages=2, steps=4, scenario=None, workdir=str(tmp_path), run="settings")
    run = {"wire": "bf16", "schedule": "1f1b", "bucket_elements": 4096}
    defaults = {"wire": "fp32", "schedule": "gpipe", "bucket_elements": 1 << 18}
    agents, codes, train = run_agents(tmp_path, config, {}, {"train": run, "membership": {"expect": 3}}, 420,
                                      agent_overrides={3: {"train": defaults}})
    assert [codes[a.name] for a in agents] == [0, 0, 0, 1], codes
    errors = [line for line in agents[3].log_path.read_text().splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and ("live peers agree that this run trains with wire bf16, schedule 1f1b, "
                                 "bucket_elements 4096 but this agent's settings are wire fp32, schedule gpipe, "
                                 "bucket_elements 262144") in errors[0], errors
    plans = [e for e in events(agents[0].events.path) if e["event"] == "plan"]
    assert plans and all(p["settings"] == {"wire": "bf16", "schedule": "1f1b", "overlap": True,
                                           "bucket_elements": 4096} for p in plans)
    assert all(agents[3].peer_id not in p["devices"] + p["spares"] for p in plans)
    for agent in agents[:3]:
        assert not [e for e in events(agent.events.path) if e["event"] == "plan_refused"]
        assert "ignoring peer " + agents[3].peer_id in agent.log_path.read_text()
    agents = agents[:3]
    got = {e["step"]: e["loss"] for a in agents for e in events(a.events.path)
           if e["event"] == "step" and e["loss"] is not None}
    reference = train_reference(train).losses  # fp32: the bf16 run stays close, and is not it
    assert sorted(got) == list(range(1, len(reference) + 1))
    assert all(abs(got[k] - want) <= 0.02 * abs(want) for k, want in enumerate(reference, start=1)), (got, reference)
    assert any(got[k] != want for k, want in enumerate(reference, start=1))
    # where each step went: its compute (the thread's CPU time of it) and its waits, within the step's time
    for agent in agents:
        for e in (e for e in events(agent.events.path) if e["event"] == "step"):
            parts = [e[k] for k in ("compute_s", "recv_wait_s", "reduce_wait_s", "send_wait_s")]
            assert min(parts) >= 0 and e["between_s"] >= 0, e
            assert sum(parts) <= e["step_time_s"] + 1e-5, e
            assert e["compute_cpu_s"] <= e["compute_s"] + 1e-3, e


def test_peers_with_other_settings_are_not_members_of_our_run():
    from p2ptrain.agent.leadership.membership import MembershipTracker

    ours, int4 = settings.identity(TRAIN), settings.identity(dataclasses.replace(TRAIN, wire="int4"))

    def record(line: str) -> PeerRecord:
        return PeerRecord(device_name="dev", memory_gb=16.0, tflops=10.0, settings=line)

    tracker = MembershipTracker(PEERS[0], settings=ours)
    view = tracker.update({PEERS[0]: record(ours), PEERS[1]: record(int4), PEERS[2]: record(ours)})
    assert view.ids == (PEERS[0], PEERS[2]) and tracker.refusal() is None  # a lowest-ID rogue leads nobody
    assert tracker.update({PEERS[0]: record(ours), PEERS[1]: record("")}).ids == (PEERS[0],)  # unsaid: not ours


def test_peers_that_check_less_are_not_members_of_a_run_that_checks():
    """``[verify]`` is a run setting: a peer (or a leader) that turns the checks off or down trains in no run of
    ours; the default is not said, so the line of a run with default checks is unchanged."""
    from p2ptrain.agent.leadership.membership import MembershipTracker
    from p2ptrain.verify.config import VerifyConfig

    ours = settings.identity(TRAIN, VerifyConfig())
    assert ours == settings.identity(TRAIN) and "verify=" not in ours
    off = settings.identity(TRAIN, VerifyConfig(enabled=False))
    fewer_rows = settings.identity(TRAIN, VerifyConfig(sketch_rows=8))
    no_running = settings.identity(TRAIN, VerifyConfig(running=False))
    assert len({ours, off, fewer_rows, no_running}) == 4 and "verify=off" in off

    def record(line: str) -> PeerRecord:
        return PeerRecord(device_name="dev", memory_gb=16.0, tflops=10.0, settings=line)

    tracker = MembershipTracker(PEERS[0], settings=ours)
    view = tracker.update({PEERS[0]: record(ours), PEERS[1]: record(off), PEERS[2]: record(no_running)})
    assert view.ids == (PEERS[0],)
    for config in (VerifyConfig(), VerifyConfig(false_alarm=1e-12, rate=1e-5, sketch_rows=64), VerifyConfig(enabled=False)):
        line = settings.identity(TRAIN, config)
        assert PeerRecord.decode(record(line).encode()).settings == line  # fits the peer record's settings line
