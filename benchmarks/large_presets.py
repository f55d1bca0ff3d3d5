"""The large presets with their defaults on a GPU (issue 30, item 7): ``gpt3-xl`` and ``llama-1b`` for 50
steps in bf16 with their recipes (warm-up, cosine, clip 1.0), a batch sized to take a minute or two each.
Prints each run's first, highest and last loss, tokens/s and MFU; exits 1 if a loss after the first step
rose above the first step's (a spike, as gpt3-xl showed before the recipes: 11.37, 9.09, 19.70, 10.71).

    python3 benchmarks/large_presets.py [--steps 50] [--batch-size 8] [--device cuda] [--presets ...]

Run by benchmarks/cuda_check.sh where a GPU is lent; results go to benchmarks/README.md with the GPU named.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

PRESETS = ("gpt3-xl", "llama-1b")


def run(preset: str, steps: int, batch_size: int, device: str) -> dict:
    command = [sys.executable, "-m", "p2ptrain", "train", "--model", preset, "--steps", str(steps),
               "--batch-size", str(batch_size), "--micro-batches", "1", "--precision", "bf16",
               "--activation-checkpointing", "--device", device, "--json"]
    print("$", " ".join(command[1:]), flush=True)
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise SystemExit(f"{preset}: exit {done.returncode}: {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--presets", nargs="+", default=list(PRESETS), help="a dry run: --presets tiny --device cpu")
    args = parser.parse_args()
    spiked = []
    for preset in args.presets:
        doc = run(preset, args.steps, args.batch_size, args.device)
        losses, speed = doc["losses"], doc["throughput"]
        print(f"{preset}: loss {losses[0]:.3f} first, {max(losses[1:]):.3f} highest after, {losses[-1]:.3f} last; "
              f"{speed.get('tokens_per_s', 0):.0f} tokens/s, MFU {speed.get('mfu')}", flush=True)
        if max(losses[1:]) > losses[0]:
            spiked.append(preset)
    if spiked:
        print("a loss rose above the first step's:", ", ".join(spiked))
    return 1 if spiked else 0


if __name__ == "__main__":
    sys.exit(main())
