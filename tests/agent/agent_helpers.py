"""Helpers for the agent tests: the swarm as a real command, its status file, process trees."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import psutil


def swarm_command(workdir: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "p2ptrain", "swarm", "--workdir", str(workdir), *args]


def run_swarm(workdir: Path, *args: str, timeout_s: float = 240) -> tuple[int, dict | None, str]:
    """Run ``p2ptrain swarm --json`` to the end: (exit code, the JSON summary or None, stderr)."""
    proc = subprocess.Popen(swarm_command(workdir, "--json", *args), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)  # fmt: skip
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.terminate()  # SIGTERM: the swarm stops every process it started (SIGKILL would orphan them)
        try:
            proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
        raise
    summary = json.loads(stdout) if stdout.strip() else None
    return proc.returncode, summary, stderr


def wait_for(predicate, timeout_s: float, what: str, poll_s: float = 0.2):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll_s)
    raise AssertionError(f"{what} did not happen within {timeout_s} s")


def read_status(workdir: Path) -> dict | None:
    try:
        return json.loads((workdir / "swarm.json").read_text())
    except (FileNotFoundError, ValueError):
        return None


def events(path: str | Path) -> list[dict]:
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in text.splitlines() if line.endswith("}")]


def process_tree(pid: int) -> list[psutil.Process]:
    """``pid`` and every process it started (its DHT process, p2pd, ...)."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def assert_all_gone(processes: list[psutil.Process], timeout_s: float = 30) -> None:
    _, alive = psutil.wait_procs(processes, timeout=timeout_s)
    alive = [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"left running: {[(p.pid, p.name()) for p in alive]}"


def is_alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def bootstrap_maddrs(workdir: Path, timeout_s: float = 90) -> list[str]:
    """The swarm's bootstrap address line (``<workdir>/bootstrap.maddrs``), once written."""

    def read() -> str | None:
        try:
            return (workdir / "bootstrap.maddrs").read_text().strip() or None
        except FileNotFoundError:
            return None

    return wait_for(read, timeout_s, "the bootstrap's address line").split()
