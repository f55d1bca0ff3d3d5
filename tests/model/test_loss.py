"""The loss convention: micro-batch losses over the global token count add up to the global mean."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from p2ptrain.model.data import TrainData, inputs_and_targets, load_tokens, micro_batches, shard_of
from p2ptrain.model.gpt import GPT
from p2ptrain.model.loss import micro_batch_loss
from p2ptrain.model.stage import build_stage
from p2ptrain.planning.model_shapes import model_shape

TINY = dataclasses.replace(model_shape("tiny"), seq_len=32)


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return grads


@pytest.mark.parametrize("replicas, micro", [(1, 1), (1, 4), (2, 2), (4, 2)])
def test_micro_batched_gradients_equal_the_full_batch_gradient_of_the_mean_loss(replicas, micro):
    model = GPT(TINY, seed=0)
    batch = TrainData(load_tokens(), TINY.seq_len, 8, seed=0).global_batch(0)
    inputs, targets = inputs_and_targets(batch)
    mean = F.cross_entropy(model(inputs).reshape(-1, 256), targets.reshape(-1))
    mean.backward()
    expected = _grads(model)

    total = 0.0
    for r in range(replicas):
        for rows in micro_batches(shard_of(batch, r, replicas), micro):
            x, y = inputs_and_targets(rows)
            loss = micro_batch_loss(model(x), y, targets.numel())
            loss.backward()
            total += loss.item()
    got = _grads(model)
    assert total == pytest.approx(mean.item(), rel=1e-6)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=1e-6, msg=name)


def test_the_same_holds_through_a_pipeline_of_stages():
    """Stage by stage: activations forward, their gradients backward (what the runtime will do)."""
    batch = TrainData(load_tokens(), TINY.seq_len, 4, seed=1).global_batch(0)
    inputs, targets = inputs_and_targets(batch)
    full = GPT(TINY, seed=0)
    micro_batch_loss(full(inputs), targets, targets.numel()).backward()
    expected = _grads(full)

    stages = [build_stage(TINY, j, 3, seed=0) for j in range(3)]
    for rows in micro_batches(batch, 2):
        x, y = inputs_and_targets(rows)
        outputs, received = [], []
        for stage in stages:
            if received:  # a hidden state that arrived from the previous stage
                x = x.detach().requires_grad_()
            received.append(x)
            x = stage(x)
            outputs.append(x)
        grad = None
        for j in reversed(range(3)):
            if j == 2:
                micro_batch_loss(outputs[j], y, targets.numel()).backward()
            else:
                outputs[j].backward(grad)
            grad = received[j].grad
    for stage in stages:
        for name, p in stage.named_parameters():
            torch.testing.assert_close(p.grad, expected[name], rtol=0, atol=1e-6, msg=name)


def test_mismatched_logits_and_targets_are_refused():
    with pytest.raises(ValueError, match="do not match"):
        micro_batch_loss(torch.zeros(2, 4, 256), torch.zeros(2, 5, dtype=torch.long), 100)
    with pytest.raises(ValueError, match="global batch"):
        micro_batch_loss(torch.zeros(2, 4, 256), torch.zeros(2, 4, dtype=torch.long), 4)
