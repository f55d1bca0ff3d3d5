#!/usr/bin/env bash
# Plan a hand-written cluster file, then the paper's world-wide network scaled to 16 devices.
#
#   bash examples/plan_cluster.sh
#
# The cluster file format is in docs/design.md ("Cluster file"): devices, one-way latency_ms and
# bandwidth_gbps matrices. --json prints the plan document the leader publishes.
set -euo pipefail
cd "$(dirname "$0")/.."

# 12 devices in Oregon (5), Virginia (4) and Frankfurt (3), 4 pipeline stages × 3 replicas.
p2ptrain plan --cluster examples/clusters/three_regions.json --stages 4

# The same cluster with a heavier model: c_PP and c_DP derived from the GPT-3 XL preset.
p2ptrain plan --cluster examples/clusters/three_regions.json --stages 4 --model gpt3-xl --json

# One of the paper's networks, scaled down for a local swarm (2 devices a region).
p2ptrain plan --scenario worldwide --devices 16 --stages 4
