"""A decoder-only transformer you can read top to bottom: embeddings, pre-norm blocks, final norm, head.

One class serves both as the full model and as a pipeline stage. ``GPT(shape)`` holds every layer;
``GPT(shape, layers=range(3, 6))`` holds blocks 3, 4 and 5 only, plus the embeddings if the range starts at
layer 0 and the final norm and LM head if it ends at the last layer. Blocks live in a ``ModuleDict``
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

With a subspace (``shape.subspace`` k, ``p2ptrain.model.subspace``) "hidden" is the stream's k coefficients
``[B, T, k]``, and a module without the embeddings also takes the micro-batch's token ids (``forward(x, tokens)``)
to lift them.

No dropout: training is exact (docs/design.md, "Exactness"). The LM head is not tied to the token embedding,
because they sit on different stages; tying them would need an extra gradient exchange every step.

``precision`` (bf16, fp16) runs the module's compute under autocast, fp32 parameters kept, and hands
fp32 hidden states on (``p2ptrain.model.precision``); ``checkpointing`` recomputes each block's activations
in the backward pass instead of keeping them; ``compile`` runs each block compiled (``p2ptrain.model.compiled``).

The block follows ``shape.family`` (``p2ptrain.planning.model_shapes``), under the same parameter names:

- ``gpt`` is GPT-2's (``p2ptrain.export`` writes it as a ``GPT2LMHeadModel``): ``tok_emb`` + ``pos_emb``
  (learned positions), LayerNorms ``ln1``/``ln2``/``ln_f``, biases everywhere but the head, an MLP ``fc`` →
  GELU (exact, or tanh-approximated with ``gelu_new``) → ``proj``.
- ``llama`` is LLaMA's (exported as a ``LlamaForCausalLM``): ``tok_emb`` only, RMSNorms ``ln1``/``ln2``/``ln_f``,
  no biases, rotary positions on q and k (Hugging Face's convention: each head's first half rotates with
  its second half), grouped-query attention (each key/value head serves ``num_heads / num_kv_heads``
  consecutive query heads), a SwiGLU MLP ``proj(silu(gate(x)) · up(x))``.

In both, ``attn.qkv`` is one projection to q, k and v in that order, and ``attn.proj``/``mlp.proj`` are the
two projections that write into the residual stream.

Parameters are created on the ``meta`` device and then filled by ``p2ptrain.model.init.init_parameters``,
which draws each one from ``(seed, its name)``: a stage built alone gets exactly the numbers of the full
model's slice, and nothing touches the global RNG.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from p2ptrain.model.compiled import compile_blocks
from p2ptrain.model.init import init_parameters
from p2ptrain.model.precision import LossScaler, autocast, scale_gradient
from p2ptrain.model.subspace import Subspace
from p2ptrain.planning.model_shapes import ModelShape

Rotary = tuple[torch.Tensor, torch.Tensor]  # cos and sin, [T, head_size] each


def rotary_tables(seq: int, head_size: int, theta: float, device: torch.device) -> Rotary:
    """cos and sin of rotary positions 0..seq-1, in fp32, as Hugging Face's Llama computes them: frequency
    1/theta^(2i/head_size) for i < head_size/2, repeated over the head's two halves."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_size, 2, dtype=torch.float32) / head_size))
    freqs = torch.arange(seq, dtype=torch.float32)[:, None] * inv_freq[None, :]
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos().to(device), angles.sin().to(device)


def rotate(x: torch.Tensor, rope: Rotary) -> torch.Tensor:
    """``x`` ``[B, heads, T, head_size]`` rotated by position: x·cos + rotate_half(x)·sin."""
    cos, sin = (t.to(x.dtype) for t in rope)
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-second, first), dim=-1) * sin


class CausalSelfAttention(nn.Module):
    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        bias = shape.family == "gpt"
        self.num_heads, self.num_kv_heads, self.head_size = shape.num_heads, shape.num_kv_heads, shape.head_size
        self.qkv = nn.Linear(shape.hidden_size, shape.hidden_size + 2 * shape.kv_size, bias=bias)
        self.proj = nn.Linear(shape.hidden_size, shape.boundary_width, bias=bias)  # k with a subspace

    def forward(self, x: torch.Tensor, rope: Rotary | None) -> torch.Tensor:
        batch, seq, width = x.shape
        kv = self.num_kv_heads * self.head_size
        q, k, v = self.qkv(x).split((width, kv, kv), dim=2)
        # [B, T, heads · head_size] -> [B, heads, T, head_size]
        q = q.view(batch, seq, self.num_heads, self.head_size).transpose(1, 2)
        k, v = (t.view(batch, seq, self.num_kv_heads, self.head_size).transpose(1, 2) for t in (k, v))
        if rope is not None:
            q, k = rotate(q, rope), rotate(k, rope)
        # GQA: kv head j serves query heads j·g .. j·g + g - 1. On an accelerator through SDPA's own path (no
        # repeated k and v in memory); on the CPU, where that saves nothing, k and v repeated as transformers'
        # LLaMA does, which keeps our backward bit for bit theirs (its key/value gradients sum in another order)
        gqa = self.num_kv_heads != self.num_heads
        if gqa and q.device.type == "cpu":
            groups = self.num_heads // self.num_kv_heads
            k, v, gqa = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1), False
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        return self.proj(y.transpose(1, 2).reshape(batch, seq, width))


class MLP(nn.Module):
    """GPT-2's: h -> ffn -> h with GELU (exact, or its tanh approximation for ``gelu_new``)."""

    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        self.approximate = "tanh" if shape.activation == "gelu_new" else "none"
        self.fc = nn.Linear(shape.hidden_size, shape.ffn_hidden_size)
        self.proj = nn.Linear(shape.ffn_hidden_size, shape.boundary_width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate=self.approximate))


