"""The monitor's view on hand-made records: roles, liveness, joins, leaves, re-plans, series, link units."""

from __future__ import annotations

import json
import random

import base58
import pytest
from monitor_helpers import tensorboard_scalars

from p2ptrain.monitor.metrics import RunCollector, make_registry
from p2ptrain.monitor.server import dumps_safe
from p2ptrain.monitor.view import RunView, Snapshot, ViewConfig, current_plan
from p2ptrain.net.dht.records import LinkMeasurement, LinksRecord, PeerRecord, PlanRecord, ProgressRecord

rng = random.Random(1)
PEERS = sorted(base58.b58encode(b"\x12\x20" + rng.randbytes(32)).decode() for _ in range(5))


def peer(i: int, **fields) -> PeerRecord:
    return PeerRecord(**{"device_name": f"GPU {i}", "memory_gb": 16.0, "tflops": 100.0, "region": f"r{i}", **fields})


def plan(epoch: int, members: list[str], pipelines, **fields) -> PlanRecord:
    stages = len(pipelines[0])
    return PlanRecord(epoch=epoch, membership=tuple(sorted(members)), stages=stages, replicas=len(pipelines),
                      pipelines=pipelines, cost_s=10.0, **fields)


def test_roles_liveness_series_and_events_follow_the_records():
    view = RunView(ViewConfig(run="demo", tokens_per_step=1000, silent_after_s=5.0))
    first = plan(0, PEERS[:4], ((0, 1), (2, 3)), baselines=(("megatron", 15.0),))
    peers = {p: peer(i) for i, p in enumerate(PEERS[:4])}
    view.update(Snapshot(100.0, peers, plans={PEERS[0]: first}))
    progress = {PEERS[1]: ProgressRecord(0, 1, 5.0, 0.5), PEERS[3]: ProgressRecord(0, 1, 5.0, 0.3),
                PEERS[0]: ProgressRecord(0, 1, None, 0.4)}
    view.update(Snapshot(101.0, peers, plans={PEERS[0]: first}, progress=progress))
    # a fifth peer joins; the leader's record expires and the next-lowest peer re-plans from step 1
    peers2 = {p: peer(i) for i, p in enumerate(PEERS) if i != 0}
    second = plan(1, PEERS[1:], ((0, 1), (2, 3)), start_step=1, reason="peer left")
    progress2 = {PEERS[2]: ProgressRecord(1, 2, 4.0, 1.0)}
    view.update(Snapshot(108.0, peers2, plans={PEERS[0]: first, PEERS[1]: second}, progress=progress2))
    state = view.state(108.0)

    assert [e["kind"] for e in state["events"]] == ["start", "plan", "join", "leave", "plan"]
    assert "peer left" in state["events"][-1]["text"] and state["events"][-1]["epoch"] == 1
    summary = state["summary"]
    assert (summary["epoch"], summary["replans"], summary["joins"], summary["leaves"]) == (1, 1, 1, 1)
    by_id = {p["peer_id"]: p for p in state["peers"]}
    assert by_id[PEERS[0]]["liveness"] == "left"
    assert by_id[PEERS[2]]["role"] == {"kind": "trainer", "pipeline": 0, "stage": 1}
    assert by_id[PEERS[1]]["leader"] and by_id[PEERS[1]]["role"]["stage"] == 0
    assert by_id[PEERS[3]]["liveness"] == "silent"  # a trainer of epoch 1 whose heartbeat has not moved for 7 s
    assert by_id[PEERS[2]]["liveness"] == "training" and by_id[PEERS[2]]["heartbeat_age_s"] == 0.0
    # a peer that halted in epoch 1 waits for a plan; one that halted in epoch 0 has had its role in epoch 1 since
    view.update(Snapshot(109.0, peers2, plans={PEERS[1]: second},
                         progress={PEERS[2]: ProgressRecord(1, 2, None, 0.0, halted=True),
                                   PEERS[4]: ProgressRecord(0, 1, None, 0.0, halted=True)}))
    liveness = {p["peer_id"]: p["liveness"] for p in view.state(109.0)["peers"]}
    assert (liveness[PEERS[2]], liveness[PEERS[4]]) == ("halted", "training")
    spare_plan = plan(2, PEERS[1:], ((0, 1),))  # PEERS[3] and PEERS[4] idle as spares, and say halted
    view.update(Snapshot(110.0, peers2, plans={PEERS[1]: spare_plan},
                         progress={PEERS[4]: ProgressRecord(2, 2, None, 0.0, halted=True)}))
    liveness = {p["peer_id"]: p["liveness"] for p in view.state(110.0)["peers"]}
    assert (liveness[PEERS[3]], liveness[PEERS[4]]) == ("spare", "spare")
    assert state["plan"]["pipelines"] == [[PEERS[1], PEERS[2]], [PEERS[3], PEERS[4]]]
    assert state["plan"]["baselines"] == {} and state["plan"]["reason"] == "peer left"
    series = state["series"]
    assert series["loss"] == [[1, 5.0], [2, 4.0]]
    assert series["step_time_s"] == [[1, 0.4], [2, 1.0]]  # the median over the step's trainers
    assert series["tokens_per_s"] == [[1, 2500.0], [2, 1000.0]]
    assert series["predicted_step_s"] == [[1, 10.0], [2, 10.0]]
    json.loads(dumps_safe(state))  # serialisable as it is


