"""agent/README.md's volunteer path, walked by two volunteers at home: each in its own home behind a NAT
router with no port forwarded, running the README's marked shell blocks as written (only the bootstrap
line filled in, as the organiser would hand it out), with the bootstrap on the public segment.

Not collected (a known failure, kept to reproduce it: ``pytest tests/realnet/volunteer_home_repro.py``):
with no public agent in the run, the two homes' relayed connection to each other through the bootstrap is
reset within about two seconds of every dial, so their link is never measured and every epoch halts
("routing: not found" between re-dials every ``relay.redial_s``). With one public agent it works
(``test_nat.py``). agent/README.md states the limit."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from swarm_helpers import start_bootstrap, wait_all

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
MARK = "<!-- volunteer-path -->"


def home_volunteer_script(bootstrap_line: str) -> str:
    """The README's marked blocks, in order, with the organiser's bootstrap line in ``BOOTSTRAP``."""
    readme = (REPO / "agent" / "README.md").read_text()
    blocks = re.findall(re.escape(MARK) + r"\s*```bash\n(.*?)```", readme, flags=re.S)
    assert blocks and len(blocks) == readme.count(MARK), "every marked block must be a bash block"
    script, count = re.subn(r'^BOOTSTRAP=".*"$', f'BOOTSTRAP="{bootstrap_line}"', "\n".join(blocks), flags=re.M)
    assert count == 1, "the README must set BOOTSTRAP exactly once"
    assert "--reachability private" in script, "the home path needs no open port"
    return script


@pytest.mark.timeout(540)
def test_two_home_volunteers_follow_the_agent_readme_without_forwarding_a_port(network, tmp_path):
    boot = network.public("boot")
    homes = [network.home(f"home{k}", uplink_mbit=40.0) for k in (1, 2)]
    script = home_volunteer_script(start_bootstrap(network, boot, tmp_path))
    bin_dir = str(Path(sys.executable).parent)  # `p2ptrain` as installed next to this interpreter
    procs = {}
    for k, host in enumerate(homes, start=1):
        home = tmp_path / f"volunteer{k}"
        home.mkdir()
        env = {**os.environ, "HOME": str(home), "PATH": f"{bin_dir}:{os.environ['PATH']}"}
        env.pop("XDG_CACHE_HOME", None)  # the README's default cache dir, inside the volunteer's home
        with open(tmp_path / f"volunteer{k}.log", "wb") as log:
            procs[f"volunteer{k}"] = network.popen(host, ["bash", "-euo", "pipefail", "-c", script], cwd=REPO,
                                                   env=env, stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
    wait_all(procs, 420, tmp_path)
    logs = [(tmp_path / f"{name}.log").read_text() for name in procs]
    for log in logs:
        assert "joined run 'demo' as peer" in log and "done: 20 steps" in log
    assert any("through a relay" in log for log in logs)  # one reached the other through the bootstrap
    assert sum("published plan epoch 0" in log for log in logs) == 1  # one leader
    assert any(re.search(r"epoch 0 step 20/20 loss \d", log) for log in logs)
