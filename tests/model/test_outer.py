"""DiLoCo's outer loop (``model.outer``): torch's Nesterov SGD on the pseudo-gradient, the round boundaries,
the settings refused in one line."""

from __future__ import annotations

import pytest
import torch

from p2ptrain.model.outer import DiLoCoConfig, OuterOptimizer
from p2ptrain.runtime.config import TrainConfig


@pytest.mark.parametrize("nesterov", [True, False])
def test_the_outer_step_is_torchs_sgd_on_the_pseudo_gradient(nesterov):
    cfg = DiLoCoConfig(inner_steps=2, outer_lr=0.7, outer_momentum=0.9, nesterov=nesterov)
    start = torch.randn(5, generator=torch.Generator().manual_seed(0))
    ours = torch.nn.Parameter(start.clone())
    outer = OuterOptimizer([ours], cfg)
    theirs = torch.nn.Parameter(start.clone())
    sgd = torch.optim.SGD([theirs], lr=0.7, momentum=0.9, nesterov=nesterov)
    for k in range(3):
        moved = torch.randn(5, generator=torch.Generator().manual_seed(k + 1))
        with torch.no_grad():
            ours.add_(moved)  # the inner steps moved the parameters
        (delta,) = outer.pseudo_gradients()
        outer.step([delta])
        theirs.grad = delta.clone()
        sgd.step()
        assert torch.allclose(ours.detach(), theirs.detach(), atol=1e-6)
        assert torch.equal(outer.anchor[0], ours.detach())  # the next round starts from the new anchor


def test_the_tentative_step_is_the_outer_step_bit_for_bit_and_changes_nothing():
    """``overlap``'s round start: the anchor the outer step of a pseudo-gradient would give (with one replica,
    the one its mean gives, bit for bit), while the anchor and momentum stay until the mean is in."""
    cfg = DiLoCoConfig(inner_steps=2, outer_lr=0.7, outer_momentum=0.9, overlap=True)
    param = torch.nn.Parameter(torch.randn(7, generator=torch.Generator().manual_seed(0)))
    outer = OuterOptimizer([param], cfg)
    for k in range(3):
        with torch.no_grad():
            param.add_(torch.randn(7, generator=torch.Generator().manual_seed(k + 1)))
        (delta,) = outer.pseudo_gradients()
        anchor, momentum = outer.anchor[0].clone(), outer.momentum[0].clone()
        (start,) = outer.tentative([delta])
        assert torch.equal(outer.anchor[0], anchor) and torch.equal(outer.momentum[0], momentum)
        outer.advance([delta])
        assert torch.equal(start, outer.anchor[0])
        outer.start = [start]
        outer.reset([param], [start])
    assert cfg.step_window == 4 and DiLoCoConfig(inner_steps=2).step_window == 2


def test_rounds_end_every_h_steps_and_at_the_last():
    cfg = DiLoCoConfig(inner_steps=3)
    assert [s for s in range(8) if cfg.round_ends(s, 8)] == [2, 5, 7]


@pytest.mark.parametrize("changes, message", [
    (dict(inner_steps=0), "diloco.inner_steps must be a positive integer"),
    (dict(outer_lr=0.0), "diloco.outer_lr must be positive"),
    (dict(outer_momentum=1.0), "diloco.outer_momentum must be in [0, 1)"),
])  # fmt: skip
def test_bad_settings_are_refused(changes, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace(")", r"\)")):
        DiLoCoConfig(**changes)
    with pytest.raises(ValueError, match="unknown sync mode 'sometimes'"):
        TrainConfig(sync="sometimes")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here: the host-memory path needs a GPU")
def test_on_a_gpu_the_outer_state_lives_in_host_memory_and_steps_as_on_the_cpu():
    cfg = DiLoCoConfig(inner_steps=2, outer_lr=0.7, outer_momentum=0.9)
    start = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    gpu = torch.nn.Parameter(start.clone().cuda())
    cpu = torch.nn.Parameter(start.clone())
    outers = OuterOptimizer([gpu], cfg), OuterOptimizer([cpu], cfg)
    assert outers[0].anchor[0].device.type == "cpu" and outers[0].momentum[0].device.type == "cpu"
    for k in range(3):
        moved = torch.randn(1000, generator=torch.Generator().manual_seed(k + 1))
        with torch.no_grad():
            gpu.add_(moved.cuda())
            cpu.add_(moved)
        for outer in outers:
            outer.step(outer.pseudo_gradients())
        assert torch.equal(gpu.detach().cpu(), cpu.detach())  # the same arithmetic, on the host
