"""The run's stage count with ``stages = "auto"`` (``agent.leadership.run_stages``), without I/O: the leader's
choice over the candidate counts, the followers' checks of a plan's S (bounds, memory, the pin), and the
configuration that says it."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import tomllib
import torch
from click.testing import CliRunner

from p2ptrain.agent.config import AgentConfig, EmulationSettings, PlanConfig
from p2ptrain.agent.events import EventReader
from p2ptrain.agent.leadership import settings
from p2ptrain.agent.leadership.plan_check import LeaderWatch, PlanGate, cost_check
from p2ptrain.agent.leadership.plan_maker import run_workload
from p2ptrain.agent.leadership.run_stages import (
    RunStages,
    at_stages,
    choose_run_stages,
    memory_problem,
    stage_candidates,
    stage_memory_gb,
    stages_on_disk,
)
from p2ptrain.cli import main
from p2ptrain.config import config_from_dict
from p2ptrain.errors import ConfigError
from p2ptrain.net.dht.records import LinkMeasurement, LinksRecord, PeerRecord, PlanRecord
from p2ptrain.net.identity import generate_identity
from p2ptrain.planning.split import even_layers
from p2ptrain.runtime.checkpoint import save_stage
from p2ptrain.runtime.config import TrainConfig
from p2ptrain.swarm.agent_launcher import AgentProcess, SwarmConfig, _agent_toml, plan_swarm

AUTO = TrainConfig(model="tiny", steps=2, global_batch_size=8, micro_batches=2, stages="auto")
FIXED = dataclasses.replace(AUTO, stages=2)
PEERS = sorted(generate_identity().peer_id for _ in range(4))
BOOTSTRAP = "/ip4/127.0.0.1/tcp/1/p2p/QmaCpDMGvV2BGHeYERUEnRQAwe3N8SzbUtfsmvsqQLuvuJ"


def world(memory_gb: float = 16.0, regions: bool = False):
    """Four peers' records and links rows: alike and fast (loopback-like), or two regions of two, fast inside
    and slow between."""
    records = {p: PeerRecord(device_name=f"dev{k}", memory_gb=memory_gb, tflops=1.0) for k, p in enumerate(PEERS)}

    def link(i: int, j: int) -> LinkMeasurement:
        if regions and i // 2 != j // 2:
            return LinkMeasurement(100.0, 0.01)
        return LinkMeasurement(1.0 if regions else 0.5, 1.0 if regions else 10.0)

    rows = {a: LinksRecord.from_peers({b: link(i, j) for j, b in enumerate(PEERS) if j != i})
            for i, a in enumerate(PEERS)}
    return records, rows


def plan_of(stages: int, members: tuple[str, ...] = tuple(PEERS)) -> PlanRecord:
    """A plan of ``stages`` stages in Megatron's order over ``members``, the rest of them spares."""
    replicas = len(members) // stages
    pipelines = np.arange(stages * replicas).reshape(replicas, stages).tolist()
    return PlanRecord.from_plan_json(0, list(members), {"stages": stages, "replicas": replicas,
                                                        "pipelines": pipelines, "cost_s": 1.0})


def test_the_candidates_are_the_stage_counts_the_members_can_train_within_the_bounds():
    assert stage_candidates(4, AUTO) == (1, 2, 3, 4)  # 3 stages: one replica, a spare
    assert stage_candidates(4, dataclasses.replace(AUTO, min_stages=2, max_stages=3)) == (2, 3)
    assert stage_candidates(1, dataclasses.replace(AUTO, min_stages=2)) == ()
    # 12 sequences in 2 micro-batches over 5 peers: one stage 3 replicas (not 5, nor 4), 2 stages 2, more 1
    assert stage_candidates(5, dataclasses.replace(AUTO, global_batch_size=12)) == (1, 2, 3, 4, 5)
    assert stage_candidates(3, FIXED) == (2,)


def test_the_leader_chooses_two_stages_where_two_regions_make_them_fastest():
    records, rows = world(regions=True)
    choice = choose_run_stages(PEERS, records, rows, AUTO, PlanConfig(time_budget_s=5.0))
    assert [o.num_stages for o in choice.options] == [1, 2, 3, 4] and all(o.plan is not None for o in choice.options)
    steps = {o.num_stages: o.step_s for o in choice.options}
    assert choice.best.num_stages == 2, steps
    assert steps[1] > 2 * steps[2]  # one stage all-reduces the whole model between the regions
    # the same world but bounded: the leader keeps to the run's bounds
    bounded = choose_run_stages(PEERS, records, rows, dataclasses.replace(AUTO, min_stages=3),
                                PlanConfig(time_budget_s=5.0))
    assert [o.num_stages for o in bounded.options] == [3, 4] and bounded.best.num_stages in (3, 4)


