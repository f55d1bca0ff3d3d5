"""The cost-of-decentralisation figure (p2ptrain bench decentralisation) and e2e's settings option."""

from __future__ import annotations

import numpy as np
import pytest
from click.testing import CliRunner

from p2ptrain.bench.decentralisation import _parse, command, measure, measure_networks, memory_fit
from p2ptrain.bench.e2e import E2EConfig, parse_setting
from p2ptrain.planning.scenarios import homes
from p2ptrain.planning.wire_model import WIRE_BYTES


def test_compression_shrinks_the_world_wide_step_more_than_the_data_center_one():
    report = measure(("fp32/gpipe/no-overlap", "bf16/gpipe/overlap", "int8/1f1b/overlap"), micro_batches=2)
    rows = {r["setting"]: r for r in report["rows"]}
    assert all(r["worldwide_s"] > r["datacenter_s"] > 0 for r in rows.values())
    fp32, bf16, int8 = (rows[s] for s in ("fp32/gpipe/no-overlap", "bf16/gpipe/overlap", "int8/1f1b/overlap"))
    assert fp32["worldwide_s"] > bf16["worldwide_s"] > int8["worldwide_s"]
    assert fp32["ratio"] > bf16["ratio"] > int8["ratio"]
    assert report["baseline"]["setting"] == "fp32/gpipe/no-overlap"
    assert report["best"]["setting"] == "int8/1f1b/overlap"


def test_the_command_prints_a_table_and_refuses_a_bad_setting_in_one_line():
    runner = CliRunner()
    ok = runner.invoke(command, ["--settings", "fp32/gpipe/no-overlap", "--micro-batches", "1"])
    assert ok.exit_code == 0 and "worldwide/datacenter" in ok.output
    bad = runner.invoke(command, ["--settings", "fp32/pipedream/overlap"])
    assert bad.exit_code != 0 and "is not WIRE/SCHEDULE/overlap|no-overlap" in str(bad.exception or bad.output)


@pytest.mark.parametrize("setting", ["fp32", "bf16/gpipe", "int3/gpipe/overlap", "bf16/1f1b/sometimes"])
def test_e2e_settings_are_checked(setting):
    with pytest.raises(ValueError, match="WIRE/SCHEDULE"):
        parse_setting(setting)
    with pytest.raises(ValueError, match="WIRE/SCHEDULE"):
        E2EConfig(scenario="worldwide", settings=("fp32/gpipe/overlap", setting))
    assert parse_setting("int4/1f1b/no-overlap") == ("int4", "1f1b", False)


def test_homes_are_symmetric_pairs_of_home_latency_and_the_bandwidth_asked_for():
    cluster = homes(16, 0.1, seed=3)
    off = ~np.eye(16, dtype=bool)
    assert np.array_equal(cluster.latency_ms, cluster.latency_ms.T)
    assert (cluster.latency_ms[off] >= 20).all() and (cluster.latency_ms[off] <= 150).all()
    assert (cluster.bandwidth_gbps[off] == 0.1).all()
    assert np.array_equal(homes(16, 0.1, seed=3).latency_ms, cluster.latency_ms)  # seeded


def test_diloco_and_fewer_stages_bring_homes_closer_to_the_data_center():
    report = measure_networks(("datacenter", "homes-100m"), (8, 2), ("int4/1f1b/overlap",), (1, 50))
    step = {(r["network"], r["stages"], r["sync_every"]): r["step_s"] for r in report["rows"]}
    assert step[("homes-100m", 2, 50)] < step[("homes-100m", 2, 1)] < step[("homes-100m", 8, 1)]
    assert step[("datacenter", 2, 50)] == pytest.approx(step[("datacenter", 2, 1)], rel=0.01)  # fast links: no gain
    best = report["best"]
    assert best["datacenter"]["vs_datacenter_best"] == 1.0
    assert best["homes-100m"]["stages"] == 2 and best["homes-100m"]["sync_every"] == 50
    assert best["homes-100m"]["vs_datacenter_best"] > 1.0


def test_every_wire_format_the_planner_knows_is_a_setting():
    for wire in WIRE_BYTES:
        assert _parse(f"{wire}/1f1b/overlap") == (wire, "1f1b", True)
    with pytest.raises(ValueError, match="is not WIRE/SCHEDULE"):
        _parse("int3/gpipe/overlap")


def test_stage_counts_that_do_not_fit_a_v100_are_skipped():
    # GPT-3 XL, 8 micro-batches: one stage holds 1.3 B parameters' state (21 GB; DiLoCo's two more copies are in
    # host memory) beside its activations; 1F1B at 4 stages fits 16 GB only by recomputing
    assert memory_fit(1, "gpipe", 50, 8, 16.0).recompute is None
    assert memory_fit(1, "gpipe", 50, 8, 32.0).recompute is True
    assert memory_fit(1, "gpipe", 50, 8, 32.0).need_gb == memory_fit(1, "gpipe", 1, 8, 32.0).need_gb
    assert memory_fit(4, "1f1b", 1, 8, 16.0).recompute is True
    assert memory_fit(4, "1f1b", 1, 8, 1000.0).recompute is False
    report = measure_networks(("datacenter",), (1, 2), ("int4/gpipe/no-overlap",), (50,), memory_gb=24.0)
    assert [r["stages"] for r in report["rows"]] == [2] and report["rows"][0]["recompute"]
    assert report["skipped"] == [{"stages": 1, "schedule": "gpipe", "sync_every": 50,
                                  "need_gb": pytest.approx(memory_fit(1, "gpipe", 50, 8, 24.0).need_gb)}]
    assert 0 < report["rows"][0]["compute_utilisation"] <= 1


def test_access_links_and_streaming_on_homes():
    args = (("homes-100m",), (2,), ("int4/gpipe/no-overlap",), (1, 50))
    shared, separate, streamed = (measure_networks(*args, access=a, sync_overlap=o)
                                  for a, o in ((True, False), (False, False), (True, True)))
    step = {name: {r["sync_every"]: r["step_s"] for r in report["rows"]}
            for name, report in (("shared", shared), ("separate", separate), ("streamed", streamed))}
    assert step["shared"][1] > 2 * step["separate"][1]  # 31 shards each way through one 100 Mbit/s line
    assert step["streamed"][1] == step["shared"][1]  # H = 1 is never streamed
    assert step["streamed"][50] < step["shared"][50] < step["shared"][1]
    assert [r["streamed"] for r in streamed["rows"]] == [False, True]
    flags = ["--networks", "homes-100m", "--stages", "2", "--settings", "int4/gpipe/no-overlap", "--sync-every", "50",
             "--sync-overlap"]
    r = CliRunner().invoke(command, flags)
    assert r.exit_code == 0 and "streamed H 50" in r.output and "skipped" not in r.output, r.output
    small = CliRunner().invoke(command, [*flags, "--memory-gb", "16"])  # state and recomputed activations: 18 GB
    assert small.exit_code == 0 and "skipped: 2 stages, gpipe, H 50: a stage needs 18.4 GB" in small.output
