"""``p2ptrain bootstrap`` as a real process: prints a joinable address line, stops cleanly on signals."""

from __future__ import annotations

import dataclasses
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
from click.testing import CliRunner

from p2ptrain.cli import main
from p2ptrain.net.dht.node import DHTConfig, SwarmDHT
from p2ptrain.net.dht.records import ProgressRecord
from p2ptrain.net.identity import generate_identity, load_identity

pytestmark = pytest.mark.integration

LOOPBACK = DHTConfig(host_maddrs=("/ip4/127.0.0.1/tcp/0",), request_timeout_s=5.0, startup_timeout_s=20.0,
                     shutdown_timeout_s=5.0)


def read_line(proc: subprocess.Popen, timeout_s: float) -> str:
    """The first stdout line of ``proc``, or fail after ``timeout_s``."""
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout_s)
    if not lines or not lines[0]:
        proc.kill()
        raise AssertionError(f"no address line within {timeout_s} s (exit code {proc.poll()})")
    return lines[0].rstrip("\n")


def start_bootstrap(tmp_path: Path, *args: str) -> subprocess.Popen:
    stderr = open(tmp_path / "bootstrap.log", "ab")  # noqa: SIM115 - closed with the process below
    try:
        return subprocess.Popen(
            [sys.executable, "-m", "p2ptrain", "bootstrap", "--host-maddrs", "/ip4/127.0.0.1/tcp/0", *args],
            stdout=subprocess.PIPE, stderr=stderr, text=True,
        )
    finally:
        stderr.close()


def stop(proc: subprocess.Popen, sig: signal.Signals) -> int:
    """Send ``sig``; return the exit code, and check every process the bootstrap had started is gone."""
    descendants = psutil.Process(proc.pid).children(recursive=True)
    assert any(p.name() == "p2pd" for p in descendants), "the bootstrap runs no p2pd?"
    proc.send_signal(sig)
    try:
        code = proc.wait(30)
    finally:
        proc.kill()
        proc.wait()
    _, alive = psutil.wait_procs(descendants, timeout=10)
    assert not alive, f"left running: {alive}"
    return code


@pytest.mark.timeout(120)
def test_bootstrap_prints_a_joinable_line_and_stops_cleanly_on_sigterm(tmp_path):
    identity_file, announce_file = tmp_path / "bootstrap.id", tmp_path / "maddrs.txt"
    proc = start_bootstrap(tmp_path, "--identity", str(identity_file), "--announce-file", str(announce_file))
    try:
        line = read_line(proc, timeout_s=60)
        peer_id = load_identity(identity_file).peer_id
        assert line.split() and all(m.endswith(f"/p2p/{peer_id}") for m in line.split())
        assert announce_file.read_text() == line + "\n"
        joined = dataclasses.replace(LOOPBACK, initial_peers=tuple(line.split()))
        with SwarmDHT("run1", joined) as a, SwarmDHT("run1", joined) as b:
            heartbeat = ProgressRecord(epoch=0, step=1, loss=2.0, step_time_s=0.1)
            a.publish_progress(heartbeat)
            deadline = time.monotonic() + 10
            while b.read_progress().get(a.peer_id) != heartbeat:
                assert time.monotonic() < deadline, "b never saw a's record through the bootstrap"
                time.sleep(0.1)
            assert peer_id not in b.read_peers()  # the bootstrap publishes no peer record: never a leader
        assert stop(proc, signal.SIGTERM) == 0
    finally:
        proc.kill()
        proc.wait()
    assert not announce_file.exists()
    log = (tmp_path / "bootstrap.log").read_text()
    assert "received SIGTERM" in log
    assert "Traceback" not in log and " ERROR " not in log, log  # its forwarding loop stopped cleanly too


@pytest.mark.timeout(120)
def test_bootstrap_keeps_its_peer_id_across_restarts_and_stops_on_sigint(tmp_path):
    identity_file = tmp_path / "bootstrap.id"
    peer_ids = []
    for _ in range(2):
        proc = start_bootstrap(tmp_path, "--identity", str(identity_file))
        try:
            peer_ids.append(read_line(proc, timeout_s=60).split("/p2p/")[-1])
            assert stop(proc, signal.SIGINT) == 0
        finally:
            proc.kill()
            proc.wait()
    assert peer_ids[0] == peer_ids[1] == load_identity(identity_file).peer_id


@pytest.mark.parametrize(
    "args, message",
    [
        (["--initial-peers", "/ip4/127.0.0.1/tcp/1"], "lacks /p2p/<peer ID>"),
        (["--host-maddrs", "not-an-address"], "is not a multiaddr"),
        (["--run-id", "bad.run"], "invalid run ID"),
    ],
)
def test_bad_flags_are_one_line_errors_with_exit_code_2(args, message):
    result = CliRunner().invoke(main, ["bootstrap", *args])
    assert result.exit_code == 2
    assert message in result.output and result.output.count("\n") == 1


def test_a_bad_config_file_is_a_one_line_error(tmp_path):
    config = tmp_path / "bootstrap.toml"
    config.write_text('announce_file = "x"\n[dht]\nhost_maddrs = ["/ip4/127.0.0.1/tcp/0"]\nport = 5\n')
    result = CliRunner().invoke(main, ["bootstrap", "--config", str(config)])
    assert result.exit_code == 2 and "unknown config key dht.port" in result.output


@pytest.mark.timeout(60)
def test_an_unreachable_initial_peer_is_a_one_line_error():
    nobody = f"/ip4/127.0.0.1/tcp/9/p2p/{generate_identity().peer_id}"
    result = CliRunner().invoke(
        main, ["bootstrap", "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--initial-peers", nobody]
    )
    assert result.exit_code == 1
    assert "initial peers" in result.output and result.output.count("\n") == 1


def test_the_example_config_is_valid():
    from p2ptrain.config import load_toml
    from p2ptrain.net.dht.bootstrap import BootstrapConfig

    example = Path(__file__).parents[2] / "bootstrap" / "bootstrap.example.toml"
    config = load_toml(BootstrapConfig, example)
    assert config.dht.identity_path and config.announce_file
