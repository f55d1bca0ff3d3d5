"""Agent tests: a private device-profile cache for every test."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def private_profile_cache(tmp_path_factory, monkeypatch):
    """Device profiles go to a cache shared by the session's tests, not the user's cache dir."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.getbasetemp() / "cache"))
