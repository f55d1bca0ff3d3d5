"""Tests on a real network stack: namespaces, NAT routers and shaped uplinks the test builds (``netns.py``).

Skipped, with the reason, where namespaces cannot be built (not root, no iptables/tc, a sandbox without
CAP_NET_ADMIN). Every namespace is deleted after its test, also when the test fails.
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1] / "agent"))  # agent_helpers

from netns import Network, unavailable_reason  # noqa: E402

_reason: list[str | None] = []


@pytest.fixture
def network():
    if not _reason:
        _reason.append(unavailable_reason())
    if _reason[0] is not None:
        pytest.skip(_reason[0])
    def interrupt(signum, frame):  # a SIGTERM to pytest must still tear the network down
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, interrupt)
    net = Network()
    try:
        yield net
    finally:
        net.close()
        signal.signal(signal.SIGTERM, previous)


@pytest.fixture(autouse=True)
def private_profile_cache(tmp_path_factory, monkeypatch):
    """Device profiles go to a cache shared by the session's tests, not the user's cache dir."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.getbasetemp() / "cache"))
