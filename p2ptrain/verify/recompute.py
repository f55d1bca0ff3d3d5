"""Re-executing one micro-batch of a member's stage, and comparing what it sent with what it should have sent.

Replicas of a stage hold bit-identical parameters (``runtime.allreduce``), so another replica of the stage
(the verifier) can redo a member's micro-batch from the same input: stage 0 from the step's token ids (every
peer derives the global batch), a later stage from the activation the member received (decoded: exactly what
it computed on), and the backward from the output gradient it received (or, on the last stage, the
micro-batch loss of ``model.loss``). ``recompute`` returns the output activation, the input gradient and the
parameter gradients, as ``executor.StageExecutor`` computes them, without touching any ``.grad``.

**The comparison** (``check_message``). The member sent ``M = encode(m)``; the verifier computed ``v``. Two
statistics, each caught above 1. Per row ``r`` (one token's vector of ``d`` values):

    ‖decode(M)_r − v_r‖₂ / (‖β_r‖₂ + ε_row · max(‖v_r‖₂, ν))

and over the whole tensor:

    ‖decode(M) − v‖₂ / (‖β‖₂ + ε_whole · ‖v‖₂)

with ``β = bounds.error_bound(codec, M)`` (``|decode(M) − m| ≤ β``, provable) and ``ε`` the floating-point
allowance (``‖m − v‖ ≤ ε·‖v‖``, measured); the triangle inequality joins them. ``ν`` is the RMS of the rows'
norms. Why these:

* per row: a member that corrupts a few tokens (one sequence of the micro-batch) is not diluted by the rows it
  left alone, as the whole tensor's ratio would be; the largest row is named;
* over the whole tensor: honest floating-point deviations are uneven over rows (in a bf16 run a confident
  token's logits round coarsely), so the largest row's needs a wide allowance; their sum over the tensor is
  steadier, so noise spread over every row is caught against a tight one;
* relative, so one allowance serves every layer, width and training stage (activations grow, gradients shrink);
* against ``max(‖v_r‖, ν)`` rather than ``‖v_r‖``: a row whose value is nearly zero (a token whose gradient
  vanishes) has no meaningful relative error; it is judged against the typical row;
* ℓ2 within a row rather than element-wise: one element's floating-point deviation can be large relative to
  that element (a near-cancellation); a row's norm is not.

**The allowance ε** (``FLOAT_ALLOWANCE``, per run precision and quantity) is ``SAFETY`` times a deviation
measured against float64 (``benchmarks/verify_noise.py --measure``): presets ``tiny``, ``small`` and
``llama-tiny``, at initialisation and after 200 and 1,000 steps of training, the micro-batch computed whole and
row by row (another batching makes other kernels), with 1, 2 and 4 CPU threads and on an H200, every row of every
sample.
If each honest implementation stays within δ of the exact value, two of them differ by at most 2δ (triangle
inequality): in an ``fp32`` run ε = SAFETY · 2δ_fp32. In a ``bf16`` run the verifier recomputes in fp32 (its own
error is δ_fp32, four orders below), so ε = SAFETY · (δ_bf16 + δ_fp32) and bf16 implementations need not agree
with each other. The safety factor covers what was not measured: other accelerators' kernels, other samples and
training states; for a model much larger than these presets, measure its own δ the same way.
docs/verification.md has the numbers.

``fp16`` is refused: its loss scale is per-stage state that a verifier does not share.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from p2ptrain.model.gpt import GPT
from p2ptrain.model.loss import micro_batch_loss
from p2ptrain.runtime.wire import Codec
from p2ptrain.verify.bounds import all_finite, error_bound

SAFETY = 3.0  # the allowance over the largest honest deviation measured


@dataclass(frozen=True)
class Allowance:
    """The floating-point allowance ε of the row statistic and of the whole-tensor one (see the module)."""

    row: float
    whole: float

    def __post_init__(self) -> None:
        if not (self.row >= 0 and self.whole >= 0):
            raise ValueError(f"allowances must be non-negative, got row {self.row}, whole {self.whole}")


# ε per (run precision, quantity) = SAFETY × the largest deviation δ measured against float64, rounded up: in
# an fp32 run 2·δ_fp32 (both sides fp32), in a bf16 run δ_bf16 + δ_fp32 (the verifier recomputes in fp32).
# δ in the comments: the largest over presets, training states and devices (docs/verification.md).
FLOAT_ALLOWANCE: dict[tuple[str, str], Allowance] = {
    ("fp32", "activation"): Allowance(row=6e-6, whole=4e-6),  # δ 8.97e-7, 5.57e-7
    ("fp32", "input_grad"): Allowance(row=1.2e-4, whole=3.7e-5),  # δ 1.93e-5, 6.08e-6 (small, step 1000, H200)
    ("fp32", "param_grad"): Allowance(row=0.0, whole=1.7e-5),  # δ 2.71e-6 (small, step 1000, H200)
    ("bf16", "activation"): Allowance(row=4e-2, whole=1.6e-2),  # δ 1.21e-2 (llama-tiny), 5.07e-3 (small)
    ("bf16", "input_grad"): Allowance(row=0.32, whole=8.4e-2),  # δ 0.104, 2.78e-2 (small, step 1000, H200)
    ("bf16", "param_grad"): Allowance(row=0.0, whole=0.11),  # δ 3.47e-2 (small, step 40, H200)
}
QUANTITIES = ("activation", "input_grad", "param_grad")


@dataclass(frozen=True)
class Recomputed:
    """One micro-batch redone: ``output`` (activation ``[rows, T, d]``, or on the last stage the micro-batch
    loss), ``input_grad`` (None on stage 0) and the parameter gradients (trainable parameters, in order)."""

    output: torch.Tensor
    input_grad: torch.Tensor | None
    param_grads: tuple[torch.Tensor, ...]


def recompute(
    module: GPT,
    inputs: torch.Tensor,
    *,
    tokens: torch.Tensor | None = None,
    grad_output: torch.Tensor | None = None,
    targets: torch.Tensor | None = None,
    loss_tokens: int | None = None,
    param_grads: bool = True,
) -> Recomputed:
    """Forward and backward of one micro-batch of ``module`` (a stage of ``model.stage.build_stage``).

    ``inputs``: token ids ``[rows, T]`` on stage 0, else the decoded activation ``[rows, T, w]`` (w the shape's
    ``boundary_width``); ``tokens``: the micro-batch's token ids, which a later stage of a subspace model lifts
    its input with (``model.subspace``);
    ``grad_output``: the decoded gradient of the output (every stage but the last); ``targets`` and
    ``loss_tokens`` (the loss's denominator: the global batch's tokens) on the last stage. Without
    ``param_grads`` only what a member sends is redone (``param_grads`` empty): the input's gradient, none on
    stage 0, whose backward is then skipped (the check of the pipeline's messages; the weights' gradients are
    the sum check's). ValueError (one line) for inputs that do not fit."""
    if module.precision == "fp16":
        raise ValueError("fp16 stages are not recomputed: their loss scale is per-stage state")
    _check_inputs(module, inputs, grad_output, targets, loss_tokens)
    first = next(module.parameters())
    device, dtype = first.device, first.dtype  # float32; float64 for a reference computation
    params = [p for p in module.parameters() if p.requires_grad]
    x = inputs.to(device)
    tok = None if tokens is None else tokens.to(device)  # a subspace model's later stages lift with them
    if not param_grads and module.has_embeddings:  # stage 0 sends its activation only: the forward, no graph
        with torch.no_grad():
            out = module(x, tok)
            if module.has_head:
                out = micro_batch_loss(out, targets.to(device), loss_tokens)
        return Recomputed(out, None, ())
    if not module.has_embeddings:
        x = x.detach().to(dtype).requires_grad_(True)
    with torch.enable_grad():
        out = module(x, tok)
        if module.has_head:
            out = micro_batch_loss(out, targets.to(device), loss_tokens)
            seeds = None
        else:
            seeds = grad_output.to(device, out.dtype)
        if not param_grads:
            params = []
            if module.has_embeddings:
                return Recomputed(out.detach(), None, ())
        wrt = params if module.has_embeddings else [x, *params]
        grads = torch.autograd.grad(out, wrt, grad_outputs=seeds, allow_unused=True)
    grads = [torch.zeros_like(w) if g is None else g for g, w in zip(grads, wrt, strict=True)]
    input_grad = None if module.has_embeddings else grads[0].detach()
    param_grads = tuple(g.detach() for g in (grads if module.has_embeddings else grads[1:]))
    return Recomputed(out.detach(), input_grad, param_grads)


def _check_inputs(module: GPT, inputs: torch.Tensor, grad_output: torch.Tensor | None,
                  targets: torch.Tensor | None, loss_tokens: int | None) -> None:
    shape = module.shape
    if module.has_embeddings:
        if inputs.dim() != 2 or inputs.dtype not in (torch.int64, torch.int32, torch.uint8):
            raise ValueError(f"stage 0 takes token ids [rows, T], got {tuple(inputs.shape)} {inputs.dtype}")
        rows, seq = inputs.shape
    else:
        if inputs.dim() != 3 or inputs.shape[2] != shape.boundary_width or not inputs.dtype.is_floating_point:
            raise ValueError(f"a later stage takes an activation [rows, T, {shape.boundary_width}], got "
                             f"{tuple(inputs.shape)} {inputs.dtype}")
        if not all_finite(inputs):
            raise ValueError("the input activation holds NaN or infinite values")
        rows, seq = inputs.shape[:2]
    if module.has_head:
        if targets is None or tuple(targets.shape) != (rows, seq) or loss_tokens is None or loss_tokens < targets.numel():
            raise ValueError(f"the last stage needs targets [{rows}, {seq}] and the global batch's token count")
    elif grad_output is None or tuple(grad_output.shape) != (rows, seq, shape.boundary_width):
        raise ValueError(f"a stage before the last needs the output gradient [{rows}, {seq}, {shape.boundary_width}], "
                         f"got {None if grad_output is None else tuple(grad_output.shape)}")
    elif not all_finite(grad_output):
        raise ValueError("the output gradient holds NaN or infinite values")


@dataclass(frozen=True)
class RecomputeCheck:
    """The two statistics over what each was allowed (caught when either exceeds 1), and the worst row."""

    row_ratio: float
    whole_ratio: float
    row: int

    @property
    def ratio(self) -> float:
        return max(self.row_ratio, self.whole_ratio)

    @property
    def passed(self) -> bool:
        return self.ratio <= 1.0


def compare_rows(sent: torch.Tensor, own: torch.Tensor, bound: torch.Tensor | None, allowance: Allowance) -> RecomputeCheck:
    """Compare ``sent`` (decoded) with ``own`` row by row and as a whole (see the module); rows are the last
    dimension. ``bound``: the codec's element-wise bound on ``sent`` (None: exact)."""
    if tuple(sent.shape) != tuple(own.shape) or (bound is not None and tuple(bound.shape) != tuple(own.shape)):
        raise ValueError(f"compared tensors differ in shape: sent {tuple(sent.shape)}, own {tuple(own.shape)}"
                         + ("" if bound is None else f", bound {tuple(bound.shape)}"))
    if not all_finite(sent):
        return RecomputeCheck(math.inf, math.inf, 0)  # a NaN where a value was due: caught
    if own.numel() == 0:
        return RecomputeCheck(0.0, 0.0, 0)
    width = own.shape[-1] if own.dim() else 1
    a = sent.detach().to("cpu", torch.float64).reshape(-1, width)
    v = own.detach().to("cpu", torch.float64).reshape(-1, width)
    beta = None if bound is None else bound.detach().to("cpu", torch.float64).reshape(-1, width)
    deviation = torch.linalg.vector_norm(a - v, dim=1)
    norms = torch.linalg.vector_norm(v, dim=1)
    typical = float(norms.square().mean().sqrt())
    allowed = allowance.row * torch.clamp(norms, min=typical)
    if beta is not None:
        allowed = allowed + torch.linalg.vector_norm(beta, dim=1)
    ratios = _ratios(deviation, allowed)
    row = int(ratios.argmax())
    whole_allowed = allowance.whole * float(torch.linalg.vector_norm(v)) + (
        float(torch.linalg.vector_norm(beta)) if beta is not None else 0.0)
    whole = float(_ratios(torch.linalg.vector_norm(a - v).reshape(1), torch.tensor([whole_allowed]))[0])
    return RecomputeCheck(float(ratios[row]), whole, row)


def _ratios(deviation: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """deviation / allowed, with 0/0 = 0 and x/0 = inf."""
    safe = torch.where(allowed > 0, allowed, torch.ones_like(allowed))
    return torch.where(allowed > 0, deviation / safe, torch.where(deviation > 0, math.inf, 0.0))


def check_message(codec: Codec, message: torch.Tensor, own: torch.Tensor, allowance: Allowance) -> RecomputeCheck:
    """Compare a member's ``message`` (of ``codec``) with the verifier's own value ``own``. A message that
    does not decode, or decodes to non-finite values, or no honest encoder makes, is a ValueError."""
    bound = error_bound(codec, message, tuple(own.shape))
    sent = codec.decode(message, tuple(own.shape))
    return compare_rows(sent, own, None if codec.exact else bound, allowance)


def check_sketch(sent: torch.Tensor, own: torch.Tensor, allowance: Allowance) -> RecomputeCheck:
    """Compare a member's sketch of its parameter gradients with the verifier's (same seed): caught when
    ``‖sent − own‖ > allowance.whole · ‖own‖``. A sketch is linear, so the gradients of several micro-batches
    (a whole step) compare by their summed sketches; the allowance is measured in sketch space."""
    if sent.dim() != 1 or tuple(sent.shape) != tuple(own.shape):
        raise ValueError(f"sketches differ in shape: sent {tuple(sent.shape)}, own {tuple(own.shape)}")
    if not all_finite(sent):
        return RecomputeCheck(0.0, math.inf, 0)
    deviation = torch.linalg.vector_norm(sent.double() - own.double()).reshape(1)
    allowed = torch.tensor([allowance.whole * float(torch.linalg.vector_norm(own.double()))])
    return RecomputeCheck(0.0, float(_ratios(deviation, allowed)[0]), 0)


def allowance(precision: str, quantity: str) -> Allowance:
    """``FLOAT_ALLOWANCE`` for a run's ``precision`` (``fp32``, ``bf16``) and a quantity of ``QUANTITIES``."""
    key = (precision, quantity)
    if key not in FLOAT_ALLOWANCE:
        raise ValueError(f"no floating-point allowance for {precision} {quantity} "
                         f"(precisions fp32, bf16; quantities {', '.join(QUANTITIES)})")
    return FLOAT_ALLOWANCE[key]

