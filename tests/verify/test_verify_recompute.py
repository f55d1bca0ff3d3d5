"""Recomputing a member's micro-batch: the executor's arithmetic, honest variants pass, corruptions are caught,
garbled input refused."""

import pytest
import torch

from p2ptrain.model.data import TrainData, inputs_and_targets, load_tokens
from p2ptrain.model.loss import micro_batch_loss
from p2ptrain.model.stage import build_stage
from p2ptrain.planning.model_shapes import model_shape
from p2ptrain.runtime.wire import Codec
from p2ptrain.verify.recompute import (
    Allowance,
    allowance,
    check_message,
    check_sketch,
    compare_rows,
    recompute,
)
from p2ptrain.verify.sketch import sketch

SHAPE = model_shape("tiny")
TOKENS = 8 * SHAPE.seq_len  # the global batch's: the loss's denominator


@pytest.fixture(scope="module")
def pipeline():
    """Three stages of tiny and one micro-batch of 2 rows through them: inputs, targets, activations."""
    stages = [build_stage(SHAPE, j, 3, seed=0) for j in range(3)]
    data = TrainData(load_tokens(), SHAPE.seq_len, 8, seed=0)
    inputs, targets = inputs_and_targets(data.global_batch(0)[:2])
    with torch.no_grad():
        x1 = stages[0](inputs)
        x2 = stages[1](x1)
    g2 = recompute(stages[2], x2, targets=targets, loss_tokens=TOKENS).input_grad
    g1 = recompute(stages[1], x1, grad_output=g2).input_grad
    return stages, inputs, targets, x1, x2, g1, g2


def test_recompute_does_what_the_executor_does(pipeline):
    stages, inputs, targets, x1, x2, g1, g2 = pipeline
    cases = [(stages[0], inputs, {"grad_output": g1}), (stages[1], x1, {"grad_output": g2}),
             (stages[2], x2, {"targets": targets, "loss_tokens": TOKENS})]
    for module, x, kwargs in cases:
        module.zero_grad(set_to_none=True)
        got = recompute(module, x, **kwargs)
        assert all(p.grad is None for p in module.parameters())  # recompute leaves .grad alone
        leaf = x if module.has_embeddings else x.clone().requires_grad_(True)
        out = module(leaf)
        if module.has_head:
            out = micro_batch_loss(out, targets, TOKENS)
            out.backward()
        else:
            out.backward(kwargs["grad_output"])
        assert torch.equal(got.output, out.detach())
        assert (got.input_grad is None) == module.has_embeddings
        if got.input_grad is not None:
            assert torch.equal(got.input_grad, leaf.grad)
        for g, p in zip(got.param_grads, module.parameters(), strict=True):
            assert torch.equal(g, p.grad)
        module.zero_grad(set_to_none=True)


def test_without_parameter_gradients_stage_0_redoes_its_forward_alone_and_the_same_bits(pipeline):
    """The recompute check's call (``param_grads=False``): stage 0 sends only its activation, so only its forward is
    redone, without autograd's graph, and its output is the executor's, bit for bit; a later stage still redoes
    its input's gradient."""
    stages, inputs, targets, x1, x2, g1, g2 = pipeline
    got = recompute(stages[0], inputs, grad_output=g1, param_grads=False)
    assert got.input_grad is None and got.param_grads == () and not got.output.requires_grad
    assert torch.equal(got.output, stages[0](inputs).detach())
    later = recompute(stages[1], x1, grad_output=g2, param_grads=False)
    assert later.param_grads == () and torch.equal(later.input_grad, recompute(stages[1], x1, grad_output=g2).input_grad)