def test_a_step_redone_after_a_replan_replaces_the_older_epochs_point():
    view = RunView(ViewConfig(run="demo"))
    peers = {p: peer(i) for i, p in enumerate(PEERS[:2])}
    view.update(Snapshot(1.0, peers, progress={PEERS[1]: ProgressRecord(0, 3, 3.0, 0.1)}))
    view.update(Snapshot(2.0, peers, progress={PEERS[1]: ProgressRecord(1, 3, 2.9, 0.2)}))
    view.update(Snapshot(3.0, peers, progress={PEERS[0]: ProgressRecord(0, 3, 3.1, 0.1)}))  # late, older epoch
    assert view.state()["series"]["loss"] == [[3, 2.9]]


def test_links_are_shown_in_the_emulated_networks_units():
    view = RunView(ViewConfig(run="demo", time_scale=0.05, size_factor=0.01, emulated=True))
    peers = {p: peer(i) for i, p in enumerate(PEERS[:2])}
    links = {PEERS[0]: LinksRecord.from_peers({PEERS[1]: LinkMeasurement(5.0, 0.5)})}
    view.update(Snapshot(1.0, peers, links=links))
    matrix = view.state()["links"]
    assert matrix["peers"] == PEERS[:2]
    assert matrix["latency_ms"][0][1] == pytest.approx(100.0) and matrix["latency_ms"][1][0] is None
    assert matrix["bandwidth_gbps"][0][1] == pytest.approx(2.5)
    # per peer, the links measured by either end and the ones the planner estimates
    three = {p: peer(i) for i, p in enumerate(PEERS[:3])}
    view.update(Snapshot(2.0, three, links=links))
    matrix = view.state()["links"]
    assert matrix["measured"] == [1, 1, 0] and matrix["estimated"] == [1, 1, 2]


def test_the_current_plan_is_the_lowest_live_peers():
    old, new = plan(0, PEERS[:2], ((0, 1),)), plan(1, PEERS[1:3], ((0, 1),))
    plans = {PEERS[0]: old, PEERS[1]: new}
    assert current_plan(plans, PEERS[:3]) is old
    assert current_plan(plans, PEERS[1:3]) is new
    assert current_plan(plans, PEERS[3:]) is new  # no live signer: the newest
    assert current_plan({}, PEERS) is None


def test_relayed_peers_and_metrics():
    relay = f"/ip4/203.0.113.7/tcp/31337/p2p/{PEERS[4]}/p2p-circuit/p2p/{PEERS[0]}"
    view = RunView(ViewConfig(run="demo"))
    view.update(Snapshot(1.0, {PEERS[0]: peer(0, maddrs=(relay,)), PEERS[1]: peer(1)},
                         progress={PEERS[0]: ProgressRecord(0, 2, 4.5, 0.25)}))
    state = view.state(3.0)
    assert [p["address"] for p in state["peers"]] == ["relayed", "direct"]
    from prometheus_client import generate_latest

    text = generate_latest(make_registry(RunCollector(lambda: state, lambda: 7))).decode()
    assert 'p2ptrain_peers{liveness="waiting",run="demo"} 2.0' in text
    assert 'p2ptrain_loss{run="demo"} 4.5' in text
    assert f'p2ptrain_peer_heartbeat_age_seconds{{peer="{PEERS[0]}",run="demo"}} 2.0' in text
    assert 'p2ptrain_monitor_poll_errors_total{run="demo"} 7.0' in text


