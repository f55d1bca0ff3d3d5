#!/usr/bin/env bash
# A local swarm on a hand-written cluster file: two cloud GPUs in one data centre and two home GPUs.
#
#   examples/swarm_cluster.sh                 # 4 agents, 2 stages, 10 steps (about a minute)
#   examples/swarm_cluster.sh --plan megatron # any other `p2ptrain swarm` flag is passed on
#
# With --cluster the links are emulated as written (time scale 1, size factor 1: this run's own bytes on
# the file's latencies and bandwidths), the agents measure them, and the leader plans on the measurements.
# The summary shows the plan per site, its predicted communication time and the measured step times.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
exec p2ptrain swarm --cluster "$HERE/swarm_cluster.json" --agents 4 --stages 2 --steps 10 "$@"
