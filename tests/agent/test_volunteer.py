"""The volunteer's path in agent/README.md works as written: its marked shell blocks, run by two
"volunteers" (two home directories) on this machine, with the bootstrap line and the listen address (the two
values the README tells a volunteer to fill in) replaced by a local bootstrap's and a loopback port."""

from __future__ import annotations

import os
import re
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from agent_helpers import wait_for

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
MARK = "<!-- volunteer-path -->"


def volunteer_script(bootstrap_line: str) -> str:
    readme = (REPO / "agent" / "README.md").read_text()
    blocks = re.findall(re.escape(MARK) + r"\s*```bash\n(.*?)```", readme, flags=re.S)
    assert len(blocks) == readme.count(MARK) >= 2, "every marked block must be a bash block"
    script = "\n".join(blocks)
    for name, value in (("BOOTSTRAP", bootstrap_line), ("LISTEN", "/ip4/127.0.0.1/tcp/0")):
        script, count = re.subn(rf'^{name}=".*"$', f'{name}="{value}"', script, flags=re.M)
        assert count == 1, f"the README must set {name} exactly once"
    return script


@pytest.mark.timeout(240)
def test_the_volunteer_path_of_the_agent_readme_runs_as_written(tmp_path):
    announce = tmp_path / "bootstrap.maddrs"
    with open(tmp_path / "bootstrap.log", "wb") as log:
        bootstrap = subprocess.Popen(
            [sys.executable, "-m", "p2ptrain", "bootstrap", "--host-maddrs", "/ip4/127.0.0.1/tcp/0",
             "--announce-file", str(announce)], stdout=subprocess.DEVNULL, stderr=log, start_new_session=True,
        )
    volunteers: list[subprocess.Popen] = []
    try:
        wait_for(announce.exists, 60, "the bootstrap's address line")
        script = volunteer_script(announce.read_text().strip())
        bin_dir = str(Path(sys.executable).parent)  # `p2ptrain` as installed next to this interpreter
        for k in range(2):
            home = tmp_path / f"volunteer-{k}"
            home.mkdir()
            env = {**os.environ, "HOME": str(home), "PATH": f"{bin_dir}:{os.environ['PATH']}"}
            env.pop("XDG_CACHE_HOME", None)  # the README's default cache dir, inside the volunteer's home
            with open(home / "agent.log", "wb") as log:
                volunteers.append(subprocess.Popen(["bash", "-euo", "pipefail", "-c", script], cwd=REPO, env=env,
                                                   stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        codes = [v.wait(timeout=200) for v in volunteers]
        logs = [(tmp_path / f"volunteer-{k}" / "agent.log").read_text() for k in range(2)]
        assert codes == [0, 0], logs[0][-2000:] + logs[1][-2000:]
    finally:
        for proc in [*volunteers, bootstrap]:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(30)
    for k, log in enumerate(logs):
        assert "joined run 'demo' as peer" in log and "epoch 0 step 20/20" in log and "done: 20 steps" in log
        identity = tmp_path / f"volunteer-{k}" / ".local/share/p2ptrain/agent.id"
        assert stat.S_IMODE(identity.stat().st_mode) == 0o600  # created on the first start, private
        assert (tmp_path / f"volunteer-{k}" / ".cache/p2ptrain/device_profiles.json").exists()
    assert sum("published plan epoch 0" in log for log in logs) == 1  # one leader
    assert any(re.search(r"epoch 0 step 20/20 loss \d", log) for log in logs)