def test_json_has_no_html_meaningful_characters_yet_the_same_strings():
    hostile = {"name": "<script>alert('x')</script> & \"q\""}
    text = dumps_safe(hostile)
    assert not set("<>&'") & set(text)
    assert json.loads(text) == hostile


def test_tensorboard_gets_each_step_once_and_the_events(tmp_path):
    pytest.importorskip("tensorboardX")
    from p2ptrain.monitor.tensorboard import TensorBoardLog

    view = RunView(ViewConfig(run="demo", tokens_per_step=100))
    peers = {p: peer(i) for i, p in enumerate(PEERS[:2])}
    log = TensorBoardLog(str(tmp_path))
    for t, (step, loss) in enumerate([(1, 5.0), (1, 5.0), (2, 4.5), (3, 4.25)]):
        view.update(Snapshot(float(t), peers, plans={PEERS[0]: plan(0, PEERS[:2], ((0, 1),))},
                             progress={PEERS[1]: ProgressRecord(0, step, loss, 0.5)}))
        log.write(view.state())
        log.write(view.state())  # nothing new: nothing written twice
    log.close(view.state())  # writes step 3 (until now it waited for a later step) and drains the writer
    scalars, texts = tensorboard_scalars(tmp_path)
    assert scalars["train/loss"] == [(1, 5.0), (2, 4.5), (3, 4.25)]
    assert scalars["train/tokens_per_s"] == [(1, 200.0), (2, 200.0), (3, 200.0)]
    assert scalars["train/predicted_step_s"] == [(1, 10.0), (2, 10.0), (3, 10.0)]
    assert [t.split("/")[1] for t in texts] == ["start", "plan"]


def test_the_link_matrix_is_capped_plan_members_first():
    view = RunView(ViewConfig(run="demo", max_link_peers=2))
    view.update(Snapshot(1.0, {p: peer(i) for i, p in enumerate(PEERS)}, plans={PEERS[1]: plan(0, PEERS[1:4], ((2, 0),))}))
    matrix = view.state()["links"]
    assert matrix["peers"] == [PEERS[3], PEERS[1]] and len(matrix["latency_ms"]) == 2


