#!/usr/bin/env bash
# Mixed GPUs (docs/mixed-gpus.md): compute- and memory-aware plans with uneven stages.
#
#   bash examples/mixed_gpus.sh
#
# 1. GPT-3 XL on the built-in `volunteers` network (the paper's world-wide links, a volunteer mix of A100s,
#    RTX 4090/3090s, T4s, V100s and A10s): the layer split and each stage's memory, beside the paper's
#    communication-only plan and Megatron's order. 2. The same on 8 devices and 4 stages, as JSON (the
#    plan's "layers"). 3. A local swarm of 4 agents replaying four different cards (compute emulated):
#    the leader plans with each agent's own calibration, cuts the model unevenly, trains exactly.
set -euo pipefail
cd "$(dirname "$0")/.."

p2ptrain plan --scenario volunteers --model gpt3-xl --time-budget 60
p2ptrain plan --scenario volunteers --devices 8 --stages 4 --model gpt3-xl --time-budget 20 --json
p2ptrain swarm --scenario volunteers --agents 4 --stages 2 --steps 6 --objective simulated
