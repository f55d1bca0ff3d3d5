"""Running p2ptrain's real commands inside the test network: a bootstrap, agents (``events`` and ``wait_for``
are the agent tests' own)."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

from agent_helpers import events, wait_for  # noqa: F401 - re-exported for the tests here
from netns import Host, Network

BOOTSTRAP_PORT = 31337


def start_bootstrap(net: Network, host: Host, workdir: Path, *args: str) -> str:
    """``p2ptrain bootstrap`` on ``host`` at a fixed port; returns its address line."""
    announce = workdir / "bootstrap.maddrs"
    with open(workdir / "bootstrap.log", "wb") as log:
        net.popen(host, [sys.executable, "-m", "p2ptrain", "-v", "bootstrap", "--host-maddrs",
                         f"/ip4/0.0.0.0/tcp/{BOOTSTRAP_PORT}", "--announce-file", str(announce), *args],
                  stdout=subprocess.DEVNULL, stderr=log)
    wait_for(announce.exists, 90, "the bootstrap's address line")
    return announce.read_text().strip()


def start_agent(net: Network, host: Host, workdir: Path, name: str, *args: str) -> subprocess.Popen:
    with open(workdir / f"{name}.log", "wb") as log:
        return net.popen(host, [sys.executable, "-m", "p2ptrain", "agent", "--events-file",
                                str(workdir / f"{name}.events"), *args],
                         stdout=log, stderr=subprocess.STDOUT)


def wait_all(procs: dict[str, subprocess.Popen], timeout_s: float, workdir: Path) -> None:
    """Every agent exits 0 within ``timeout_s`` (else the tail of each log in the failure)."""
    deadline = time.monotonic() + timeout_s
    codes = {}
    for name, proc in procs.items():
        try:
            codes[name] = proc.wait(max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            codes[name] = None
    if any(code != 0 for code in codes.values()):
        tails = "\n".join(f"--- {n} ({codes[n]})\n" + (workdir / f"{n}.log").read_text()[-3000:] for n in procs)
        raise AssertionError(f"agents did not all finish: {codes}\n{tails}")


REPO = Path(__file__).resolve().parents[2]
MARK = "<!-- volunteer-path -->"


def home_volunteer_script(bootstrap_line: str) -> str:
    """agent/README.md's marked blocks, in order, with the organiser's bootstrap line in ``BOOTSTRAP``."""
    readme = (REPO / "agent" / "README.md").read_text()
    blocks = re.findall(re.escape(MARK) + r"\s*```bash\n(.*?)```", readme, flags=re.S)
    assert blocks and len(blocks) == readme.count(MARK), "every marked block must be a bash block"
    script, count = re.subn(r'^BOOTSTRAP=".*"$', f'BOOTSTRAP="{bootstrap_line}"', "\n".join(blocks), flags=re.M)
    assert count == 1, "the README must set BOOTSTRAP exactly once"
    assert "--reachability private" in script, "the home path needs no open port"
    return script


def start_home_volunteers(net: Network, homes: list[Host], script: str, workdir: Path) -> dict[str, subprocess.Popen]:
    """Each home runs ``script`` with its own HOME (config, identity and caches inside it)."""
    import os

    bin_dir = str(Path(sys.executable).parent)  # `p2ptrain` as installed next to this interpreter
    procs = {}
    for k, host in enumerate(homes, start=1):
        home = workdir / f"volunteer{k}"
        home.mkdir()
        env = {**os.environ, "HOME": str(home), "PATH": f"{bin_dir}:{os.environ['PATH']}"}
        env.pop("XDG_CACHE_HOME", None)  # the README's default cache dir, inside the volunteer's home
        with open(workdir / f"volunteer{k}.log", "wb") as log:
            procs[f"volunteer{k}"] = net.popen(host, ["bash", "-euo", "pipefail", "-c", script], cwd=REPO, env=env,
                                               stdout=log, stderr=subprocess.STDOUT)
    return procs
