"""Helpers for the monitor tests: ``p2ptrain monitor`` as a real process, and its HTTP answers."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from pathlib import Path

from agent_helpers import wait_for

# ``p2ptrain monitor`` that imports the package first (seconds on a loaded machine) and only then waits for a
# bootstrap's address file (written atomically) to join through it
_AWAITING = """
import pathlib, sys, time
from p2ptrain.cli import main
import p2ptrain.cli.monitor, p2ptrain.monitor.server  # all the command imports, before it may be awaited
path, deadline = pathlib.Path(sys.argv[1]), time.monotonic() + 120
path.with_name("test-monitor.imported").touch()  # ready: whoever waits for it may start the swarm now
while not path.exists() and time.monotonic() < deadline:
    time.sleep(0.05)
if not path.exists():
    sys.exit(f"no bootstrap address in {path} within 120 s")
sys.argv = ["p2ptrain", "-v", "monitor", "--initial-peers", path.read_text().strip(), *sys.argv[2:]]
main()
"""


def start_monitor(workdir: Path, maddrs: str | Path, run: str, *args: str, wait: bool = True
                  ) -> tuple[subprocess.Popen, str | None]:
    """``p2ptrain monitor`` on any free port, joined through ``maddrs``; (process, its page's URL). ``maddrs`` a
    path: the bootstrap's address file, which the monitor awaits after its imports, so that a monitor started
    before a swarm reads it from its start however slowly the machine imports (it touches
    ``test-monitor.imported`` beside the address file once it awaits it: start the swarm then); without
    ``wait``, the URL is None (``monitor_url`` waits for it)."""
    announce = workdir / "test-monitor.url"
    flags = ["--run", run, "--port", "0", "--poll", "0.5", "--announce-file", str(announce), *args]
    command = ([sys.executable, "-c", _AWAITING, str(maddrs), *flags] if isinstance(maddrs, Path) else
               [sys.executable, "-m", "p2ptrain", "-v", "monitor", "--initial-peers", maddrs, *flags])
    with open(workdir / "test-monitor.log", "wb") as log:
        proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log)
    if not wait:
        return proc, None
    return proc, monitor_url(workdir, proc)


def monitor_url(workdir: Path, proc: subprocess.Popen) -> str:
    """The URL ``start_monitor``'s monitor announces, once it serves (120 s at most); stops it on failure."""
    announce = workdir / "test-monitor.url"
    try:
        wait_for(lambda: announce.exists() or proc.poll() is not None, 120, "the monitor's URL")
        assert proc.poll() is None, (workdir / "test-monitor.log").read_text()[-3000:]
    except BaseException:
        stop_process(proc)
        raise
    return announce.read_text().strip()


def stop_process(proc: subprocess.Popen, timeout_s: float = 60) -> int | None:
    """SIGTERM (the monitor then stops its DHT and p2pd), SIGKILL past ``timeout_s``."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    return proc.returncode


def get(url: str, timeout_s: float = 15) -> tuple[bytes, dict[str, str]]:
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        return response.read(), dict(response.headers)


def get_state(base_url: str) -> dict:
    body, _ = get(base_url + "api/state")
    return json.loads(body)


def tensorboard_scalars(logdir) -> tuple[dict[str, list[tuple[int, float]]], list[str]]:
    """The scalars (tag -> [(step, value)]) and text tags in a directory's TensorBoard event files."""
    import struct

    from tensorboardX.proto import event_pb2

    scalars: dict[str, list[tuple[int, float]]] = {}
    texts = []
    for path in sorted(logdir.glob("events.out.tfevents.*")):
        data, i = path.read_bytes(), 0
        while i < len(data):  # TFRecord: length, its CRC, the Event, its CRC
            (length,) = struct.unpack("<Q", data[i : i + 8])
            event = event_pb2.Event.FromString(data[i + 12 : i + 12 + length])
            i += 12 + length + 4
            for value in event.summary.value:
                if value.HasField("simple_value"):
                    scalars.setdefault(value.tag, []).append((event.step, round(value.simple_value, 4)))
                else:
                    texts.append(value.tag)
    return scalars, texts