class SwiGLU(nn.Module):
    """LLaMA's: proj(silu(gate(x)) · up(x)), no biases."""

    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        self.gate = nn.Linear(shape.hidden_size, shape.ffn_hidden_size, bias=False)
        self.up = nn.Linear(shape.hidden_size, shape.ffn_hidden_size, bias=False)
        self.proj = nn.Linear(shape.ffn_hidden_size, shape.boundary_width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.silu(self.gate(x)) * self.up(x))


def norm(shape: ModelShape) -> nn.Module:
    """The family's normalisation: LayerNorm (gpt) or RMSNorm (llama), with ``shape.norm_eps``."""
    if shape.family == "llama":
        return nn.RMSNorm(shape.hidden_size, eps=shape.norm_eps)
    return nn.LayerNorm(shape.hidden_size, eps=shape.norm_eps)


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln1(x)), then x + mlp(ln2(x))."""

    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        self.ln1 = norm(shape)
        self.attn = CausalSelfAttention(shape)
        self.ln2 = norm(shape)
        self.mlp = SwiGLU(shape) if shape.family == "llama" else MLP(shape)

    def forward(self, x: torch.Tensor, rope: Rotary | None = None, lift: Callable | None = None) -> torch.Tensor:
        if lift is not None:  # x holds the subspace's coefficients; the norms read the stream they lift to
            x = x + self.attn(self.ln1(lift(x)), rope)
            return x + self.mlp(self.ln2(lift(x)))
        x = x + self.attn(self.ln1(x), rope)
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
        compile: bool = False,
    ) -> None:
        super().__init__()
        autocast(precision, torch.device(device))  # a ValueError for an unknown precision
        self.precision = precision
        self.checkpointing = checkpointing
        self.compiled = compile
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
            if self.has_embeddings:  # with a subspace, the learned parts (model.subspace)
                self.tok_emb = nn.Embedding(shape.vocab_size, shape.boundary_width)
                if shape.family == "gpt":  # llama's positions are rotary, in the attention
                    self.pos_emb = nn.Embedding(shape.seq_len, shape.boundary_width)
            self.subspace = Subspace(shape) if shape.subspace else None
            self.blocks = nn.ModuleDict({str(i): Block(shape) for i in layers})
            if self.has_head:
                self.ln_f = norm(shape)
                self.head = nn.Linear(shape.hidden_size, shape.vocab_size, bias=False)
        if torch.device(device).type != "meta":  # on "meta" the model stays shapes only (planning, counts)
            self.to_empty(device=device)
            init_parameters(self, seed, shape.num_layers)
            if self.subspace is not None:
                self.subspace.fill(shape)
        if compile:
            compile_blocks(self.blocks)  # lazily: nothing compiles before the first forward

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        if getattr(self, "compiled", False):  # torch drops a copied block's compiled forward: this copy's blocks compile again
            compile_blocks(self.blocks)

    def forward(self, x: torch.Tensor, tokens: torch.Tensor | None = None) -> torch.Tensor:
        """``x`` as the module docstring's table says; ``tokens``, the micro-batch's token ids ``[B, T]``, is what a
        stage without the embeddings of a subspace model also needs (``model.subspace``), ignored otherwise."""
        scaler = self.loss_scaler if torch.is_grad_enabled() else None
        if scaler is not None and not self.has_embeddings:
            x = scale_gradient(x, 1.0 / scaler.scale)  # the gradient we send back is the true one
        seq = x.shape[1]
        if seq > self.shape.seq_len:
            raise ValueError(f"sequence of {seq} tokens is longer than the model's {self.shape.seq_len}")
        rope = None
        if self.shape.family == "llama":
            rope = rotary_tables(seq, self.shape.head_size, self.shape.rope_theta, x.device)
        lift = self._lift(x, tokens) if self.subspace is not None else None
        with autocast(self.precision, x.device):
            if self.has_embeddings:
                x = self.tok_emb(x)
                if self.shape.family == "gpt":
                    x = x + self.pos_emb(torch.arange(seq, device=x.device))
            for block in self.blocks.values():
                if self.checkpointing and torch.is_grad_enabled():
                    x = checkpoint(block, x, rope, lift, use_reentrant=False)
                else:
                    x = block(x, rope, lift)
            if self.has_head:
                x = self.head(self.ln_f(x if lift is None else lift(x)))
        x = x.float()  # hidden states travel, and logits reach the loss, in fp32 whatever the precision
        if scaler is not None:
            x = scale_gradient(x, scaler.scale)  # our parameters' gradients come out scale times larger
        return x

    def materialize(self, device: torch.device | str) -> GPT:
        """This model, built on ``meta``, made real on ``device`` with uninitialised parameters (load a state dict
        next) and a subspace's fixed parts drawn (they are in no state dict)."""
        self.to_empty(device=device)
        if self.subspace is not None:
            self.subspace.fill(self.shape)
        return self

    def _lift(self, x: torch.Tensor, tokens: torch.Tensor | None) -> Callable:
        if self.has_embeddings:
            tokens = x
        elif tokens is None:
            raise ValueError("a stage of a subspace model without the embeddings takes the token ids beside its input")
        if tokens.shape != x.shape[:2]:
            raise ValueError(f"token ids {tuple(tokens.shape)} do not match the input {tuple(x.shape)}")
        return functools.partial(self.subspace.lift, x0=self.subspace.base(tokens.to(x.device)))

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())
