"""A GPT you can read top to bottom: token + position embeddings, pre-LayerNorm blocks, final LayerNorm, head.

One class serves both as the full model and as a pipeline stage. ``GPT(shape)`` holds every layer;
``GPT(shape, layers=range(3, 6))`` holds blocks 3, 4 and 5 only, plus the embeddings if the range starts at
layer 0 and the final LayerNorm and LM head if it ends at the last layer. Blocks live in a ``ModuleDict``
keyed by their global index, so a stage's parameter names are the full model's names
(``blocks.3.attn.qkv.weight``): a slice of the full state dict loads into the stage, and back.

What ``forward`` takes and returns depends on what the module holds:

===============  =========================  =============================
module holds     input                      output
===============  =========================  =============================
embeddings       token ids ``[B, T]`` long  (continues below)
no embeddings    hidden ``[B, T, d]``       (continues below)
head             (after the blocks)         logits ``[B, T, vocab]``
no head          (after the blocks)         hidden ``[B, T, d]``
===============  =========================  =============================

No dropout: training is exact (DESIGN.md, "Exactness"). The LM head is not tied to the token embedding,
because they sit on different stages; tying them would need an extra gradient exchange every step.

``precision`` (bf16, fp16) runs the module's compute under autocast, fp32 parameters kept, and hands
fp32 hidden states on (``p2ptrain.model.precision``); ``checkpointing`` recomputes each block's activations
in the backward pass instead of keeping them.

The model is GPT-2's (``p2ptrain.export`` writes it as a ``GPT2LMHeadModel``): pre-LayerNorm with eps
1e-5, biases everywhere but the head, exact (erf) GELU, learned positions, an untied head.

Parameters are created on the ``meta`` device and then filled by ``p2ptrain.model.init.init_parameters``,
which draws each one from ``(seed, its name)``: a stage built alone gets exactly the numbers of the full
model's slice, and nothing touches the global RNG.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from p2ptrain.model.init import init_parameters
from p2ptrain.model.precision import LossScaler, autocast, scale_gradient
from p2ptrain.planning.model_shapes import ModelShape


class CausalSelfAttention(nn.Module):
    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        self.num_heads = shape.num_heads
        self.qkv = nn.Linear(shape.hidden_size, 3 * shape.hidden_size)
        self.proj = nn.Linear(shape.hidden_size, shape.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=2)
        # [B, T, d] -> [B, heads, T, d/heads]
        head_size = width // self.num_heads
        q, k, v = (t.view(batch, seq, self.num_heads, head_size).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, seq, width))


class MLP(nn.Module):
    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        self.fc = nn.Linear(shape.hidden_size, 4 * shape.hidden_size)
        self.proj = nn.Linear(4 * shape.hidden_size, shape.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln1(x)), then x + mlp(ln2(x))."""

    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(shape.hidden_size)
        self.attn = CausalSelfAttention(shape)
        self.ln2 = nn.LayerNorm(shape.hidden_size)
        self.mlp = MLP(shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """The full model, or the part of it that holds ``layers`` (a contiguous range of block indices).

    Parameters are drawn from ``(seed, name)`` on creation (``p2ptrain.model.init``), on ``device``; on
    the ``meta`` device nothing is allocated.
    """

    def __init__(
        self,
        shape: ModelShape,
        layers: range | None = None,
        *,
        seed: int = 0,
        device: torch.device | str = "cpu",
        precision: str = "fp32",
        checkpointing: bool = False,
    ) -> None:
        super().__init__()
        autocast(precision, torch.device(device))  # a ValueError for an unknown precision
        self.precision = precision
        self.checkpointing = checkpointing
        self.loss_scaler = LossScaler() if precision == "fp16" else None  # read by build_optimizer
        layers = range(shape.num_layers) if layers is None else layers
        if layers.step != 1 or len(layers) == 0 or layers.start < 0 or layers.stop > shape.num_layers:
            raise ValueError(
                f"layers must be a non-empty contiguous part of range({shape.num_layers}), got {layers}"
            )
        self.shape = shape
        self.layers = layers
        self.has_embeddings = layers.start == 0
        self.has_head = layers.stop == shape.num_layers
        with torch.device("meta"):  # no memory and no global RNG yet; init_parameters fills them below
            if self.has_embeddings:
                self.tok_emb = nn.Embedding(shape.vocab_size, shape.hidden_size)
                self.pos_emb = nn.Embedding(shape.seq_len, shape.hidden_size)
            self.blocks = nn.ModuleDict({str(i): Block(shape) for i in layers})
            if self.has_head:
                self.ln_f = nn.LayerNorm(shape.hidden_size)
                self.head = nn.Linear(shape.hidden_size, shape.vocab_size, bias=False)
        if torch.device(device).type != "meta":  # on "meta" the model stays shapes only (planning, counts)
            self.to_empty(device=device)
            init_parameters(self, seed, shape.num_layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scaler = self.loss_scaler if torch.is_grad_enabled() else None
        if scaler is not None and not self.has_embeddings:
            x = scale_gradient(x, 1.0 / scaler.scale)  # the gradient we send back is the true one
        with autocast(self.precision, x.device):
            if self.has_embeddings:
                seq = x.shape[1]
                if seq > self.shape.seq_len:
                    raise ValueError(f"sequence of {seq} tokens is longer than the model's {self.shape.seq_len}")
                positions = torch.arange(seq, device=x.device)
                x = self.tok_emb(x) + self.pos_emb(positions)
            for block in self.blocks.values():
                if self.checkpointing and torch.is_grad_enabled():
                    x = checkpoint(block, x, use_reentrant=False)
                else:
                    x = block(x)
            if self.has_head:
                x = self.head(self.ln_f(x))
        x = x.float()  # hidden states travel, and logits reach the loss, in fp32 whatever the precision
        if scaler is not None:
            x = scale_gradient(x, scaler.scale)  # our parameters' gradients come out scale times larger
        return x

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())
