"""The monitor on a real local swarm: records → JSON API (checked against the swarm's own summary), the
``swarm --monitor`` flag, Prometheus metrics, and the page in headless Chromium.

One swarm for the module (2 agents, 2 stages, loopback, tiny model): ``p2ptrain swarm --monitor`` starts its
own monitor, and the test starts a second one (``p2ptrain monitor``) on the swarm's bootstrap. The swarm's
monitor stops with the swarm and is checked while it runs; the test's outlives the swarm, so the finished
run's page is checked at leisure, with no race against the end of training.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import time

import psutil
import pytest
from agent_helpers import read_status, swarm_command, wait_for
from browser import CHROMIUM, CHROMIUM_MISSING, Chromium
from monitor_helpers import get, get_state, monitor_url, start_monitor, stop_process

from p2ptrain.config import config_from_dict
from p2ptrain.runtime.config import TrainConfig

# one swarm for the whole module (its tests on one worker), which the test's monitor reads from its start
pytestmark = [pytest.mark.integration, pytest.mark.xdist_group("monitor-swarm")]

RUN = "watched"
STEPS = 12


@pytest.fixture(scope="module")
def watched_swarm(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("swarm")
    out, err = workdir / "swarm.out", workdir / "swarm.err"
    # the test's monitor first: it imports, then awaits the swarm's bootstrap and joins as soon as it serves.
    # Started after the bootstrap, its imports took 12 s on a loaded machine, and the swarm had trained and
    # gone before it read anything (CI, 2026-11-30)
    monitor, _ = start_monitor(workdir, workdir / "bootstrap.maddrs", RUN, wait=False)
    swarm = None
    try:
        # and the swarm once the monitor awaits it: forked from the session's fork server, the swarm's agents
        # import nothing, and 12 steps were over before a monitor still importing could join (CI, 2026-11-30)
        wait_for(lambda: (workdir / "test-monitor.imported").exists() or monitor.poll() is not None, 120,
                 "the test's monitor's imports")
        with open(out, "wb") as stdout, open(err, "wb") as stderr:
            swarm = subprocess.Popen(swarm_command(workdir, "--json", "--agents", "2", "--stages", "2", "--steps",
                                                   str(STEPS), "--scenario", "none", "--run", RUN, "--monitor"),
                                     stdout=stdout, stderr=stderr)
        url = monitor_url(workdir, monitor)
        # while the swarm runs, keep what its own monitor answers
        status = wait_for(lambda: (s := read_status(workdir)) and "monitor" in s and s or swarm.poll() is not None,
                          120, "the swarm's monitor in swarm.json")
        live = []
        deadline = time.monotonic() + 300
        while swarm.poll() is None and time.monotonic() < deadline:
            try:
                live.append(get_state(status["monitor"]["url"]))
            except OSError:
                pass  # not up yet, or already stopped with the swarm
            time.sleep(0.3)
        code = swarm.wait(60)
        summary = json.loads(out.read_text()) if out.read_text().strip() else None
        yield {"url": url, "code": code, "summary": summary, "stderr": err.read_text(), "status": status,
               "live": live, "workdir": workdir}
    finally:
        stop_process(monitor)
        if swarm is not None:
            stop_process(swarm, 90)  # SIGTERM: the swarm stops every process it started


def agent_ids(summary: dict) -> list[str]:
    return [summary["peers"][str(k)] for k in range(len(summary["peers"]))]


def monitor_log(watched_swarm: dict) -> str:
    path = watched_swarm["workdir"] / "test-monitor.log"
    return path.read_text()[-1500:] if path.exists() else ""


def trained(watched_swarm: dict) -> dict:
    """The swarm's summary; fails with the end of its output and its monitor's log unless it trained."""
    assert watched_swarm["code"] == 0 and watched_swarm["summary"], (
        f"swarm exited {watched_swarm['code']}: {watched_swarm['stderr'][-2500:]}\n"
        f"test monitor: {monitor_log(watched_swarm)}")
    return watched_swarm["summary"]


@pytest.mark.timeout(480)
def test_api_shows_the_swarms_records(watched_swarm):
    summary = trained(watched_swarm)
    state = get_state(watched_swarm["url"])
    ids = agent_ids(summary)
    assert state["run"] == RUN
    peers = {p["peer_id"]: p for p in state["peers"]}
    assert set(peers) == set(ids), (state["summary"], state["polls"], state["poll_errors"], monitor_log(watched_swarm))
    for peer_id in ids:
        peer = peers[peer_id]
        assert peer["device_name"] and peer["memory_gb"] > 0 and peer["tflops"] > 0 and peer["address"] == "direct"
        assert peer["role"]["kind"] == "trainer"
        # both stages send in every step (activations one way, their gradients the other) and compute in it
        assert peer["sent_bytes"] > 0 and peer["utilisation"] > 0 and peer["mfu"] > 0, peer
        # its control plane a minute: it read and stored records, and pinged its partner
        assert peer["traffic"]["dht_calls"] > 0 and peer["traffic"]["dht_kb"] > 0, peer
        assert peer["traffic"]["control_kb"] > 0, peer
    assert state["summary"]["sync"] in (None, "every-step")  # None once the agents' records have expired
    plan = state["plan"]
    replans = [r["epoch"] for r in summary["replans"]]  # a busy machine may halt an epoch: training goes on
    plan_epochs = [e["epoch"] for e in state["events"] if e["kind"] == "plan"]
    assert plan_epochs[0] == 0 and set(plan_epochs) <= {0, *replans} and plan["epoch"] == max([0, *replans])
    assert plan["leader"] == summary["peers"][str(summary["leader"])] == min(ids)
    assert set(plan["baselines"]) == set(summary["plan"]["baselines"]) and plan["baselines"]
    if not replans:  # the summary describes the first plan
        assert plan["pipelines"] == [[summary["peers"][str(a)] for a in row] for row in summary["plan"]["pipelines"]]
        assert plan["cost_s"] == pytest.approx(summary["predicted_cost_s"]) == plan["predicted_step_s"]
    # every loss the monitor saw is the loss the agents reported for that step (the monitor samples)
    losses = state["series"]["loss"]
    assert losses, "the monitor saw no loss"
    for step, loss in losses:
        assert 1 <= step <= STEPS and loss == pytest.approx(summary["losses"][step - 1], rel=1e-9)
    assert all(seconds > 0 for _, seconds in state["series"]["step_time_s"])
    assert state["summary"]["loss"] == losses[-1][1] and state["summary"]["epoch"] == plan["epoch"]
    links = state["links"]
    index = {p: i for i, p in enumerate(links["peers"])}
    for a in ids:
        for b in ids:
            if a != b:
                assert links["latency_ms"][index[a]][index[b]] >= 0 and links["bandwidth_gbps"][index[a]][index[b]] > 0
    metrics, headers = get(watched_swarm["url"] + "metrics")
    assert headers["Content-Type"].startswith("text/plain")
    assert f'p2ptrain_step{{run="{RUN}"}} {float(state["summary"]["step"])}'.encode() in metrics
    assert f'p2ptrain_peers{{liveness="training",run="{RUN}"}}'.encode() in metrics


@pytest.mark.timeout(480)
def test_swarm_monitor_flag_serves_the_run_while_it_trains(watched_swarm):
    summary, live = trained(watched_swarm), watched_swarm["live"]
    url = watched_swarm["status"]["monitor"]["url"]
    assert f"monitor: {url}" in watched_swarm["stderr"]
    assert live and all(s["run"] == RUN for s in live)
    assert any({p["peer_id"] for p in s["peers"]} == set(agent_ids(summary)) for s in live)
    cfg = config_from_dict(TrainConfig, summary["config"])
    assert live[-1]["tokens_per_step"] == cfg.global_batch_size * cfg.shape.seq_len
    # it stopped with the swarm
    assert not psutil.pid_exists(watched_swarm["status"]["monitor"]["pid"]) or \
        psutil.Process(watched_swarm["status"]["monitor"]["pid"]).status() == psutil.STATUS_ZOMBIE
    with pytest.raises(OSError):
        get(url + "healthz", timeout_s=5)


@pytest.mark.skipif(CHROMIUM is None, reason=CHROMIUM_MISSING)
@pytest.mark.timeout(480)
def test_page_of_a_real_swarm_in_chromium(watched_swarm, tmp_path):
    ids = agent_ids(trained(watched_swarm))
    state = get_state(watched_swarm["url"])
    points = len(state["series"]["loss"])

    async def check(page):
        found = await page.wait_for(f"""(() => {{
            const rows = [...document.querySelectorAll('#peers tbody tr')].map(r => r.dataset.peer);
            const cells = [...document.querySelectorAll('#plan td.cell')].map(c => c.dataset.peer);
            const points = document.querySelectorAll('#loss-chart circle.point').length;
            const links = document.querySelectorAll('#latency-map rect.link').length;
            return rows.length === 2 && cells.length === 2 && points === {points} && links === 2
                && {{rows, cells, points, links, events: document.querySelectorAll('#events li').length}};
        }})()""", 120, "the page listing the peers, drawing the plan, the loss points and the links")
        await page.screenshot(tmp_path / "swarm.png")
        found["elsewhere"] = await page.evaluate(
            "performance.getEntriesByType('resource').map(r => r.name).filter(n => !n.startsWith(location.origin))")
        return found, page.exceptions()

    with Chromium(tmp_path) as chrome:
        found, exceptions = asyncio.run(chrome.visit(watched_swarm["url"], check))
    assert sorted(found["rows"]) == sorted(ids) and sorted(found["cells"]) == sorted(ids)
    assert found["events"] >= 2 and not exceptions, exceptions
    assert found["elsewhere"] == []  # every script, style and request went to the monitor itself
    assert (tmp_path / "swarm.png").stat().st_size > 10_000