def test_where_only_more_stages_fit_the_devices_memory_the_leader_takes_more():
    fast, rows = world()
    assert choose_run_stages(PEERS, fast, rows, AUTO, PlanConfig(time_budget_s=5.0)).best.num_stages == 1
    need = {s: max(stage_memory_gb(AUTO, s, d, even_layers(8, s))) for s, d in ((1, 4), (2, 2), (3, 1), (4, 1))}
    assert need[4] < min(need[1], need[2], need[3])
    small, _ = world(memory_gb=(need[4] + min(need[1], need[2], need[3])) / 2)
    choice = choose_run_stages(PEERS, small, rows, AUTO, PlanConfig(time_budget_s=5.0))
    assert choice.best.num_stages == 4
    assert all(o.plan is None and o.skipped for o in choice.options if o.num_stages < 4)
    with pytest.raises(ValueError, match="cannot train 2 .. 8 stages"):
        choose_run_stages(PEERS[:1], small, rows, dataclasses.replace(AUTO, min_stages=2), PlanConfig())


def test_an_auto_run_accepts_a_stage_count_within_its_bounds_until_its_stage_count_is_pinned():
    stages = RunStages(dataclasses.replace(AUTO, min_stages=2, max_stages=4))
    assert stages.auto and stages.pinned is None and stages.next_plan(None) is None
    assert stages.problem(2) is None and stages.problem(4) is None
    assert stages.problem(1) == 'it has 1 stages, outside the run\'s 2 .. 4 (stages = "auto")'
    assert stages.problem(5) is not None
    assert stages.next_plan(plan_of(2)) == 2 and stages.next_plan(plan_of(1)) is None  # a joiner leading: the run's S
    stages.pin(2, "epoch 0, the first plan this agent trained")
    stages.pin(4, "a later plan")  # once only
    assert stages.pinned == 2 and stages.next_plan(plan_of(4)) == 2
    assert stages.problem(2) is None
    assert stages.problem(4) == ("it has 4 stages where the run's are pinned at 2 by epoch 0, the first plan this "
                                 "agent trained (a plan may not change the stage count: stage states are kept per "
                                 "stage)")
    fixed = RunStages(FIXED)  # a number: today's check
    assert not fixed.auto and fixed.pinned == 2 and fixed.problem(2) is None
    assert fixed.problem(4) == "it has 4 stages; the run trains 2"


