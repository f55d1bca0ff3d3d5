"""Model shapes by preset name: the one place the GPT presets' dimensions are spelled.

Pure data (no torch): the planner derives communication volumes from a shape, and ``p2ptrain.model``
builds the network from the same shape, so a preset means the same thing to both.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelShape:
    """Dimensions of a GPT: pre-LayerNorm blocks, learned positions, untied LM head."""

    num_layers: int
    hidden_size: int
    num_heads: int
    seq_len: int
    vocab_size: int = 256  # byte-level tokens

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_heads", "seq_len", "vocab_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"model shape: {name} must be positive, got {getattr(self, name)}")
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"model shape: hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}"
            )


MODEL_PRESETS: dict[str, ModelShape] = {
    # CPU tests: 8 layers so that 8 stages fit, byte vocabulary, small width.
    "tiny": ModelShape(num_layers=8, hidden_size=64, num_heads=4, seq_len=64, vocab_size=256),
    # CPU demos and benchmarks.
    "small": ModelShape(num_layers=12, hidden_size=256, num_heads=8, seq_len=128, vocab_size=256),
    # The paper's GPT-3 XL (~1.3e9 parameters with a GPT-2 vocabulary): planning figures and GPU runs.
    "gpt3-xl": ModelShape(num_layers=24, hidden_size=2048, num_heads=16, seq_len=2048, vocab_size=50257),
}


def model_shape(name: str) -> ModelShape:
    """The preset called ``name``; a ValueError listing the presets otherwise."""
    try:
        return MODEL_PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r} (choose from {', '.join(MODEL_PRESETS)})") from None
