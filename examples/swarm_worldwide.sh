#!/usr/bin/env bash
# A local swarm on the paper's world-wide network, planned by the scheduler and by Megatron's rank order.
#
#   examples/swarm_worldwide.sh                      # 8 agents, 2 stages, 5 steps each way (~2-3 minutes)
#   AGENTS=4 STAGES=2 STEPS=3 examples/swarm_worldwide.sh
#
# Agent k plays device k of the network scaled to AGENTS devices (one per region at 8): its transport
# emulates that device's links, the agents measure them, and the lowest peer ID plans on the measurements.
# The summary prints the plan by region, its predicted cost (in the network's seconds; times the time
# scale, in emulated seconds) and the measured step times, so the two plans compare side by side.
set -euo pipefail
AGENTS=${AGENTS:-8}
STAGES=${STAGES:-2}
STEPS=${STEPS:-5}
OUT=${OUT:-$(mktemp -d -t p2ptrain-worldwide-XXXX)}
mkdir -p "$OUT"

for plan in scheduled megatron; do
    echo "== $plan: $AGENTS agents, $STAGES stages, $STEPS steps (work dir $OUT/$plan)" >&2
    p2ptrain swarm --agents "$AGENTS" --stages "$STAGES" --steps "$STEPS" --scenario worldwide --plan "$plan" \
        --workdir "$OUT/$plan" --json > "$OUT/$plan.json"
done

python3 - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
runs = {plan: json.load(open(f"{out}/{plan}.json")) for plan in ("scheduled", "megatron")}
scale = runs["scheduled"]["emulation"]["time_scale"]
print(f"{'plan':<10} {'predicted s/step':>17} {'emulated':>9} {'measured median':>16}   pipelines (agent indices)")
for plan, s in runs.items():
    print(f"{plan:<10} {s['predicted_cost_s']:17.3f} {s['predicted_cost_s'] * scale:9.3f} "
          f"{s['median_step_time_s']:16.3f}   {s['plan']['pipelines']}")
ratio = runs["megatron"]["median_step_time_s"] / runs["scheduled"]["median_step_time_s"]
print(f"measured: the scheduled plan's steps are {ratio:.2f}x faster than Megatron's rank order "
      f"(predicted {runs['megatron']['predicted_cost_s'] / runs['scheduled']['predicted_cost_s']:.2f}x on communication)")
assert runs["scheduled"]["losses"] == runs["megatron"]["losses"] or all(
    abs(a - b) <= 1e-4 * abs(b) for a, b in zip(runs["scheduled"]["losses"], runs["megatron"]["losses"])
), "different plans, same losses"
print("losses agree:", [round(x, 4) for x in runs["scheduled"]["losses"]])
PY