def test_a_follower_refuses_an_auto_plan_out_of_bounds_or_too_big_for_its_memory_or_changing_its_pinned_count(caplog):
    records, rows = world()
    me, refusals = PEERS[3], []

    def workload_for(cluster, trainers, peers, train):  # the run's S reaches the workload as train.stages
        return run_workload(train, train.stages, len(trainers) // train.stages)

    def gate(train: TrainConfig, verify: bool = True) -> PlanGate:
        return PlanGate(me, train, PlanConfig(verify=verify, verify_tolerance=10.0), EmulationSettings(),
                        LeaderWatch(10.0, 60.0), 0.0, lambda: rows, workload_for,
                        lambda plan, reason: refusals.append(reason))

    known = lambda p: 60.0  # noqa: E731
    bounded = gate(dataclasses.replace(AUTO, max_stages=2))
    assert bounded.accept(plan_of(2), records, known, first=True)  # within the bounds; its cost checked at S = 2
    assert bounded.check_s(plan_of(2)) > 0
    assert not bounded.accept(plan_of(4), records, known, first=True)
    assert refusals[-1] == 'it has 4 stages, outside the run\'s 1 .. 2 (stages = "auto")'
    assert not gate(FIXED).accept(plan_of(4), records, known, first=True)  # a number: as today (the cost check)
    assert refusals[-1] == "it has 4 stages; the run trains 2"

    need = stage_memory_gb(AUTO, 2, 2, even_layers(8, 2))[1]  # our stage: 1 of pipeline 1
    small = {**records, me: dataclasses.replace(records[me], memory_gb=need * 0.99)}
    assert not gate(AUTO, verify=False).accept(plan_of(2), small, known, first=True)  # checked even unverified
    assert refusals[-1].startswith("its stage 1 of 2 needs ") and "GB of memory; this agent's device has" in refusals[-1]
    assert memory_problem(plan_of(2), me, need * 1.01, AUTO) is None
    assert memory_problem(plan_of(3), me, need * 0.01, AUTO) is None  # a spare holds no stage

    pinned = RunStages(AUTO)
    follower = PlanGate(me, AUTO, PlanConfig(verify=False), EmulationSettings(), LeaderWatch(10.0, 60.0), 0.0,
                        lambda: rows, workload_for, lambda plan, reason: refusals.append(reason), stages=pinned)
    assert follower.accept(plan_of(4), records, known, first=True)
    pinned.pin(4, "epoch 0, the first plan this agent trained")
    assert follower.accept(dataclasses.replace(plan_of(4), epoch=1), records, known, first=False)
    assert not follower.accept(dataclasses.replace(plan_of(2), epoch=1), records, known, first=False)
    assert "pinned at 4" in refusals[-1] and follower.refused(dataclasses.replace(plan_of(2), epoch=1))


def test_cost_check_scores_an_auto_plan_at_its_own_stage_count():
    records, rows = world(regions=True)

    def workload_for(cluster, trainers, peers, train):
        return run_workload(train, train.stages, len(trainers) // train.stages)

    for s in (2, 4):
        check = cost_check(plan_of(s), records, rows, at_stages(AUTO, s), PlanConfig(), EmulationSettings(),
                           workload_for, 0.1)
        assert check.theirs_s > 0 and check.ours_s > 0
    # equal, not the same object: ``at_stages`` is cached (an equal config another test asked for comes back)
    assert at_stages(AUTO, 2).stages == 2 and at_stages(AUTO, 2) != AUTO and at_stages(FIXED, 2) == FIXED


def test_the_stage_count_of_copies_on_disk_pins_a_resumed_run(tmp_path):
    assert stages_on_disk(tmp_path, AUTO, complete=False) is None
    shape = AUTO.shape
    for stage in range(2):
        save_stage(tmp_path, 4, stage, 2, "tiny", 0, {"param/x": torch.zeros(1)}, shape)
    save_stage(tmp_path, 6, 0, 3, "tiny", 0, {"param/x": torch.zeros(1)}, shape)  # newest, incomplete
    assert stages_on_disk(tmp_path, AUTO, complete=False) == 3  # an agent's own copies: its newest
    assert stages_on_disk(tmp_path, AUTO, complete=True) == 2  # a shared checkpoint: the newest complete one
    assert stages_on_disk(tmp_path, dataclasses.replace(AUTO, max_stages=2), complete=False) == 2


def test_stages_auto_and_its_bounds_in_the_config_and_the_run_settings():
    config = config_from_dict(AgentConfig, {"initial_peers": [BOOTSTRAP], "membership": {"expect": 4},
                                            "train": {"stages": "auto", "min_stages": 2, "max_stages": 4}})
    assert config.train.stages_auto and config.train.stage_bounds == (2, 4)
    assert config_from_dict(AgentConfig, {"initial_peers": [BOOTSTRAP], "train": {"stages": "auto"}}
                            ).train.stage_bounds == (1, 8)  # the model's blocks
    line = settings.identity(config.train)
    assert "stages=auto_2_4" in line.split(",") and "stages" not in settings.identity(FIXED)
    assert settings.described(line, settings.identity(dataclasses.replace(config.train, max_stages=3))) == \
        'stages "auto" (2 to 4)'  # agents with other bounds are another run
    PeerRecord(device_name="dev", memory_gb=16.0, tflops=10.0, settings=line)  # a valid record line
    bad = {
        "many": "train.stages: expected an integer, got 'many'; 'many' is not one of 'auto'",
        0: "stages must be at least 1",
        9: "cannot cut 8 layers into 9 stages",
    }
    for value, message in bad.items():
        with pytest.raises(ConfigError) as e:
            config_from_dict(AgentConfig, {"initial_peers": [BOOTSTRAP], "train": {"stages": value}})
        assert "\n" not in str(e.value) and message in str(e.value), str(e.value)
    for train, message in (({"stages": "auto", "min_stages": 3, "max_stages": 2}, "1 <= min_stages <= max_stages"),
                           ({"stages": "auto", "max_stages": 9}, "the model's 8 blocks"),
                           ({"stages": 3, "max_stages": 2}, "stages=3 lies outside min_stages=1 .. max_stages=2"),
                           ({"stages": "auto", "layers": [[0, 4], [4, 8]]}, "layers needs a number of stages"),
                           ({"stages": "auto", "min_stages": 3}, "membership.expect=2 is fewer peers than "
                                                                 "train.min_stages=3")):
        with pytest.raises(ConfigError, match=message):
            config_from_dict(AgentConfig, {"initial_peers": [BOOTSTRAP], "train": train, "membership": {"expect": 2}})


def test_stages_auto_on_the_command_line_and_in_the_swarms_agent_configs(tmp_path):
    result = CliRunner().invoke(main, ["agent", "--stages", "many", "--initial-peers", BOOTSTRAP])
    assert result.exit_code == 2 and "'many' is not a valid integer or 'auto'" in result.output
    result = CliRunner().invoke(main, ["swarm", "--stages", "0"])
    assert result.exit_code == 2 and "0 is not a positive number of stages" in result.output

    config = SwarmConfig(agents=4, stages="auto", steps=3, scenario="worldwide")
    train, network, time_scale, size_factor = plan_swarm(config)
    assert train.stages_auto and train.replicas == 1 and train.global_batch_size % (4 * 2) == 0  # matched as S = 1
    agent = AgentProcess(0, "peer", "agent-0", tmp_path / "agent-0.toml", tmp_path / "agent-0.log",
                         EventReader(tmp_path / "agent-0.events.jsonl"))
    text = _agent_toml(config, train, "run1", [BOOTSTRAP], agent, tmp_path, tmp_path / "cluster.json",
                       time_scale, size_factor)
    parsed = config_from_dict(AgentConfig, tomllib.loads(text))
    assert parsed.train.stages_auto and parsed.train.stage_bounds == (1, 8)
    with pytest.raises(ConfigError, match='may be "auto"'):
        SwarmConfig(agents=4, stages="many")
