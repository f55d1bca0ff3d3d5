"""The direct data plane in a real swarm (``[transport] direct``: tensors over sealed TCP connections beside
libp2p, ``net/transport/direct.py``): fp32 training through a killed trainer gives the single-process losses,
and no live peer is sent to over libp2p."""

from __future__ import annotations

import re
import signal
import threading
import time

import pytest
from agent_helpers import events, run_agents, sorted_identities
from test_untrusted_members import assert_reference

from p2ptrain.swarm.agent_launcher import SwarmConfig

pytestmark = pytest.mark.integration

VICTIM = 3  # stage 1's second replica in Megatron's placement (agent 4 is the spare that takes its place)


@pytest.mark.timeout(480)
def test_over_the_direct_plane_a_run_through_a_killed_trainer_gives_the_single_process_losses(tmp_path):
    sorted_identities(tmp_path, 5)
    config = SwarmConfig(agents=5, stages=2, steps=8, scenario=None, workdir=str(tmp_path), run="direct-plane",
                         call_timeout_s=15.0, strategy="megatron")
    killed: list[int] = []

    def on_start(group, agents) -> None:
        def watch() -> None:
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline:
                if any(e["event"] == "step" and e["step"] >= 3 for e in events(agents[VICTIM].events.path)):
                    group.signal(agents[VICTIM].name, signal.SIGKILL)
                    killed.append(VICTIM)
                    return
                time.sleep(0.2)

        threading.Thread(target=watch, daemon=True).start()

    agents, codes, train = run_agents(tmp_path, config, {}, {"transport": {"direct": True}}, 420, on_start=on_start)
    assert killed == [VICTIM]
    assert all(code == 0 for name, code in codes.items() if name != agents[VICTIM].name), codes
    assert_reference(agents, train)  # every step's loss, the killed trainer's first steps included
    live = [a for a in agents if a.index != VICTIM]
    logs = {a.index: a.log_path.read_text() for a in live}
    assert all("direct data plane listening" in log for log in logs.values())
    # while it trains (a peer that finished closes its plane: a copy still on its way to it then goes over libp2p)
    training = {index: log.split("agent: done:")[0] for index, log in logs.items()}
    fallbacks = {m for log in training.values() for m in re.findall(r"sending to peer (\S+) over libp2p", log)}
    assert fallbacks <= {agents[VICTIM].peer_id}, fallbacks  # only the dead peer, once it could not be reached
