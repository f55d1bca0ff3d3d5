#!/usr/bin/env bash
# DiLoCo's cost in quality on a GPU, sized to a time budget (issue 31, item 6):
#   bash benchmarks/diloco_gpu.sh [OUTDIR] [BUDGET_S]
# The `small` preset on a byte-level corpus of the Python standard library's source (the only large text a
# machine without internet is sure to have; 24 MB, 2 % held out), 4 replicas, 32 sequences a step, every
# (setting, seed) run in a process of its own on the one GPU. A 40-step calibration of every run at once
# gives the seconds a step; the main run takes the most steps (a multiple of 100, 1000 at least so that H 50
# has 20 rounds) that fit BUDGET_S (default 420), or it stops. Seen on an H200 (session 20): 15 runs at once
# time-slice the card to 1.66 s a step each (every-step alone: 0.7 s), so 1000 steps do not fit 7 minutes;
# JOBS=N runs N at a time. Writes calibration.json and quality.json to OUTDIR.
set -u
OUT_DIR=${1:-diloco-gpu}
BUDGET=${2:-420}
DEVICE=${DEVICE:-cuda} MODEL=${MODEL:-small} MIN_STEPS=${MIN_STEPS:-1000}  # DEVICE=cpu MODEL=tiny MIN_STEPS=100: a dry run
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1
CORPUS=$OUT_DIR/stdlib.txt
STDLIB=$(python3 -c "import sysconfig; print(sysconfig.get_paths()['stdlib'])")
find "$STDLIB" -name '*.py' -not -path '*/test*' -not -path '*/site-packages/*' | sort | xargs cat 2>/dev/null \
    | head -c 24000000 > "$CORPUS"
echo "corpus: $(wc -c < "$CORPUS") bytes of $STDLIB"
ARGS=(--model "$MODEL" --replicas 4 --batch-size 32 --device "$DEVICE" --corpus "$CORPUS"
      --h 10,25,50,50@0.7:0.9 --outer 1.0:0 --seeds 0,1,2 --jobs "${JOBS:-15}" --json)
timeout 150 python3 benchmarks/diloco.py "${ARGS[@]}" --steps ${CALIBRATION_STEPS:-40} > "$OUT_DIR/calibration.json" 2> "$OUT_DIR/calibration.log" || { cat "$OUT_DIR/calibration.log"; exit 1; }
STEPS=$(python3 -c "
import json, sys
calibration = json.load(open('$OUT_DIR/calibration.json'))
slowest = max(row['ms_per_step'] for row in calibration['rows']) / 1e3
steps = int(($BUDGET - 45) / slowest) // 100 * 100
print(f'calibration: {calibration[\"seconds\"]:.0f} s, slowest {slowest * 1e3:.0f} ms a step', file=sys.stderr)
if steps < $MIN_STEPS:
    sys.exit(f'only {steps} steps fit the budget, fewer than $MIN_STEPS: give it more time or fewer jobs (JOBS)')
print(steps)") || exit 2
echo "main run: $STEPS steps"
timeout $((BUDGET + 120)) python3 benchmarks/diloco.py "${ARGS[@]}" --steps "$STEPS" --eval-every $((STEPS / 10)) \
    > "$OUT_DIR/quality.json" 2> "$OUT_DIR/quality.log"
rc=$?
cat "$OUT_DIR/quality.log"
python3 -c "
import json
q = json.load(open('$OUT_DIR/quality.json'))
print(q['model'], q['steps'], 'steps', q['tokens'], 'tokens', round(q['seconds']), 's')
for r in q['rows']:
    print(f\"{r['setting']:<14} {r['mean']:.4f} ± {r['spread']:.4f} {r['vs_every_step']:.3f}x rounds {r['rounds']}\")
" || true
exit $rc
