"""agent/README.md's volunteer path, walked by volunteers at home: each in its own home behind a NAT router
with no port forwarded, running the README's marked shell blocks as written (only the bootstrap line filled
in, as the organiser would hand it out), with the bootstrap on the public segment.

Two homes and the bootstrap only: the homes reach each other through the bootstrap's forwarding
(``p2ptrain.net.nat.forward``; libp2p's circuits stop at 128 KiB), measure that link, plan and train: every
tensor of the pipeline crosses the forwarding. A public agent beside homes (each home reached through the
bootstrap, the public agent directly) is ``test_nat.py``'s network; a member left spare by the plan finishing
with the run is in the swarms of ``tests/agent``.
"""

from __future__ import annotations

import re

import pytest
from swarm_helpers import home_volunteer_script, start_bootstrap, start_home_volunteers, wait_all

pytestmark = pytest.mark.integration


@pytest.mark.timeout(540)
def test_two_home_volunteers_follow_the_agent_readme_without_forwarding_a_port(network, tmp_path):
    boot = network.public("boot")
    homes = [network.home(f"home{k}", uplink_mbit=40.0) for k in (1, 2)]
    script = home_volunteer_script(start_bootstrap(network, boot, tmp_path))
    procs = start_home_volunteers(network, homes, script, tmp_path)
    wait_all(procs, 420, tmp_path)
    logs = [(tmp_path / f"{name}.log").read_text() for name in procs]
    for log in logs:
        assert "joined run 'demo' as peer" in log and "done: 20 steps" in log
    boot_id = script.split('BOOTSTRAP="', 1)[1].split('"', 1)[0].rsplit("/p2p/", 1)[1]
    for log in logs:  # each reached the other through the bootstrap's forwarding
        assert re.search(rf"peer \w+ is behind NAT: reaching it through {boot_id}", log)
    assert sum("published plan epoch 0" in log for log in logs) == 1  # one leader
    assert any(re.search(r"epoch 0 step 20/20 loss \d", log) for log in logs)
