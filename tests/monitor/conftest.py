"""Monitor tests: the agent tests' swarm helpers on the path, and a private device-profile cache."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1] / "agent"))  # agent_helpers


@pytest.fixture(autouse=True)
def private_profile_cache(tmp_path_factory, monkeypatch):
    """Agents' device profiles go to a cache shared by the session's tests, not the user's cache dir."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.getbasetemp() / "cache"))
