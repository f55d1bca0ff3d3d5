"""The agent's configuration tree, the swarm's generated configs, the device profile cache, the CLI's input
errors: unit tests (no network)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import tomllib
import torch
from click.testing import CliRunner

from p2ptrain.agent.config import AgentConfig
from p2ptrain.agent.events import EventReader
from p2ptrain.agent.leadership.plan_maker import run_workload
from p2ptrain.agent.profile import CACHE_FILE, profile_device
from p2ptrain.cli import main
from p2ptrain.config import config_from_dict, read_toml
from p2ptrain.planning import PAPER_WORKLOAD
from p2ptrain.runtime.config import TrainConfig
from p2ptrain.swarm.agent_launcher import (
    AgentProcess,
    SwarmConfig,
    _agent_toml,
    matched_batch_size,
    plan_swarm,
    to_toml,
)

REPO = Path(__file__).resolve().parents[2]
BOOTSTRAP = "/ip4/127.0.0.1/tcp/31337/p2p/QmXeJB72XYYV2FhvJSzajoDCZH2viUzKbdPztJwNH16TXW"


def test_the_example_config_is_valid_and_flags_override_it():
    data = read_toml(REPO / "agent" / "agent.example.toml")
    config = config_from_dict(AgentConfig, {**data, "initial_peers": [BOOTSTRAP]})
    assert config.run == "demo" and config.train.stages == 2 and config.membership.expect == 2
    assert config.dht.identity_path == str(Path.home() / ".local/share/p2ptrain/agent.id")  # ~ expanded
    assert config.dht.initial_peers == (BOOTSTRAP,)


@pytest.mark.parametrize(
    "data, message",
    [
        ({"initial_peers": [BOOTSTRAP], "trian": {}}, "unknown config key trian"),
        ({"initial_peers": [BOOTSTRAP], "train": {"stepz": 3}}, "unknown config key train.stepz"),
        ({}, "initial_peers is empty"),
        ({"initial_peers": ["/ip4/1.2.3.4/tcp/1"]}, "lacks /p2p/"),
        ({"initial_peers": [BOOTSTRAP], "membership": {"min_peers": 2}}, "set expect"),
        ({"initial_peers": [BOOTSTRAP], "plan": {"strategy": "best"}}, "'best' is not one of"),
        ({"initial_peers": [BOOTSTRAP], "run": "a.b"}, "invalid run ID"),
        ({"initial_peers": [BOOTSTRAP], "train": {"stages": 4}, "membership": {"expect": 2}}, "fewer peers"),
        ({"initial_peers": [BOOTSTRAP], "emulation": {"device_index": 1}}, "go together"),
        ({"initial_peers": [BOOTSTRAP], "emulation": {"compute_scale": 0.5}}, "compute_scale=0.5 must be"),
        ({"initial_peers": [BOOTSTRAP], "emulation": {"compute_scale": 2}}, "compute_scale slows emulated devices"),
    ],
)
def test_bad_agent_configs_are_one_line_errors(data, message):
    with pytest.raises(ValueError, match=message) as info:
        config_from_dict(AgentConfig, data)
    assert "\n" not in str(info.value)


def test_agent_cli_refuses_bad_input_with_one_line_and_exit_2(tmp_path):
    bad = tmp_path / "agent.toml"
    bad.write_text('run = "demo"\n[train]\nmodell = "tiny"\n')
    result = CliRunner().invoke(main, ["agent", "--config", str(bad), "--initial-peers", BOOTSTRAP])
    assert result.exit_code == 2 and "unknown config key train.modell" in result.output
    result = CliRunner().invoke(main, ["agent", "--run", "demo"])
    assert result.exit_code == 2 and "initial_peers is empty" in result.output


def test_swarm_writes_agent_configs_that_parse_back(tmp_path):
    config = SwarmConfig(agents=4, stages=2, steps=3, compute_scale=2.0)
    train, network, time_scale, size_factor = plan_swarm(config)
    agent = AgentProcess(2, "peer", "agent-2", tmp_path / "agent-2.toml", tmp_path / "agent-2.log",
                         EventReader(tmp_path / "agent-2.events.jsonl"))
    text = _agent_toml(config, train, "run1", [BOOTSTRAP], agent, tmp_path, tmp_path / "cluster.json",
                       time_scale, size_factor)
    parsed = config_from_dict(AgentConfig, tomllib.loads(text))
    assert parsed.emulation.device_index == 2 and parsed.emulation.time_scale == time_scale
    assert parsed.emulation.compute_scale == 2.0
    assert parsed.train == config_from_dict(TrainConfig, {**train.to_dict(), "replicas": 1})
    assert parsed.membership.expect == 4 and parsed.dht.identity_path == str(tmp_path / "agent-2.id")
    assert tomllib.loads(to_toml({"a": [1, "x"], "t": {"b": True, "u": {"c": 1.5}}})) == {
        "a": [1, "x"], "t": {"b": True, "u": {"c": 1.5}}}


def test_a_scenario_swarm_matches_the_papers_volume_ratio_and_size():
    config = SwarmConfig(agents=8, stages=2, steps=1)
    train, network, time_scale, size_factor = plan_swarm(config)
    assert network.num_devices == 8 and time_scale == 0.05
    workload = run_workload(train, 2, 4, size_factor)
    assert workload.activation_gb == pytest.approx(PAPER_WORKLOAD.activation_gb)  # the size factor's definition
    ratio = workload.activation_gb / workload.gradient_gb
    assert ratio == pytest.approx(PAPER_WORKLOAD.activation_gb / PAPER_WORKLOAD.gradient_gb, rel=0.1)
    assert train.global_batch_size == matched_batch_size(train, 2, 4) and train.global_batch_size % 8 == 0
    plain, none, scale, factor = plan_swarm(SwarmConfig(agents=4, stages=2, steps=1, scenario=None))
    assert none is None and (scale, factor) == (1.0, 1.0) and plain.global_batch_size == 16
    # in slow motion the network is slowed as the devices are, unless its time scale is given
    assert plan_swarm(SwarmConfig(agents=8, stages=2, steps=1, compute_scale=2.0))[2] == 0.1
    assert plan_swarm(SwarmConfig(agents=8, stages=2, steps=1, compute_scale=2.0, time_scale=0.3))[2] == 0.3
    with pytest.raises(ValueError, match="--compute-scale must be a number of at least 1"):
        SwarmConfig(compute_scale=0.5)
    with pytest.raises(ValueError, match="--compute-scale slows emulated devices: it needs --scenario or --cluster"):
        SwarmConfig(scenario=None, compute_scale=2.0)


def test_device_profile_is_measured_once_then_cached_per_device_and_version(tmp_path):
    first = profile_device(torch.device("cpu"), cache_dir=tmp_path, measure_s=0.05)
    assert not first.cached and first.tflops > 0 and first.memory_gb > 0
    second = profile_device(torch.device("cpu"), cache_dir=tmp_path, measure_s=0.05)
    assert second.cached and second.tflops == first.tflops
    cache = json.loads((tmp_path / CACHE_FILE).read_text())
    (key,) = cache
    assert "torch=" in key and "p2ptrain=" in key and "threads=" in key
    (tmp_path / CACHE_FILE).write_text("{not json")  # a broken cache is measured again and rewritten
    assert not profile_device(torch.device("cpu"), cache_dir=tmp_path, measure_s=0.05).cached
    assert json.loads((tmp_path / CACHE_FILE).read_text()).keys() == {key}


def test_a_diloco_agent_accepts_messages_a_round_ahead():
    # pipelines of a round drift apart by up to H - 1 steps before its end joins them (``churn.restart``)
    config = config_from_dict(AgentConfig, {"initial_peers": [BOOTSTRAP], "train": {"sync": "diloco", "diloco": {
        "inner_steps": 7}}})
    assert config.transport.step_window == 7 and config.train.rounds.length == 7
    every_step = config_from_dict(AgentConfig, {"initial_peers": [BOOTSTRAP]})
    assert every_step.transport.step_window == 2 and every_step.train.rounds.length == 1
