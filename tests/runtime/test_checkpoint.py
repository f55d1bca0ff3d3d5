import dataclasses

import pytest
import torch

from p2ptrain.model.data import inputs_and_targets
from p2ptrain.model.loss import micro_batch_loss
from p2ptrain.model.optim import build_optimizer
from p2ptrain.model.stage import build_stage
from p2ptrain.runtime.checkpoint import (
    latest_complete,
    load_stage,
    load_state_tensors,
    save_stage,
    state_names,
    state_tensors,
)
from p2ptrain.runtime.config import TrainConfig
from p2ptrain.runtime.reference import build_data

CFG = TrainConfig(steps=5, global_batch_size=4, micro_batches=1, num_threads=1)


def _train(module, optimizer, data, steps):
    for step in steps:
        inputs, targets = inputs_and_targets(data.global_batch(step))
        micro_batch_loss(module(inputs), targets, data.tokens_per_batch).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def _fresh():
    module = build_stage(CFG.shape, 0, 1, CFG.seed)
    return module, build_optimizer(module, CFG.optimizer)


def test_save_and_resume_continues_bit_for_bit(tmp_path):
    data = build_data(CFG)
    module, optimizer = _fresh()
    _train(module, optimizer, data, range(5))
    uninterrupted = {k: v.clone() for k, v in module.state_dict().items()}

    module, optimizer = _fresh()
    _train(module, optimizer, data, range(3))
    save_stage(tmp_path, 3, 0, 1, CFG.model, CFG.seed, state_tensors(module, optimizer))
    assert latest_complete(tmp_path, 1, CFG.model) == 3

    module, optimizer = _fresh()
    load_state_tensors(module, optimizer, load_stage(tmp_path, 3, 0, 1, CFG.model))
    _train(module, optimizer, data, range(3, 5))
    for name, value in module.state_dict().items():
        assert torch.equal(value, uninterrupted[name]), name


def test_incomplete_or_tampered_checkpoints_are_ignored(tmp_path):
    module, optimizer = _fresh()
    tensors = state_tensors(module, optimizer)
    for stage in range(2):
        save_stage(tmp_path, 4, stage, 2, CFG.model, CFG.seed, tensors)
    save_stage(tmp_path, 6, 0, 2, CFG.model, CFG.seed, tensors)  # stage 1 of step 6 never written
    assert latest_complete(tmp_path, 2, CFG.model) == 4
    assert latest_complete(tmp_path, 2, "small") is None  # another model's checkpoints do not count
    assert latest_complete(tmp_path, 3, CFG.model) is None
    data = tmp_path / "step-00000004" / "stage-001-of-002.safetensors"
    data.write_bytes(data.read_bytes()[:-1] + b"\x00")
    assert latest_complete(tmp_path, 2, CFG.model) is None
    with pytest.raises(ValueError, match="no complete checkpoint"):
        load_stage(tmp_path, 4, 0, 2, CFG.model)


def test_state_names_are_what_state_tensors_holds_after_a_step():
    module, optimizer = _fresh()
    data = build_data(dataclasses.replace(CFG))
    _train(module, optimizer, data, range(1))
    assert sorted(state_tensors(module, optimizer)) == sorted(state_names(module))


def test_a_state_missing_a_parameter_is_refused():
    module, optimizer = _fresh()
    tensors = state_tensors(module, optimizer)
    tensors.pop("param/ln_f.weight")
    with pytest.raises(ValueError, match="no parameter ln_f.weight"):
        load_state_tensors(module, optimizer, tensors)


def test_a_diloco_state_carries_the_outer_momentum_and_restarts_the_round_from_its_parameters():
    from p2ptrain.model.outer import DiLoCoConfig, OuterOptimizer

    module, optimizer = _fresh()
    outer = OuterOptimizer(list(module.parameters()), DiLoCoConfig(inner_steps=2))
    data = build_data(dataclasses.replace(CFG))
    _train(module, optimizer, data, range(2))
    outer.step(outer.pseudo_gradients())  # a round's end: momentum set, parameters = the new anchor
    tensors = state_tensors(module, optimizer, outer=outer)
    assert sorted(tensors) == sorted(state_names(module, with_outer=True))
    fresh, fresh_optimizer = _fresh()
    fresh_outer = OuterOptimizer(list(fresh.parameters()), DiLoCoConfig(inner_steps=2))
    load_state_tensors(fresh, fresh_optimizer, tensors, fresh_outer)
    for ours, theirs in ((outer.momentum, fresh_outer.momentum), (outer.anchor, fresh_outer.anchor)):
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))
    assert any(bool(m.abs().sum() > 0) for m in fresh_outer.momentum)
    # a state without momentum (an every-step run's) starts it at zero; a wrong shape is refused
    load_state_tensors(fresh, fresh_optimizer, state_tensors(module, optimizer), fresh_outer)
    assert all(not bool(m.any()) for m in fresh_outer.momentum)
    tensors["outer/momentum/ln_f.weight"] = torch.zeros(3)
    with pytest.raises(ValueError, match="outer momentum of ln_f.weight has shape"):
        load_state_tensors(fresh, fresh_optimizer, tensors, fresh_outer)
