"""Model shapes by preset name: the one place the presets' dimensions are spelled.

Pure data (no torch): the planner derives communication volumes from a shape, and ``p2ptrain.model``
builds the network from the same shape, so a preset means the same thing to both.

Two block families (``family``):

- ``gpt``: GPT-2's block. Pre-LayerNorm, learned positions, biases on every linear layer but the head, an
  MLP h → ffn → h with GELU: ``activation`` ``gelu`` (exact, erf; the default) or ``gelu_new`` (the tanh
  approximation real GPT-2 checkpoints use).
- ``llama``: LLaMA's block. Pre-RMSNorm, rotary positions (``rope_theta``), no biases, a SwiGLU MLP
  (``silu(gate(x)) · up(x)``, then down) and grouped-query attention when ``num_kv_heads`` < ``num_heads``.

Fields left at their zero defaults are resolved on construction: ``activation`` to the family's
(``gelu``, ``silu``), ``num_kv_heads`` to ``num_heads``, ``ffn_hidden_size`` to 4h for ``gpt`` and to
LLaMA's rule for ``llama``: 2/3 of 4h (SwiGLU has three matrices instead of two, so this keeps the MLP's
parameters at 8h²), rounded up to a multiple of 64.

``subspace`` k > 0 constrains the residual stream to a fixed k-dimensional subspace beside fixed token (and
position) embeddings (``p2ptrain.model.subspace``): a stage boundary then carries k values a token instead of
``hidden_size``, both ways (``boundary_width``). 0, the default, is the unconstrained model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

FAMILIES = ("gpt", "llama")
ACTIVATIONS = {"gpt": ("gelu", "gelu_new"), "llama": ("silu",)}
FFN_MULTIPLE = 64  # the llama rule rounds the MLP's width up to this


def llama_ffn_hidden_size(hidden_size: int) -> int:
    """LLaMA's SwiGLU width for ``hidden_size``: ⌈(2/3 · 4h) / 64⌉ · 64."""
    return math.ceil(8 * hidden_size / 3 / FFN_MULTIPLE) * FFN_MULTIPLE


