"""agent/README.md's volunteer path, walked by volunteers at home: each in its own home behind a NAT router
with no port forwarded, running the README's marked shell blocks as written (only the bootstrap line filled
in, as the organiser would hand it out), with the bootstrap on the public segment.

* Two homes and the bootstrap only: the homes reach each other through the bootstrap's forwarding
  (``p2ptrain.net.nat.forward``; libp2p's circuits stop at 128 KiB), measure that link, plan and train.
* Two homes plus the organiser's public agent, on the example configuration (``expect = 2``): three
  members for two stages, so one is a spare; everyone finishes, the spare included.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from swarm_helpers import REPO, home_volunteer_script, start_bootstrap, start_home_volunteers, wait_all

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


@pytest.mark.timeout(540)
def test_two_home_volunteers_and_a_public_organiser_agent(network, tmp_path):
    boot, public = network.public("boot"), network.public("organiser")
    homes = [network.home(f"home{k}", uplink_mbit=40.0) for k in (1, 2)]
    line = start_bootstrap(network, boot, tmp_path)
    organiser = tmp_path / "organiser"
    (organiser / ".local" / "share" / "p2ptrain").mkdir(parents=True)  # as the README's first block does
    env = {**os.environ, "HOME": str(organiser)}
    env.pop("XDG_CACHE_HOME", None)
    with open(tmp_path / "organiser.log", "wb") as log:
        procs = {"organiser": network.popen(public, [
            sys.executable, "-m", "p2ptrain", "agent", "--config", str(REPO / "agent" / "agent.example.toml"),
            "--initial-peers", line, "--host-maddrs", "/ip4/0.0.0.0/tcp/31338", "--reachability", "public"],
            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)}  # fmt: skip
    procs.update(start_home_volunteers(network, homes, home_volunteer_script(line), tmp_path))
    wait_all(procs, 420, tmp_path)
    logs = {name: (tmp_path / f"{name}.log").read_text() for name in procs}
    for name in ("volunteer1", "volunteer2"):
        assert "joined run 'demo' as peer" in logs[name], logs[name][-2000:]
        assert "done:" in logs[name] and "Traceback" not in logs[name]
    boot_id = line.split()[0].rsplit("/p2p/", 1)[1]
    for name in ("volunteer1", "volunteer2"):  # the homes reach each other through the bootstrap's forwarding
        assert re.search(rf"peer \w+ is behind NAT: reaching it through {boot_id}", logs[name])
    assert "Traceback" not in logs["organiser"]
    assert sum("published plan epoch 0" in log for log in logs.values()) == 1  # one leader
    assert any(re.search(r"step 20/20 loss \d", log) for log in logs.values())
