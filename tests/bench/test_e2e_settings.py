"""The e2e benchmark's settings: WIRE/SCHEDULE/overlap with an optional DiLoCo round length, and how a
DiLoCo run's step is measured (whole rounds, the round's all-reduce spread over its steps)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from p2ptrain.bench.e2e import E2EConfig, _swarm_config, parse_setting, round_period, subspace, sync_every


def test_a_setting_may_ask_for_diloco_rounds():
    assert parse_setting("int4/1f1b/overlap/diloco-4") == ("int4", "1f1b", True)
    assert sync_every("int4/1f1b/overlap/diloco-4") == 4 and sync_every("fp32/gpipe/no-overlap") == 1
    for bad in ("int4/1f1b/overlap/diloco-0", "int4/1f1b/overlap/diloco", "int4/1f1b/overlap/h4", "fp8/1f1b/overlap"):
        with pytest.raises(ValueError, match="is not WIRE/SCHEDULE"):
            sync_every(bad)


def test_a_setting_may_train_a_subspace_model():
    setting = "int8/gpipe/overlap/k8/diloco-4/no-verify"
    assert parse_setting(setting) == ("int8", "gpipe", True) and subspace(setting) == 8 and sync_every(setting) == 4
    assert subspace("int8/gpipe/overlap") == 0
    config = E2EConfig(scenario="homes", steps=8, settings=("int4/gpipe/overlap", "int8/gpipe/overlap/k8"))
    swarms = [_swarm_config(config, "scheduled", 1.0, 1.0, setting=s) for s in config.settings]
    assert [s.subspace for s in swarms] == [0, 8]
    for bad in ("int8/gpipe/overlap/k0", "int8/gpipe/overlap/kx", "int8/gpipe/overlap/diloco-4/k8"):
        with pytest.raises(ValueError, match="is not WIRE/SCHEDULE"):
            subspace(bad)


def test_a_diloco_setting_needs_two_whole_rounds():
    E2EConfig(scenario="homes", steps=8, settings=("int4/1f1b/overlap", "int4/1f1b/overlap/diloco-4"))
    with pytest.raises(ValueError, match="--steps must be at least 10"):
        E2EConfig(scenario="homes", steps=8, settings=("int4/1f1b/overlap/diloco-5",))


def test_a_diloco_step_is_the_mean_over_whole_rounds_after_the_first():
    # rounds of 3: steps take 1 s, a round's last 4 s (its all-reduce); step k ended at completions[k - 1]
    durations = [1, 1, 4, 1, 1, 4, 1, 1, 4, 1]
    completions = [sum(durations[: k + 1]) for k in range(len(durations))]
    assert round_period(completions, 3) == pytest.approx(2.0)  # (1 + 1 + 4) / 3, rounds 2 and 3
    with pytest.raises(ValueError, match="fewer than two rounds"):
        round_period(completions[:5], 3)


def test_the_emulated_prober_fits_its_first_transfer_to_the_slowest_line():
    from p2ptrain.net.transport.emulation import EmulationConfig, scaled_bandwidth
    from p2ptrain.swarm.agent_launcher import EMULATED_PROBE, _probe, plan_swarm
    from p2ptrain.swarm.config import SwarmConfig

    homes = SwarmConfig(agents=8, stages=4, steps=12, scenario="homes", time_scale=0.33)
    _, network, time_scale, size_factor = plan_swarm(homes)
    line = scaled_bandwidth(float(network.uplink_gbps.min()), EmulationConfig(time_scale, size_factor))
    first = _probe(homes, network, time_scale, size_factor).first_transfer_bytes
    assert 4 << 10 <= first <= max(4 << 10, line * EMULATED_PROBE.min_transfer_s) < EMULATED_PROBE.first_transfer_bytes
    world = SwarmConfig(agents=8, stages=4, steps=12, scenario="worldwide")
    _, network, time_scale, size_factor = plan_swarm(world)
    off = ~np.eye(network.num_devices, dtype=bool)
    line = scaled_bandwidth(float(network.bandwidth_gbps[off].min()), EmulationConfig(time_scale, size_factor))
    probe = _probe(world, network, time_scale, size_factor)
    assert probe.first_transfer_bytes == int(min(EMULATED_PROBE.first_transfer_bytes, line * EMULATED_PROBE.min_transfer_s))
    assert dataclasses.replace(probe, first_transfer_bytes=EMULATED_PROBE.first_transfer_bytes) == EMULATED_PROBE


def test_the_swarms_messages_wait_for_the_followers_checks_of_the_plan():
    """The leader trains as soon as it publishes its plan; its followers' checks of it took over 60 s on the
    shared 2-core machine, so the e2e swarms give every message ``CALL_TIMEOUT_S``."""
    from p2ptrain.bench.e2e import CALL_TIMEOUT_S, PLAN_BUDGET_S, _swarm_config

    config = E2EConfig(scenario="homes", steps=10, settings=("int4/1f1b/overlap", "int4/1f1b/overlap/diloco-5"))
    for setting in config.settings:
        swarm = _swarm_config(config, "scheduled", 0.33, 4.0, setting=setting)
        assert swarm.call_timeout_s == CALL_TIMEOUT_S > 60 and swarm.plan_budget_s == PLAN_BUDGET_S > 60