@dataclass(frozen=True)
class ModelShape:
    """Dimensions and block family of a decoder-only transformer with an untied LM head (module docstring)."""

    num_layers: int
    hidden_size: int
    num_heads: int
    seq_len: int
    vocab_size: int = 256  # byte-level tokens
    family: str = "gpt"  # "gpt" (GPT-2 blocks) or "llama" (LLaMA blocks)
    activation: str = ""  # "": the family's (gpt: "gelu", llama: "silu"); gpt may use "gelu_new"
    num_kv_heads: int = 0  # 0: num_heads; llama may share each key/value head among several query heads
    ffn_hidden_size: int = 0  # 0: gpt 4h, llama llama_ffn_hidden_size(h)
    rope_theta: float = 10000.0  # llama: the rotary base
    norm_eps: float = 1e-5  # LayerNorm's / RMSNorm's epsilon
    subspace: int = 0  # k > 0: the residual stream in a fixed k-dimensional subspace (module docstring)

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_heads", "seq_len", "vocab_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"model shape: {name} must be positive, got {getattr(self, name)}")
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"model shape: hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}"
            )
        if self.family not in FAMILIES:
            raise ValueError(f"model shape: unknown family {self.family!r} (choose from {', '.join(FAMILIES)})")
        allowed = ACTIVATIONS[self.family]
        if self.activation == "":
            object.__setattr__(self, "activation", allowed[0])
        elif self.activation not in allowed:
            raise ValueError(f"model shape: family {self.family} takes activation {' or '.join(allowed)}, "
                             f"got {self.activation!r}")
        if self.num_kv_heads == 0:
            object.__setattr__(self, "num_kv_heads", self.num_heads)
        if self.num_kv_heads < 0 or self.num_heads % self.num_kv_heads:
            raise ValueError(f"model shape: num_kv_heads {self.num_kv_heads} must divide num_heads {self.num_heads}")
        if self.family == "gpt" and self.num_kv_heads != self.num_heads:
            raise ValueError("model shape: grouped-query attention (num_kv_heads < num_heads) needs family llama")
        if self.ffn_hidden_size == 0:
            ffn = 4 * self.hidden_size if self.family == "gpt" else llama_ffn_hidden_size(self.hidden_size)
            object.__setattr__(self, "ffn_hidden_size", ffn)
        if self.ffn_hidden_size < 0:
            raise ValueError(f"model shape: ffn_hidden_size must be positive, got {self.ffn_hidden_size}")
        if self.family == "llama" and self.head_size % 2:
            raise ValueError(f"model shape: rotary positions need an even head size, got {self.head_size}")
        if isinstance(self.subspace, bool) or not isinstance(self.subspace, int) or not (
                0 <= self.subspace < self.hidden_size):
            raise ValueError(f"model shape: subspace must be 0 (off) or a rank below hidden_size {self.hidden_size}, "
                             f"got {self.subspace!r}")
        for name in ("rope_theta", "norm_eps"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise ValueError(f"model shape: {name} must be a positive number, got {value!r}")

    @property
    def head_size(self) -> int:
        """Width of one attention head."""
        return self.hidden_size // self.num_heads

    @property
    def boundary_width(self) -> int:
        """Values a token carries across a stage boundary (forward and back): ``subspace`` or ``hidden_size``."""
        return self.subspace or self.hidden_size

    @property
    def kv_size(self) -> int:
        """Width of the keys (and of the values) over all key/value heads: hidden_size without GQA."""
        return self.num_kv_heads * self.head_size


MODEL_PRESETS: dict[str, ModelShape] = {
    # CPU tests: 8 layers so that 8 stages fit, byte vocabulary, small width.
    "tiny": ModelShape(num_layers=8, hidden_size=64, num_heads=4, seq_len=64, vocab_size=256),
    # CPU demos and benchmarks.
    "small": ModelShape(num_layers=12, hidden_size=256, num_heads=8, seq_len=128, vocab_size=256),
    # The paper's GPT-3 XL (~1.3e9 parameters with a GPT-2 vocabulary): planning figures and GPU runs.
    "gpt3-xl": ModelShape(num_layers=24, hidden_size=2048, num_heads=16, seq_len=2048, vocab_size=50257),
    # GPT-2 124M (Radford et al. 2019; Hugging Face "gpt2"'s config.json): 124M with the tied head,
    # 163M here (the head is untied); tanh-approximated GELU as the released weights were trained with.
    "gpt2": ModelShape(num_layers=12, hidden_size=768, num_heads=12, seq_len=1024, vocab_size=50257,
                       activation="gelu_new"),
    # CPU tests of the llama family: tiny's sizes, 2 key/value heads so grouped-query attention runs,
    # the MLP at LLaMA's rule (192 = ⌈2/3 · 4 · 64 / 64⌉ · 64).
    "llama-tiny": ModelShape(num_layers=8, hidden_size=64, num_heads=4, seq_len=64, vocab_size=256,
                             family="llama", num_kv_heads=2, ffn_hidden_size=192),
    # GPT-3 Small's depth and width (Brown et al. 2020, table 2.1: 12 layers, 768, 12 heads) in LLaMA's
    # block with LLaMA's 32000-token vocabulary and 2048 context (Touvron et al. 2023); MLP 2/3 · 4h = 2048.
    "llama-125m": ModelShape(num_layers=12, hidden_size=768, num_heads=12, seq_len=2048, vocab_size=32000,
                             family="llama", ffn_hidden_size=2048),
    # TinyLlama-1.1B (Zhang et al. 2024; TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T's config.json):
    # 22 layers, 2048 wide, 32 heads sharing 4 key/value heads, MLP 5632, rms_norm_eps 1e-5, rope_theta 1e4.
    "llama-1b": ModelShape(num_layers=22, hidden_size=2048, num_heads=32, seq_len=2048, vocab_size=32000,
                           family="llama", num_kv_heads=4, ffn_hidden_size=5632),
}


def model_shape(name: str) -> ModelShape:
    """The preset called ``name``; a ValueError listing the presets otherwise."""
    try:
        return MODEL_PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r} (choose from {', '.join(MODEL_PRESETS)})") from None
