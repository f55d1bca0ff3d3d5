"""How long a follower gives its leader for a re-plan once every trainer halted (``watching.Watching``), without
I/O: a trainer that stayed away from the epoch is judged by the leader's own heartbeats before it re-plans, and a
follower that saw it stay away waits for that verdict too (a CI run passed over an honest leader judging one)."""

from __future__ import annotations

from types import SimpleNamespace

from p2ptrain.agent.churn.liveness import no_show_window_s
from p2ptrain.agent.config import AgentConfig, LivenessConfig, MembershipConfig, PlanConfig
from p2ptrain.agent.leadership import watching
from p2ptrain.agent.leadership.leader import AgentView
from p2ptrain.agent.leadership.membership import Membership
from p2ptrain.agent.leadership.plan_check import LeaderWatch
from p2ptrain.agent.leadership.run_stages import RunStages
from p2ptrain.net.dht.records import PeerRecord, PlanRecord, ProgressRecord
from p2ptrain.net.identity import generate_identity
from p2ptrain.runtime.config import TrainConfig

PEERS = tuple(sorted(generate_identity().peer_id for _ in range(4)))  # the first leads
TRAIN = TrainConfig(stages=2, global_batch_size=8, micro_batches=2, steps=1000)


def passed_over_after(no_shows: tuple[str, ...], monkeypatch) -> float:
    """Seconds from the moment we saw every trainer of epoch 1 halted until we pass its leader over."""
    config = AgentConfig(initial_peers=("/ip4/127.0.0.1/tcp/1/p2p/" + PEERS[0],), train=TRAIN,
                         membership=MembershipConfig(expect=4, poll_s=1.0),
                         liveness=LivenessConfig(interval_s=1.0), plan=PlanConfig(time_budget_s=60.0, checkers=0))
    plan = PlanRecord(epoch=1, membership=PEERS, stages=2, replicas=2, pipelines=((0, 1), (2, 3)), cost_s=0.1,
                      start_step=10)  # signed by membership[0]
    halted = {p: ProgressRecord(1, 12, None, 0.0, halted=True, leader=PEERS[0]) for p in PEERS}
    peers = {p: PeerRecord(device_name="cpu", memory_gb=8.0, tflops=1.0) for p in PEERS}
    now = [1000.0]
    monkeypatch.setattr(watching.time, "monotonic", lambda: now[0])
    leaders = LeaderWatch(4.0, 60.0, clock=lambda: now[0])

    def view() -> AgentView:  # we follow epoch 1 and read every trainer halted; our search of it took 0.1 s
        return AgentView(Membership(peers), plan, plan, None, 1, progress=halted, check_s=0.1, no_shows=no_shows)

    follower = watching.Watching(config, SimpleNamespace(slowest_store_s=lambda: 0.0), SimpleNamespace(
        write=lambda *a, **k: None), PEERS[3], leaders, view=view, started=now[0], stages=RunStages(TRAIN),
        planner=None, pricing=None, links_wait=watching.LinksWait())
    start = now[0]
    while len(follower.watch_leader(Membership(peers)).ids) == len(PEERS):
        now[0] += 0.25
        assert now[0] - start < 120, "never passed over"
    return now[0] - start


def test_a_follower_that_saw_a_trainer_stay_away_gives_the_leader_its_verdict_beyond_the_search(monkeypatch):
    plain = passed_over_after((), monkeypatch)
    judging = passed_over_after((PEERS[2],), monkeypatch)
    window_s = no_show_window_s(1.0, 4.0, 1.0, float("inf")) + 1.0  # the leader's verdict and a heartbeat
    assert plain < 10.0  # no-one to judge: the search and the grace, seconds
    assert judging - plain == window_s  # the whole window more, and no more than that
