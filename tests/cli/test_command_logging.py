"""A command that quiets the library for its own run leaves logging as it found it: one run in-process (a test,
another program) must not hide the next one's log lines (``lifecycle.logger_levels``)."""

from __future__ import annotations

import logging

from click.testing import CliRunner

from p2ptrain.cli import main
from p2ptrain.lifecycle import logger_levels


def test_logger_levels_hold_inside_and_come_back_after():
    log, other = logging.getLogger("p2ptrain"), logging.getLogger("p2ptrain.bench.e2e")
    log.setLevel(logging.DEBUG)
    other.setLevel(logging.NOTSET)
    try:
        with logger_levels({"p2ptrain": logging.WARNING, "p2ptrain.bench.e2e": logging.INFO}):
            assert (log.level, other.level) == (logging.WARNING, logging.INFO)
        assert (log.level, other.level) == (logging.DEBUG, logging.NOTSET)
    finally:
        log.setLevel(logging.NOTSET)


def test_the_swarm_command_quiets_the_library_for_its_run_only(monkeypatch):
    seen = []

    def run_swarm(config, stop, on_update, on_monitor):
        seen.append(logging.getLogger("p2ptrain").level)
        raise RuntimeError("no swarm here")  # ends the command midway, as a failure would

    monkeypatch.setattr("p2ptrain.swarm.agent_launcher.run_swarm", run_swarm)
    log = logging.getLogger("p2ptrain")
    log.setLevel(logging.DEBUG)
    try:
        result = CliRunner().invoke(main, ["swarm", "--agents", "2", "--stages", "1"])
        assert isinstance(result.exception, RuntimeError) and seen == [logging.WARNING]
        assert log.level == logging.DEBUG
    finally:
        log.setLevel(logging.NOTSET)
