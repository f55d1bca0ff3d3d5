"""A residual stream in a fixed k-dimensional subspace: stage boundaries carry k values a token instead of d,
forward and back, exactly.

With ``shape.subspace`` k > 0, the model's residual stream at every layer is

    x = x0(tokens) + c · Pᵀ        x0 = T[token] (+ Q[position] for gpt), fixed;  P: [d, k], fixed;  c: [·, k]

and every module that writes into the residual stream writes k coefficients: the token (and position)
embeddings' learned parts are ``[vocab, k]`` (``[seq, k]``), and ``attn.proj`` and ``mlp.proj`` map to k values
instead of d. Each block reads ``x`` (its norms see the whole width) and adds to ``c``. So ``c`` is all a stage
hands the next one, and the gradient of the loss with respect to ``c`` (``Pᵀ · ∂L/∂x``, k values) is all the
next stage hands back: a d/k-fold smaller boundary with no approximation, the idea of Pluralis' subspace
networks (Ramasinghe et al. 2025), built here as a reparameterisation so that nothing is projected after an
optimizer step. Every stage lifts ``c`` to ``x`` itself, from the token ids it derives from the step like
every peer does; the model is a function of ``c`` alone, so any split of it into stages computes exactly what
one process computes.

The fixed parts (``P``, ``T``, ``Q``) are drawn from this module's own seed and the shape, never from the
run's seed or its data: every stage, every peer and the export derive them alone, and they are never sent or
checkpointed. ``P``'s entries are N(0, 1/k) (a lift keeps a coefficient's variance per dimension), ``T`` and
``Q`` are N(0, 0.02) like the unconstrained model's initial embeddings.

The constraint is absorbed into ordinary weights for the export (``absorb``): the embedding is ``T + E·Pᵀ``,
a projection's weight ``P·W`` and its bias ``P·b``; the result is the unconstrained model of the same
function, which transformers loads as GPT-2 or Llama.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch
from torch import nn

from p2ptrain.model.init import parameter_seed
from p2ptrain.planning.model_shapes import ModelShape

SEED = 0x5B5  # the fixed parts' own seed (module docstring)
EMBEDDING_STD = 0.02
PROJECTIONS = (".attn.proj.", ".mlp.proj.")


def _normal(name: str, size: tuple[int, ...], std: float) -> torch.Tensor:
    generator = torch.Generator().manual_seed(parameter_seed(SEED, name))
    return torch.empty(size).normal_(0.0, std, generator=generator)


def fixed_parts(shape: ModelShape) -> dict[str, torch.Tensor]:
    """The fixed tensors of ``shape`` on the CPU, float32: ``basis`` P ``[d, k]``, ``token`` T ``[vocab, d]``
    and, for gpt, ``position`` Q ``[seq, d]``."""
    d, k = shape.hidden_size, shape.subspace
    if k <= 0:
        raise ValueError("fixed_parts: the shape has no subspace")
    parts = {
        "basis": _normal(f"basis/{d}/{k}", (d, k), k ** -0.5),
        "token": _normal(f"token/{shape.vocab_size}/{d}", (shape.vocab_size, d), EMBEDDING_STD),
    }
    if shape.family == "gpt":
        parts["position"] = _normal(f"position/{shape.seq_len}/{d}", (shape.seq_len, d), EMBEDDING_STD)
    return parts


class Subspace(nn.Module):
    """The fixed parts as buffers (not in the state dict), and the lift from coefficients to the stream."""

    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        self.family = shape.family
        d, k = shape.hidden_size, shape.subspace
        self.register_buffer("basis", torch.empty(d, k), persistent=False)
        self.register_buffer("token", torch.empty(shape.vocab_size, d), persistent=False)
        if shape.family == "gpt":
            self.register_buffer("position", torch.empty(shape.seq_len, d), persistent=False)

    @torch.no_grad()
    def fill(self, shape: ModelShape) -> None:
        """Draw the fixed parts into the buffers (after ``to_empty``), on the buffers' device."""
        for name, value in fixed_parts(shape).items():
            getattr(self, name).copy_(value)

    def base(self, tokens: torch.Tensor) -> torch.Tensor:
        """x0: the fixed embedding of ``tokens`` ``[B, T]``, ``[B, T, d]``."""
        x0 = self.token[tokens]
        if self.family == "gpt":
            x0 = x0 + self.position[: tokens.shape[1]]
        return x0

    def lift(self, c: torch.Tensor, x0: torch.Tensor) -> torch.Tensor:
        """The residual stream ``x0 + c · Pᵀ`` of coefficients ``c`` ``[B, T, k]``."""
        return x0 + c @ self.basis.to(c.dtype).T


def absorb(state: Mapping[str, torch.Tensor], shape: ModelShape) -> tuple[dict[str, torch.Tensor], ModelShape]:
    """The full model's state dict and shape without the subspace, computing the same function (module
    docstring): what the export writes."""
    parts = fixed_parts(shape)
    basis = parts["basis"]
    out: dict[str, torch.Tensor] = {}
    for name, value in state.items():
        value = value.detach().to("cpu", torch.float32)
        if name == "tok_emb.weight":
            value = parts["token"] + value @ basis.T
        elif name == "pos_emb.weight":
            value = parts["position"] + value @ basis.T
        elif any(p in name for p in PROJECTIONS):
            value = basis @ value  # weight [k, n] -> [d, n]; bias [k] -> [d]
        out[name] = value
    return out, dataclasses.replace(shape, subspace=0)
