"""Records are untrusted: HTML and JavaScript in every free-text field of every record kind come out of the
monitor as data (JSON with no markup in its bytes) and reach the page only as text (headless Chromium).

A real DHT (a bootstrap and a writer in this process) and a real ``p2ptrain monitor`` process; the writer
publishes signed, schema-valid records whose free text is hostile: the device name and region of its peer
record, and the reason of its plan (the other strings of the records are patterns that admit no markup:
versions, objectives, baseline names, multiaddrs, peer IDs, the run ID).
"""

from __future__ import annotations

import asyncio
import json

import pytest
from agent_helpers import wait_for
from browser import CHROMIUM, CHROMIUM_MISSING, Chromium
from monitor_helpers import get, get_state, start_monitor, stop_process, tensorboard_scalars

from p2ptrain.net.dht.node import DHTConfig, SwarmDHT
from p2ptrain.net.dht.records import LinkMeasurement, LinksRecord, PeerRecord, PlanRecord, ProgressRecord
from p2ptrain.net.identity import generate_identity

pytestmark = pytest.mark.integration

RUN = "hostile"
LOOPBACK = ("/ip4/127.0.0.1/tcp/0",)
NAME = '<script>window.__pwned=1</script><img src=x onerror="window.__pwned=2">'
REGION = '"><svg onload="window.__pwned=3">&amp;\'x'
REASON = "</title><script>window.__pwned=4</script><b>bold</b> & <a href=javascript:alert(1)>x</a>"


@pytest.fixture(scope="module")
def hostile_monitor(tmp_path_factory):
    """A monitor watching a run whose only peer writes hostile text; yields (its URL, the writer's peer ID,
    the DHT's address line)."""
    workdir = tmp_path_factory.mktemp("hostile")
    with SwarmDHT(None, DHTConfig(host_maddrs=LOOPBACK)) as bootstrap:
        maddrs = bootstrap.get_visible_maddrs()
        with SwarmDHT(RUN, DHTConfig(initial_peers=tuple(maddrs), host_maddrs=LOOPBACK)) as writer:
            me = writer.peer_id
            writer.publish_peer(PeerRecord(device_name=NAME, memory_gb=16.0, tflops=50.0, region=REGION,
                                           maddrs=tuple(writer.get_visible_maddrs()[:4])))
            other = generate_identity().peer_id
            writer.publish_links(LinksRecord.from_peers({other: LinkMeasurement(12.0, 1.0)}))
            writer.publish_plan(PlanRecord(epoch=0, membership=(me,), stages=1, replicas=1, pipelines=((0,),),
                                           cost_s=2.0, reason=REASON, baselines=(("megatron", 3.0),)))
            writer.publish_progress(ProgressRecord(0, 3, 2.5, 0.2), refresh=True)
            proc, url = start_monitor(workdir, " ".join(maddrs), RUN)
            try:
                def complete():
                    state = get_state(url)
                    return state["peers"] and state["plan"] and state["series"]["loss"]

                wait_for(complete, 90, "the monitor showing the hostile peer, its plan and its loss", poll_s=0.5)
                yield url, me, " ".join(maddrs)
            finally:
                stop_process(proc)


def test_hostile_text_comes_out_of_the_api_as_data_not_markup(hostile_monitor):
    url, me, _ = hostile_monitor
    body, headers = get(url + "api/state")
    assert not {b"<", b">", b"&", b"'"} & {bytes([c]) for c in body}, "markup characters in the JSON bytes"
    assert headers["Content-Type"].startswith("application/json")
    assert headers["X-Content-Type-Options"] == "nosniff" and "script-src 'self'" in headers["Content-Security-Policy"]
    state = json.loads(body)
    (peer,) = state["peers"]
    assert (peer["peer_id"], peer["device_name"], peer["region"]) == (me, NAME, REGION)  # faithful, as data
    assert state["plan"]["reason"] == REASON and state["plan"]["baselines"] == {"megatron": 3.0}
    assert any(REASON in e["text"] for e in state["events"] if e["kind"] == "plan")
    assert state["series"]["loss"] == [[3, 2.5]]
    page, _ = get(url)
    metrics, _ = get(url + "metrics")
    for hostile in (NAME, REGION, REASON):
        assert hostile.encode() not in page and hostile.encode() not in metrics
    assert b"<script" not in metrics and b'p2ptrain_loss{run="hostile"} 2.5' in metrics


@pytest.mark.skipif(CHROMIUM is None, reason=CHROMIUM_MISSING)
@pytest.mark.timeout(300)
def test_hostile_text_renders_as_text_in_chromium(hostile_monitor, tmp_path):
    url, _, _ = hostile_monitor

    async def check(page):
        await page.wait_for("document.querySelectorAll('#peers tbody tr').length === 1 && "
                            "document.querySelectorAll('#plan td.cell').length === 1 && "
                            "document.querySelectorAll('#loss-chart circle.point').length === 1", 120,
                            "the page drawing the hostile peer, its plan and its loss")
        await page.screenshot(tmp_path / "hostile.png")
        return await page.evaluate("""({
            pwned: window.__pwned === undefined ? null : window.__pwned,
            scripts: document.scripts.length,
            injected: document.querySelectorAll('img, b, a[href^="javascript"], [onload], [onerror]').length,
            device: document.querySelector('#peers td.device').textContent,
            region: document.querySelector('#peers td.region').textContent,
            title: document.getElementById('plan-title').textContent,
            events: document.getElementById('events').textContent,
        })""")

    with Chromium(tmp_path) as chrome:
        found = asyncio.run(chrome.visit(url, check))
    assert found["pwned"] is None and found["scripts"] == 1 and found["injected"] == 0, found
    assert (found["device"], found["region"]) == (NAME, REGION)
    assert REASON in found["title"] and REASON in found["events"]
    assert (tmp_path / "hostile.png").stat().st_size > 10_000


def test_tensorboard_event_files_of_a_monitor(hostile_monitor, tmp_path):
    pytest.importorskip("tensorboardX")
    _, _, maddrs = hostile_monitor
    proc, url = start_monitor(tmp_path, maddrs, RUN, "--tensorboard", str(tmp_path / "tb"))
    try:
        wait_for(lambda: get_state(url)["series"]["loss"], 90, "the second monitor seeing the loss", poll_s=0.5)
    finally:
        assert stop_process(proc) == 0  # SIGTERM: it writes what it has and closes the event file
    scalars, texts = tensorboard_scalars(tmp_path / "tb")
    assert scalars["train/loss"] == [(3, 2.5)] and scalars["train/step_time_s"] == [(3, 0.2)]
    assert "events/plan/text_summary" in texts
