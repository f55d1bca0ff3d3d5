"""DiLoCo's outer loop (``model.outer``): torch's Nesterov SGD on the pseudo-gradient, the round boundaries,
the settings refused in one line."""

from __future__ import annotations

import re

import pytest
import torch

from p2ptrain.model.outer import DiLoCoConfig, OuterOptimizer, fragment_of, fragment_parts
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


def test_fragments_rounds_are_staggered_by_h_over_f_and_all_end_at_the_last_step():
    cfg = DiLoCoConfig(inner_steps=6, fragments=3)
    ends = [[s for s in range(14) if cfg.fragment_ends(f, s, 14)] for f in range(3)]
    assert ends == [[5, 11, 13], [1, 7, 13], [3, 9, 13]]  # offsets 0, 2, 4: the later fragments' first round short
    assert [s for s in range(14) if cfg.round_ends(s, 14)] == ends[0]


def test_fragments_are_strided_blocks_with_the_embeddings_first_and_the_head_last():
    names = ["tok_emb.weight", "pos_emb.weight", *(f"blocks.{i}.attn.qkv.weight" for i in range(5)), "ln_f.weight",
             "head.weight"]
    assert [fragment_of(n, 2, 5) for n in names] == [0, 0, 0, 1, 0, 1, 0, 0, 0]
    assert fragment_parts(names, 3, 5) == [[0, 1, 2, 5], [3, 6, 7, 8], [4]]
    # a stage keeps the full model's names: its fragments are the full model's, cut to what it holds
    assert fragment_parts(names[4:7], 2, 5) == [[0, 2], [1]]  # blocks 2, 3, 4


@pytest.mark.parametrize("changes, message", [
    (dict(inner_steps=0), "diloco.inner_steps must be a positive integer"),
    (dict(outer_lr=0.0), "diloco.outer_lr must be positive"),
    (dict(outer_momentum=1.0), "diloco.outer_momentum must be in [0, 1)"),
    (dict(fragments=0), "diloco.fragments must be a positive integer"),
    (dict(inner_steps=4, fragments=5), "diloco.fragments (5) must be at most inner_steps (4)"),
])
def test_bad_settings_are_refused(changes, message):
    with pytest.raises(ValueError, match=re.escape(message)):
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
