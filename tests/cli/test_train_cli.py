"""``p2ptrain train``: per-step lines, one JSON document with --json, flags over --config, bad input exit 2."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from click.testing import CliRunner

from p2ptrain.cli import main
from p2ptrain.runtime.config import TrainConfig
from p2ptrain.runtime.reference import train_reference

FAST_FLAGS = [
    "--steps",
    "3",
    "--batch-size",
    "4",
    "--micro-batches",
    "2",
    "--seq-len",
    "16",
    "--device",
    "cpu",
    "--threads",
    "1",
]


@pytest.fixture(autouse=True)
def _cublas_variable_already_set(monkeypatch):
    """The command sets CUBLAS_WORKSPACE_CONFIG for deterministic runs; keep this process's env as it was."""
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


def invoke(*args: str):
    return CliRunner().invoke(main, ["-q", "train", *args], catch_exceptions=False)


def test_json_is_one_document_with_the_reference_losses():
    result = invoke(*FAST_FLAGS, "--json")
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout)
    expected = train_reference(
        TrainConfig(steps=3, global_batch_size=4, micro_batches=2, seq_len=16, device="cpu", num_threads=1)
    )
    assert document["losses"] == expected.losses
    assert len(document["step_time_s"]) == 3 and all(t > 0 for t in document["step_time_s"])
    assert document["model"] == "tiny" and document["device"] == "cpu"
    assert document["num_parameters"] == expected.num_parameters
    assert document["config"]["global_batch_size"] == 4 and document["config"]["optimizer"]["lr"] == 2e-3
    assert result.stderr.count("loss") == 3  # the per-step lines moved to stderr


def test_plain_output_has_a_line_per_step_and_a_summary():
    result = invoke(*FAST_FLAGS)
    assert result.exit_code == 0, result.output
    lines = result.stdout.strip().splitlines()
    assert [line.split()[1] for line in lines[:3]] == ["1/3", "2/3", "3/3"]
    assert lines[3].startswith("trained tiny")


def test_flags_override_the_config_file(tmp_path):
    config = tmp_path / "train.toml"
    config.write_text(
        'steps = 5\nseed = 3\ndevice = "cpu"\nseq_len = 16\nglobal_batch_size = 4\nnum_threads = 1\n[optimizer]\nlr = 1e-3\n'
    )
    result = invoke("--config", str(config), "--steps", "2", "--json")
    assert result.exit_code == 0, result.output
    cfg = json.loads(result.stdout)["config"]
    assert (cfg["steps"], cfg["seed"], cfg["optimizer"]["lr"]) == (2, 3, 1e-3)


def test_data_flag_trains_on_a_local_file(tmp_path):
    (tmp_path / "a.txt").write_text("the quick brown fox jumps over the lazy dog. " * 20)
    result = invoke(*FAST_FLAGS, "--data", str(tmp_path), "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["config"]["data"] == str(tmp_path)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--steps", "0"], "Invalid value for '--steps'"),
        (["--threads", "0"], "Invalid value for '--threads'"),
        (["--model", "huge"], "Invalid value for '--model'"),
        (["--batch-size", "6", "--micro-batches", "4"], "does not split"),
        (["--data", "/nonexistent/corpus.txt"], "does not exist"),
        (["--stages", "2", "--replicas", "3"], "does not split into 3 replicas"),
        (["--stages", "9"], "cannot cut 8 layers into 9 stages"),
        (["--config", "/nonexistent.toml"], "does not exist"),
        (["--frobnicate"], "No such option"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, message):
    result = invoke(*args)
    assert result.exit_code == 2, result.output
    assert message in result.stderr and "Traceback" not in result.output


def test_stages_auto_is_for_agents(tmp_path):
    config = tmp_path / "train.toml"
    config.write_text('stages = "auto"\n')
    result = invoke("--config", str(config))
    assert result.exit_code == 2 and 'stages = "auto" is for agents' in result.stderr


def test_unknown_config_keys_are_refused(tmp_path):
    config = tmp_path / "train.toml"
    config.write_text("stpes = 3\n")
    result = invoke("--config", str(config))
    assert result.exit_code == 2 and "unknown config key stpes" in result.stderr


@pytest.mark.timeout(120)
def test_the_installed_command_prints_exactly_one_json_document_on_stdout():
    process = subprocess.run(
        [sys.executable, "-m", "p2ptrain", "train", *FAST_FLAGS, "--json"],
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert process.returncode == 0, process.stderr
    document = json.loads(process.stdout)  # fails on any extra output
    assert len(document["losses"]) == 3
    assert "step 3/3" in process.stderr


def test_emulation_flags_need_a_plan():
    result = invoke("--scenario", "worldwide")
    assert result.exit_code == 2 and "go with --plan" in result.stderr


@pytest.mark.integration
@pytest.mark.timeout(180)
def test_a_plan_on_an_emulated_network_runs_workers_and_trains_the_single_process_losses(tmp_path):
    """`p2ptrain plan --json` then `p2ptrain train --plan FILE --scenario worldwide --workdir DIR --json`: the
    plan's 2 stages × 2 replicas as worker processes (logs in DIR), replicas identical after every step;
    emulated links change timing only, never what is computed."""
    plan = subprocess.run([sys.executable, "-m", "p2ptrain", "plan", "--scenario", "worldwide", "--devices", "4",
                           "--stages", "2", "--json"], capture_output=True, text=True, timeout=60)
    assert plan.returncode == 0, plan.stderr
    (tmp_path / "plan.json").write_text(plan.stdout)
    flags = ["--steps", "3", "--batch-size", "8", "--micro-batches", "2", "--threads", "1"]
    single = json.loads(invoke(*flags, "--json").stdout)
    process = subprocess.run(
        [sys.executable, "-m", "p2ptrain", "train", *flags, "--plan", str(tmp_path / "plan.json"),
         "--scenario", "worldwide", "--time-scale", "0.01", "--size-factor", "0.001", "--workdir",
         str(tmp_path / "work"), "--json"],
        capture_output=True, text=True, timeout=170,
    )
    assert process.returncode == 0, process.stderr
    assert "emulating worldwide (4 devices): time scale 0.01, size factor 0.001" in process.stderr
    document = json.loads(process.stdout)
    assert (document["stages"], document["replicas"], document["replicas_identical"]) == (2, 2, True)
    assert len(document["step_time_s"]) == 3
    for got, want in zip(document["losses"], single["losses"], strict=True):
        assert abs(got - want) <= 1e-4 * abs(want)
    logs = sorted(p.name for p in (tmp_path / "work").glob("*.log"))
    assert logs == ["forkserver.log", *(f"worker-{s}-{r}.log" for s in (0, 1) for r in (0, 1))]  # forked from it
