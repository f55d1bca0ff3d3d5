"""``p2ptrain data``: prepare a dataset of memory-mapped token shards, and show what one holds.

    p2ptrain data prepare corpus/ data/corpus                          # byte-level tokens
    p2ptrain data prepare corpus/ data/corpus --train-tokenizer 8000   # learn a BPE tokenizer first
    p2ptrain data prepare docs.jsonl data/docs --tokenizer tokenizer.json --text-field body
    p2ptrain data info data/corpus --json

Then ``p2ptrain train --data data/corpus`` (and ``[train] data`` of an agent) trains on it; the model's
vocabulary follows the tokenizer's. See ``p2ptrain.model.prepare`` for the sources it reads.
"""

from __future__ import annotations

import json
import time

import click


@click.group(name="data", help="Prepare tokenized datasets (memory-mapped shards + manifest) and inspect them.")
def command() -> None:
    pass


@command.command(name="prepare", help="Tokenize SRC (a text file, a folder, JSON lines, or a Hugging Face "
                 "datasets folder saved with save_to_disk) into token shards and a manifest in OUT.")
@click.argument("src", type=str)
@click.argument("out", type=str)
@click.option("--train-tokenizer", "vocab", type=click.IntRange(min=257),
              help="Learn a BPE tokenizer of this many tokens from SRC.  [default: byte-level]")
@click.option("--tokenizer", "tokenizer_file", type=str, help="Use this Hugging Face tokenizer.json.")
@click.option("--text-field", default="text", show_default=True, help="JSON lines / datasets: the text field.")
@click.option("--val-fraction", type=click.FloatRange(min=0, max=1, min_open=True, max_open=True), default=0.02,
              show_default=True, help="Tail of the token stream held out for validation.")
@click.option("--shard-tokens", type=click.IntRange(min=1), default=1 << 28, show_default=True,
              help="Tokens per shard file.")
@click.option("--overwrite", is_flag=True, help="Replace a dataset already in OUT.")
@click.option("--json", "as_json", is_flag=True, help="Print the manifest as one JSON document.")
def prepare(src: str, out: str, vocab: int | None, tokenizer_file: str | None, text_field: str,
            val_fraction: float, shard_tokens: int, overwrite: bool, as_json: bool) -> None:
    from p2ptrain.model.prepare import PrepareConfig, prepare_dataset
    from p2ptrain.model.prepared import PreparedDataset

    cfg = PrepareConfig(source=src, out=out, train_tokenizer=vocab, tokenizer_file=tokenizer_file,
                        text_field=text_field, val_fraction=val_fraction, shard_tokens=shard_tokens,
                        overwrite=overwrite)
    started = time.monotonic()
    last = [0.0]

    def progress(done: int, total: int, tokens: int) -> None:
        now = time.monotonic()
        if now - last[0] >= 1.0 or done >= total:
            last[0] = now
            share = f" ({100 * done / total:.0f} %)" if total else ""
            click.echo(f"  {done / 1e6:.1f} of {total / 1e6:.1f} MB read{share}, {tokens:,} tokens", err=True)

    manifest = prepare_dataset(cfg, on_progress=progress, on_stage=lambda text: click.echo(text, err=True))
    elapsed = time.monotonic() - started
    dataset = PreparedDataset(out)
    if as_json:
        click.echo(json.dumps({**json.loads(manifest.to_json()), "data_id": dataset.data_id,
                               "seconds": round(elapsed, 2)}))
        return
    train, val = (manifest.splits[s][1] - manifest.splits[s][0] for s in ("train", "val"))
    click.echo(f"prepared {out}: {manifest.num_tokens:,} tokens ({train:,} train, {val:,} validation) of "
               f"{manifest.documents:,} documents, tokenizer {manifest.tokenizer.label}, {len(manifest.shards)} "
               f"shard(s), in {elapsed:.1f} s; data id {dataset.data_id}")


@command.command(name="info", help="Show a prepared dataset's manifest and identity.")
@click.argument("path", type=str)
@click.option("--verify", is_flag=True, help="Re-hash every shard against the manifest.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document.")
def info(path: str, verify: bool, as_json: bool) -> None:
    from p2ptrain.model.prepared import PreparedDataset

    dataset = PreparedDataset(path)
    if verify:
        dataset.verify()
    manifest = dataset.manifest
    if as_json:
        click.echo(json.dumps({**json.loads(manifest.to_json()), "data_id": dataset.data_id}))
        return
    click.echo(f"{path}: {manifest.num_tokens:,} tokens, tokenizer {manifest.tokenizer.label}, "
               f"splits {', '.join(f'{k} {b - a:,}' for k, (a, b) in manifest.splits.items())}; "
               f"data id {dataset.data_id}{'; content verified' if verify else ''}")