@pytest.mark.parametrize("codec", ["fp32", "int8", "int2"])
def test_honest_recomputations_pass(pipeline, codec):
    """Row by row against whole, and a bf16 member against an fp32 verifier under the bf16 allowance."""
    stages, inputs, targets, x1, x2, g1, g2 = pipeline
    wire = Codec(codec)
    whole = recompute(stages[1], x1, grad_output=g2)
    rows = [recompute(stages[1], x1[i: i + 1], grad_output=g2[i: i + 1]) for i in range(2)]
    by_rows = torch.cat([r.output for r in rows])
    assert check_message(wire, wire.encode(by_rows), whole.output, allowance("fp32", "activation")).passed
    stages[1].precision = "bf16"
    try:
        member = recompute(stages[1], x1, grad_output=g2)
    finally:
        stages[1].precision = "fp32"
    assert check_message(wire, wire.encode(member.output), whole.output, allowance("bf16", "activation")).passed
    assert check_message(wire, wire.encode(member.input_grad), whole.input_grad, allowance("bf16", "input_grad")).passed
    flat = lambda r: torch.cat([g.reshape(-1) for g in r.param_grads])  # noqa: E731
    assert check_sketch(sketch(flat(member), 3), sketch(flat(whole), 3), allowance("bf16", "param_grad")).passed


def test_corrupt_outputs_are_caught(pipeline):
    stages, inputs, targets, x1, x2, g1, g2 = pipeline
    own = recompute(stages[1], x1, grad_output=g2)
    out, grad = own.output, own.input_grad
    gen = torch.Generator().manual_seed(0)
    noise = lambda x, f: x + f * x.std() * torch.randn(x.shape, generator=gen)  # noqa: E731
    fp32, int8 = Codec("fp32"), Codec("int8")
    for precision in ("fp32", "bf16"):
        eps = allowance(precision, "activation")
        for bad in (noise(out, 3.0), x1, out.mean() + out.std() * torch.randn(out.shape, generator=gen)):
            assert not check_message(fp32, fp32.encode(bad), out, eps).passed
            assert not check_message(int8, int8.encode(bad), out, eps).passed
    assert not check_message(fp32, fp32.encode(noise(out, 0.03)), out, allowance("fp32", "activation")).passed
    assert not check_message(fp32, fp32.encode(noise(grad, 0.03)), grad, allowance("fp32", "input_grad")).passed
    one_row = out.clone()
    one_row[0, 5] += 0.1 * one_row[0, 5].norm() * torch.randn(SHAPE.hidden_size, generator=gen) / 8
    check = compare_rows(one_row, out, None, allowance("bf16", "activation"))
    assert check.whole_ratio < 1 < check.row_ratio and check.row == 5  # one token: caught by its row, named
    nan = out.clone()
    nan[1, 2, 3] = float("nan")
    assert not compare_rows(nan, out, None, Allowance(1.0, 1.0)).passed


def test_garbled_input_is_refused_in_one_line(pipeline):
    stages, inputs, targets, x1, x2, g1, g2 = pipeline
    cases = [
        (lambda: recompute(stages[1], x1[..., :10], grad_output=g2), "activation"),
        (lambda: recompute(stages[1], x1, grad_output=g2[:1]), "output gradient"),
        (lambda: recompute(stages[1], x1.index_fill(2, torch.tensor([0]), float("nan")), grad_output=g2), "NaN"),
        (lambda: recompute(stages[1], x1, grad_output=g2.index_fill(2, torch.tensor([0]), float("inf"))), "NaN"),
        (lambda: recompute(stages[0], x1, grad_output=g1), "token ids"),
        (lambda: recompute(stages[2], x2), "targets"),
        (lambda: check_message(Codec("fp32"), x1, x1[:1], Allowance(1e-3, 1e-3)), "does not decode"),
        (lambda: compare_rows(x1, x1[:1], None, Allowance(1e-3, 1e-3)), "differ in shape"),
        (lambda: allowance("fp16", "activation"), "no floating-point allowance"),
        (lambda: check_sketch(torch.zeros(3), torch.zeros(4), Allowance(0, 1e-3)), "differ in shape"),
        (lambda: Allowance(-1.0, 0.0), "non-negative"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message) as error:
            call()
        assert "\n" not in str(error.value)
    fp16 = build_stage(SHAPE, 1, 3, seed=0, precision="fp16")
    with pytest.raises(ValueError, match="fp16"):
        recompute(fp16, x1, grad_output=g2)