def test_the_page_loads_nothing_from_elsewhere_and_writes_no_html():
    import re

    from p2ptrain.monitor.server import STATIC_DIR

    files = {path.name: path.read_text() for path in STATIC_DIR.iterdir()}
    assert set(files) == {"index.html", "app.js", "style.css"}
    for name, text in files.items():
        urls = set(re.findall(r"(?:https?:)?//[\w.-]+", text)) - {"http://www.w3.org"}  # the SVG namespace
        assert not urls, (name, urls)
        assert "@import" not in text and "url(" not in text, name
    script = files["app.js"]
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(", "new Function"):
        assert sink not in script, sink


def test_sync_mode_rounds_traffic_and_utilisation_come_from_the_training_heartbeats():
    from prometheus_client import generate_latest

    view = RunView(ViewConfig(run="demo"))
    peers = {p: peer(i) for i, p in enumerate(PEERS)}
    plans = {PEERS[0]: plan(1, PEERS[:4], ((0, 1), (2, 3)))}
    view.update(Snapshot(1.0, peers, plans=plans))
    summary = view.state()["summary"]
    assert (summary["sync"], summary["round"], summary["utilisation"], summary["sent_bytes_per_step"]) == (None,) * 4
    progress = {
        PEERS[0]: ProgressRecord(1, 6, None, 2.0, compute_s=1.5, sent_bytes=4_000_000, sync_every=4, mfu=0.3,
                                 traffic=(106, 234, 11_900)),
        PEERS[1]: ProgressRecord(1, 6, 3.5, 2.0, compute_s=0.5, sent_bytes=1_000_000, sync_every=4, mfu=0.2),
        PEERS[2]: ProgressRecord(1, 5, None, 2.0, sent_bytes=0, sync_every=4),  # compute not measured
        PEERS[3]: ProgressRecord(1, 6, None, 0.0, halted=True, mfu=0.9),  # a halt says nothing of the run's sync
        PEERS[4]: ProgressRecord(0, 9, 3.0, 1.0, compute_s=1.0, sent_bytes=9, sync_every=2),  # an older epoch's
    }
    view.update(Snapshot(2.0, peers, plans=plans, progress=progress))
    state = view.state()
    summary = state["summary"]
    assert (summary["sync"], summary["sync_every"]) == ("diloco", 4)
    assert (summary["step"], summary["round"], summary["round_steps_left"]) == (9, 2, 3)  # the highest step seen
    assert summary["utilisation"] == pytest.approx(0.5)  # the mean of 0.75 and 0.25
    assert summary["mfu"] == pytest.approx(0.25)  # the mean of what the newest epoch's trainers saw
    assert summary["sent_bytes_per_step"] == 5_000_000
    by_id = {p["peer_id"]: p for p in state["peers"]}
    assert [(by_id[p]["sent_bytes"], by_id[p]["utilisation"], by_id[p]["mfu"]) for p in PEERS] == [
        (4_000_000, 0.75, 0.3), (1_000_000, 0.25, 0.2), (0, None, None), (None, None, None), (9, 1.0, None)]
    assert by_id[PEERS[0]]["traffic"] == {"dht_calls": 106, "dht_kb": 234, "control_kb": 11_900}
    assert by_id[PEERS[1]]["traffic"] is None  # a peer that does not say
    text = generate_latest(make_registry(RunCollector(lambda: state, lambda: 0))).decode()
    assert 'p2ptrain_sync_every_steps{run="demo"} 4.0' in text and 'p2ptrain_round{run="demo"} 2.0' in text
    assert 'p2ptrain_compute_utilisation_ratio{run="demo"} 0.5' in text
    assert 'p2ptrain_mfu_ratio{run="demo"} 0.25' in text
    assert f'p2ptrain_peer_mfu_ratio{{peer="{PEERS[0]}",run="demo"}} 0.3' in text
    assert f'p2ptrain_peer_sent_bytes_per_step{{peer="{PEERS[0]}",run="demo"}} 4e+06' in text
    assert f'p2ptrain_peer_compute_utilisation_ratio{{peer="{PEERS[1]}",run="demo"}} 0.25' in text
    assert f'p2ptrain_peer_compute_utilisation_ratio{{peer="{PEERS[2]}"' not in text
    json.loads(dumps_safe(state))
    # heartbeats of agents that say nothing of their sync (older ones, or every-step runs): every step, no rounds
    view.update(Snapshot(3.0, peers, plans=plans, progress={PEERS[1]: ProgressRecord(2, 10, 3.4, 1.0, compute_s=0.5)}))
    summary = view.state()["summary"]
    assert (summary["sync"], summary["sync_every"], summary["round"], summary["round_steps_left"]) == (
        "every-step", 1, None, None)
    assert summary["sent_bytes_per_step"] is None and summary["utilisation"] == 0.5


def test_a_blame_with_evidence_is_shown_as_a_failed_check():
    view = RunView(ViewConfig(run="demo", tokens_per_step=1000, silent_after_s=5.0))
    first = plan(0, PEERS[:4], ((0, 1), (2, 3)))
    peers = {p: peer(i) for i, p in enumerate(PEERS[:4])}
    view.update(Snapshot(100.0, peers, plans={PEERS[0]: first}))
    halted = {PEERS[2]: ProgressRecord(0, 3, None, 0.0, halted=True, blame=PEERS[3], evidence=b"statement"),
              PEERS[1]: ProgressRecord(0, 3, None, 0.0, halted=True, blame=PEERS[3])}  # a plain blame: not shown
    view.update(Snapshot(101.0, peers, plans={PEERS[0]: first}, progress=halted))
    view.update(Snapshot(102.0, peers, plans={PEERS[0]: first}, progress=halted))  # read again: once
    failed = [e for e in view.state(102.0)["events"] if e["kind"] == "verify_failed"]
    assert len(failed) == 1 and failed[0]["peer"] == PEERS[3] and PEERS[2] in failed[0]["text"]
