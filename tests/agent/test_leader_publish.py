"""The leader's store of a plan that timed out: the same record again, never a second plan of its epoch."""

from __future__ import annotations

import concurrent.futures
import json
from types import SimpleNamespace

from p2ptrain.agent.churn.replan import JOIN, Replan
from p2ptrain.agent.config import AgentConfig, MembershipConfig
from p2ptrain.agent.events import EventLog
from p2ptrain.agent.leadership.leader import AgentView, Leader, _Planning
from p2ptrain.agent.leadership.membership import Membership
from p2ptrain.agent.leadership.plan_check import LeaderWatch
from p2ptrain.agent.leadership.plan_maker import build_cluster, make_plan, run_workload
from p2ptrain.errors import ProtocolError
from p2ptrain.net.dht.records import LinkMeasurement, LinksRecord, PeerRecord, PlanRecord, ProgressRecord
from p2ptrain.net.identity import generate_identity
from p2ptrain.runtime.config import TrainConfig

PEERS = sorted(generate_identity().peer_id for _ in range(4))
BOOTSTRAP = "/ip4/127.0.0.1/tcp/1/p2p/" + PEERS[0]


class Board:
    """The DHT as the leader uses it here: its first store of a plan times out after the record landed
    (a loaded DHT answers later than ``request_timeout_s``); the progress records the trainers publish."""

    def __init__(self):
        self.keys = SimpleNamespace(run_id="publish")
        self.stored: list[PlanRecord] = []
        self.progress: dict[str, ProgressRecord] = {}

    def publish_plan(self, record: PlanRecord) -> bool:
        self.stored.append(record)
        if len(self.stored) == 1:
            raise ProtocolError("DHT store of publish.plan did not finish within request_timeout_s=10.0")
        return True

    def read_progress(self) -> dict[str, ProgressRecord]:
        return dict(self.progress)


def test_a_join_plan_whose_store_timed_out_is_stored_again_unchanged_while_training_moves_on(tmp_path):
    me, joiner = PEERS[0], PEERS[3]
    train = TrainConfig(stages=2, global_batch_size=8, micro_batches=2, steps=1000)
    config = AgentConfig(initial_peers=(BOOTSTRAP,), train=train, membership=MembershipConfig(expect=4))
    # epoch 1: one pipeline of 2 stages and a spare, from step 10; the fourth peer joins
    current = PlanRecord(epoch=1, membership=tuple(PEERS[:3]), stages=2, replicas=1, pipelines=((0, 1),),
                         cost_s=0.1, start_step=10)
    board, done = Board(), {"now": 12}
    peers = {p: PeerRecord(device_name="cpu", memory_gb=8.0, tflops=1.0) for p in PEERS}

    def view() -> AgentView:  # the agent follows epoch 1, its trainers at step done["now"]
        return AgentView(Membership(peers), current, current, done["now"], 1)

    path = tmp_path / "leader.events.jsonl"
    leader = Leader(config, board, EventLog(path), me, LeaderWatch(10.0, 60.0), view=view,
                    note_waiting=lambda s: None, boundary_s=[], started=0.0)
    try:
        rows = {a: LinksRecord.from_peers({b: LinkMeasurement(1.0, 1.0) for b in PEERS if b != a}) for a in PEERS}
        cluster = build_cluster(PEERS, peers, rows, config.emulation)
        workload = run_workload(train, 2, 2)
        future = concurrent.futures.Future()
        future.set_result(make_plan(cluster, workload, 2, config.plan))
        replan = Replan(JOIN, tuple(PEERS), f"peer(s) {joiner} joined")
        planning = _Planning(2, tuple(PEERS), list(PEERS), [], cluster, workload, replan.reason, future, replan)
        leader._publish_plan(planning)  # the store times out (the record landed: members take it up)
        assert len(board.stored) == 1 and leader.published is None and not path.exists()
        first = board.stored[0]
        assert first.epoch == 2 and first.start_step == 14  # two steps past the furthest progress (12)
        done["now"] = 20  # the trainers of epoch 1 went on before the next poll
        leader.lead(Membership(peers))  # the next poll stores the same record, not one made anew
        assert len(board.stored) == 2 and board.stored[1] == first and leader.published == first
        plans = [json.loads(line) for line in path.read_text().splitlines()]
        assert [(e["event"], e["epoch"], e["start_step"], e["replan"]) for e in plans] == [("plan", 2, 14, "join")]
    finally:
        leader.close()
