"""Each model preset's optimizer recipe: what a run of it uses where ``[optimizer]`` and the flags say nothing.

Every recipe is AdamW with decoupled weight decay on matrices and embeddings, a linear warm-up, a cosine
decay to a tenth of the peak and clipping at global norm 1.0 — the recipe of GPT-3 (Brown et al. 2020,
appendix B) and LLaMA (Touvron et al. 2023, §2.2), which every open run since trains with. The peak rate
and Adam's ε are the reference's for the size:

=============  =========  ======  ==========================================================================
preset         peak lr    Adam ε  source
=============  =========  ======  ==========================================================================
tiny, small    2e-3       1e-8    none (CPU demos): the rate p2ptrain's tests and demos were tuned at
llama-tiny     2e-3       1e-8    the same, for the LLaMA-style block
gpt2           6e-4       1e-8    GPT-3 Small (125 M), GPT-3 paper table 2.1
gpt3-xl        2e-4       1e-8    GPT-3 XL (1.3 B), GPT-3 paper table 2.1
llama-125m     6e-4       1e-5    GPT-3 Small's rate with LLaMA's ε
llama-1b       4e-4       1e-5    TinyLlama 1.1B (Zhang et al. 2024)
=============  =========  ======  ==========================================================================

Warm-up is a share of the run (``warmup_fraction``) with a floor (``warmup_floor_steps``): the references
warmed up over 375 M tokens (GPT-3: 750 updates of GPT-3 Small's 0.5 M-token batch, 375 of GPT-3 XL's 1 M)
or 2000 updates (LLaMA, TinyLlama), well under 1 % of runs far longer than any run here. A long run warms up
over 1 %, at least the reference's updates; a run too short for those warms up over at most a tenth of itself
(``SHORT_RUN_WARMUP``): 5 updates of a 50-update run, where 1 % rounds to none and the first full-rate updates
of a large preset blow its loss up (``benchmarks/large_presets.py``: ``gpt3-xl`` from 11.4 to 18.1). The toy
presets, run for tens of steps, warm up over 10 % with no floor. An explicit ``warmup_steps`` or ``min_lr``
replaces the share.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Recipe:
    """The values ``OptimizerConfig`` takes for a preset where nothing else is said."""

    lr: float
    eps: float = 1e-8
    beta1: float = 0.9
    beta2: float = 0.95
    weight_decay: float = 0.1
    lr_schedule: str = "cosine"
    warmup_fraction: float = 0.01
    warmup_floor_steps: int = 0  # the reference's warm-up in updates (a short run: at most SHORT_RUN_WARMUP of it)
    min_lr_ratio: float = 0.1
    decay_fraction: float = 0.2
    clip: float = 1.0

    def fields(self) -> dict[str, object]:
        return asdict(self)


SHORT_RUN_WARMUP = 0.1  # a run shorter than its preset's warm-up floor warms up over at most this share of it
_TOY = Recipe(lr=2e-3, warmup_fraction=0.1)

RECIPES: dict[str, Recipe] = {
    "tiny": _TOY,
    "small": _TOY,
    "llama-tiny": _TOY,
    "gpt2": Recipe(lr=6e-4, warmup_floor_steps=750),
    "gpt3-xl": Recipe(lr=2e-4, warmup_floor_steps=375),
    "llama-125m": Recipe(lr=6e-4, eps=1e-5, warmup_floor_steps=2000),
    "llama-1b": Recipe(lr=4e-4, eps=1e-5, warmup_floor_steps=2000),
}


def recipe(model: str) -> Recipe:
    """The preset ``model``'s recipe (a ValueError naming the presets that have one)."""
    try:
        return RECIPES[model]
    except KeyError:
        raise ValueError(f"no optimizer recipe for model {model!r} (known: {', '.join(RECIPES)})") from None


def described(model: str) -> str:
    """One line for ``--help``: ``tiny: lr 2e-3, 10% warm-up, cosine to 10%, clip 1.0``."""
    r = recipe(model)
    floor = f" (at least {r.warmup_floor_steps} updates, {SHORT_RUN_WARMUP:.0%} of a shorter run)" if r.warmup_floor_steps else ""
    return (f"{model}: lr {r.lr:g}, {r.warmup_fraction:.0%} warm-up{floor}, {r.lr_schedule} to {r.min_lr_ratio:.0%}, "
            f"clip {r.clip:g}, betas {r.beta1:g}/{r.beta2:g}, eps {r.eps:g}, wd {r.weight_decay:g}")
