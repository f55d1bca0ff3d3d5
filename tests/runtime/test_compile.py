"""``[train] compile`` (``model.compiled``): the blocks compile in place under their own names, copies compile
again, the setting is part of the run's identity, a torch that cannot compile is refused in one line, and a
compiled run trains the eager run's losses."""

from __future__ import annotations

import copy
import dataclasses
import os

import pytest
import torch
from click.testing import CliRunner

from p2ptrain.agent.leadership import settings
from p2ptrain.cli import main
from p2ptrain.config import config_from_dict
from p2ptrain.errors import ConfigError
from p2ptrain.model.compiled import check_compile, is_compiled
from p2ptrain.model.stage import build_stage
from p2ptrain.net.identity import generate_identity
from p2ptrain.runtime.config import TrainConfig
from p2ptrain.runtime.reference import train_reference

PEER = generate_identity().peer_id
FAST = TrainConfig(steps=4, global_batch_size=8, micro_batches=2, seq_len=32, device="cpu", num_threads=1)


@pytest.fixture
def no_compiler(monkeypatch):
    """A torch whose CPU backend finds no C++ compiler: its first compile fails (a real inductor error)."""
    import torch._inductor.config as inductor

    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # the commands set it; keep this process's env
    with inductor.patch({"cpp.cxx": ("no-such-c++-compiler",)}):
        yield


def test_compile_is_off_by_default_and_a_config_key():
    assert TrainConfig().compile is False
    assert config_from_dict(TrainConfig, {"compile": True}).compile is True
    assert config_from_dict(TrainConfig, FAST.to_dict()) == FAST


def test_the_blocks_compile_in_place_under_the_models_names_and_copies_compile_again():
    """Lazily (nothing compiles here): the embeddings and head stay eager, the parameter names are the eager
    stage's (no ``_orig_mod``), and a copy (the recompute check's shadow) runs its own blocks compiled."""
    eager = build_stage(FAST.shape, 0, 1, seed=0)
    compiled = build_stage(FAST.shape, 0, 1, seed=0, compile=True)
    assert all(is_compiled(b) for b in compiled.blocks.values()) and not is_compiled(compiled)
    assert not any(is_compiled(b) for b in eager.blocks.values())
    assert list(compiled.state_dict()) == list(eager.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(compiled.parameters(), eager.parameters(), strict=True))
    shadow = copy.deepcopy(compiled)
    assert all(is_compiled(b) for b in shadow.blocks.values())
    assert not any(is_compiled(b) for b in copy.deepcopy(eager).blocks.values())


def test_compile_is_part_of_the_runs_identity():
    """Compiled kernels round otherwise than eager ones: a compiled agent is not a member of an eager run."""
    stages = dataclasses.replace(FAST, stages=2)
    on = dataclasses.replace(stages, compile=True)
    assert settings.training_digest(on) != settings.training_digest(stages)
    assert settings.identity(on) != settings.identity(stages)
    assert settings.described(settings.identity(on), settings.identity(stages)).startswith("training ")


def test_a_torch_that_cannot_compile_is_refused_in_one_line(no_compiler):
    with pytest.raises(ConfigError, match=r"^\[train\] compile is on but torch.compile fails on cpu: .*C\+\+ "
                                          r"compiler.*--no-compile\)$") as caught:
        check_compile("cpu")
    assert "\n" not in str(caught.value)
    with pytest.raises(ConfigError, match="compile is on"):
        train_reference(dataclasses.replace(FAST, compile=True))  # before the first step


@pytest.mark.parametrize("command", [["train", "--steps", "1", "--device", "cpu"],
                                     ["swarm", "--agents", "2", "--steps", "1", "--scenario", "none"],
                                     ["agent", "--initial-peers", f"/ip4/127.0.0.1/tcp/1/p2p/{PEER}", "--device", "cpu"]])
def test_the_compile_flag_reaches_each_command_and_fails_in_one_line_where_torch_cannot(no_compiler, command):
    result = CliRunner().invoke(main, ["-q", *command, "--compile"])
    assert result.exit_code == 2, result.output
    line = result.output.strip().splitlines()[-1]
    assert line.startswith("Error: [train] compile is on but torch.compile fails on cpu")
    assert "Traceback" not in result.output


@pytest.mark.skipif(not os.environ.get("P2PTRAIN_TEST_COMPILE"),
                    reason="compiling on a CPU takes ~10 s with a warm inductor cache and ~40 s with a cold one (2 "
                           "shared cores): set P2PTRAIN_TEST_COMPILE=1 to run it")
@pytest.mark.timeout(240)
def test_a_compiled_run_trains_the_eager_runs_losses():
    """fp32: compiled kernels fuse and reorder the blocks' sums, which moves a loss by about 1e-7 relative (4
    steps of tiny: 9e-8); the bound is the one a different split of the batch gets (``test_reference``), and
    a real fault (a wrong op, a stale parameter) moves the loss by orders more."""
    import torch._inductor.config as inductor

    eager = train_reference(FAST)
    with inductor.patch(compile_threads=1):  # no compile worker processes outliving the test
        compiled = train_reference(dataclasses.replace(FAST, compile=True))
    assert compiled.losses == pytest.approx(eager.losses, rel=1e-4)
    assert compiled.losses[-1] < compiled.losses[0]
    for name, tensor in eager.state.items():
        assert torch.allclose(compiled.state[name], tensor, rtol=0, atol=FAST.optimizer.lr), name
