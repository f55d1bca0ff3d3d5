"""``p2ptrain export CHECKPOINT OUT``: the trained model, gathered from its stages' checkpoint, in Hugging
Face's layout of its family, ``GPT2LMHeadModel`` or ``LlamaForCausalLM`` (``p2ptrain.export``).

    p2ptrain export ckpt/ hf-model/ --data data/corpus
    python -c "from transformers import AutoModelForCausalLM; AutoModelForCausalLM.from_pretrained('hf-model')"
"""

from __future__ import annotations

import json

import click


@click.command(name="export", help="Write the newest complete checkpoint under CHECKPOINT (a checkpoint folder "
               "or one step-* folder in it) to OUT as safetensors + config.json in Hugging Face's layout: "
               "GPT2LMHeadModel or LlamaForCausalLM, by the model's family.")
@click.argument("checkpoint", type=str)
@click.argument("out", type=str)
@click.option("--data", type=str, help="The prepared dataset it was trained on: its tokenizer goes along.")
@click.option("--overwrite", is_flag=True, help="Write into OUT even if it is not empty.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document.")
def command(checkpoint: str, out: str, data: str | None, overwrite: bool, as_json: bool) -> None:
    from p2ptrain.export import export_checkpoint

    click.echo(f"gathering the stages of {checkpoint}", err=True)
    info = export_checkpoint(checkpoint, out, data=data, overwrite=overwrite)
    if as_json:
        click.echo(json.dumps({"out": out, **info}))
        return
    shape = info["shape"]
    click.echo(f"exported {info['model']} after step {info['step']} ({shape['num_layers']} layers, width "
               f"{shape['hidden_size']}, vocabulary {shape['vocab_size']}) to {out} as {info['architecture']}")
