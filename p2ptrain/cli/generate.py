"""``p2ptrain generate CHECKPOINT --prompt TEXT``: a quick sample from a trained model.

    p2ptrain generate ckpt/ --data data/corpus --prompt "The river" --tokens 100

CHECKPOINT is a checkpoint folder (or one ``step-*`` folder in it); ``--data`` names the prepared dataset
it was trained on, for its tokenizer (byte-level without it). Sampling is seeded: the same flags give the
same text.
"""

from __future__ import annotations

import click


@click.command(name="generate", help="Sample a continuation of --prompt from the newest complete checkpoint "
               "under CHECKPOINT.")
@click.argument("checkpoint", type=str)
@click.option("--prompt", required=True, help="Text to continue.")
@click.option("--data", type=str, help="The prepared dataset it was trained on (its tokenizer).  [default: bytes]")
@click.option("--tokens", type=click.IntRange(min=1), default=100, show_default=True, help="Tokens to sample.")
@click.option("--temperature", type=click.FloatRange(min=0), default=0.8, show_default=True,
              help="Sampling temperature (0: greedy).")
@click.option("--top-k", type=click.IntRange(min=1), default=50, show_default=True, help="Sample among the k likeliest.")
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True, help="Sampling seed.")
def command(checkpoint: str, prompt: str, data: str | None, tokens: int, temperature: float, top_k: int,
            seed: int) -> None:
    from p2ptrain.export import build_model, gather_checkpoint, generate
    from p2ptrain.model.prepared import PreparedDataset
    from p2ptrain.model.tokenizer import ByteTokenizer

    tokenizer = PreparedDataset(data).tokenizer() if data is not None else ByteTokenizer()
    model = build_model(gather_checkpoint(checkpoint))
    click.echo(generate(model, tokenizer, prompt, tokens, temperature, top_k, seed))
