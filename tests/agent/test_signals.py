"""SIGTERM to the bootstrap, to an agent or to the swarm: each stops cleanly and leaves no process behind
(checked on the process trees captured while they ran: agent, its DHT process, its p2pd)."""

from __future__ import annotations

import os
import signal
import subprocess

import pytest
from agent_helpers import assert_all_gone, events, process_tree, read_status, swarm_command, wait_for

from p2ptrain.runtime.forkserver import SHARED_ENV

pytestmark = pytest.mark.integration


def start_swarm(workdir, *args: str) -> subprocess.Popen:
    """The swarm as a user starts it: its processes forked from a server of its own, so in its process tree."""
    log = open(workdir / "swarm.stderr", "w")  # noqa: SIM115 - the child holds its own copy
    env = {k: v for k, v in os.environ.items() if k != SHARED_ENV}
    try:
        return subprocess.Popen(swarm_command(workdir, *args), stdout=subprocess.DEVNULL, stderr=log, env=env)
    finally:
        log.close()


def agent_steps(status: dict) -> int:
    return max((e["step"] for a in status["agents"] for e in events(a["events"]) if e["event"] == "step"), default=0)


@pytest.mark.timeout(240)
def test_sigterm_to_the_bootstrap_then_to_an_agent_leaves_nothing_behind(tmp_path):
    swarm = start_swarm(tmp_path, "--agents", "4", "--stages", "2", "--steps", "100000", "--scenario", "none")
    try:
        status = wait_for(lambda: read_status(tmp_path), 120, "the swarm's status file")
        wait_for(lambda: agent_steps(status) >= 2, 150, "training")
        bootstrap = process_tree(status["bootstrap"]["pid"])
        agent = status["agents"][3]
        agent_tree = process_tree(agent["pid"])
        assert {p.name() for p in agent_tree} >= {"p2pd"}, "the agent runs no p2pd?"
        swarm_tree = process_tree(swarm.pid)

        os.kill(status["bootstrap"]["pid"], signal.SIGTERM)  # the bootstrap goes; training does not need it
        assert_all_gone(bootstrap)
        steps = agent_steps(status)
        wait_for(lambda: agent_steps(status) > steps + 1, 60, "training after the bootstrap left")

        os.kill(agent["pid"], signal.SIGTERM)  # an agent goes: it shuts down cleanly, the swarm stops the rest
        assert_all_gone(agent_tree)
        assert "stopping (received SIGTERM)" in open(agent["log"]).read()
        assert swarm.wait(90) == 1
        assert_all_gone(swarm_tree)
    finally:
        swarm.kill()
        swarm.wait()


@pytest.mark.timeout(180)
def test_sigterm_to_the_swarm_while_agents_start_leaves_nothing_behind(tmp_path):
    swarm = start_swarm(tmp_path, "--agents", "4", "--stages", "2", "--steps", "100000")
    try:
        status = wait_for(lambda: read_status(tmp_path), 120, "the swarm's status file")
        wait_for(lambda: all(any(e["event"] == "started" for e in events(a["events"])) for a in status["agents"]),
                 120, "every agent joining")
        tree = process_tree(swarm.pid)
        assert sum(p.name() == "p2pd" for p in tree) == 5  # the bootstrap's and one per agent
        swarm.send_signal(signal.SIGTERM)
        assert swarm.wait(90) == 1
        assert_all_gone(tree)
    finally:
        swarm.kill()
        swarm.wait()
