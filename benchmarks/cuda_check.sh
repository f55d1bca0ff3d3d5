#!/usr/bin/env bash
# The CUDA path, checked and measured on a machine with a GPU, in one go (about 6 minutes on one H200):
#   bash benchmarks/cuda_check.sh [OUTDIR]
# from the project's root, with p2ptrain and its dependencies importable by python3 (pip install -e ".[test]"
# after a CUDA build of torch). CI has no GPU: this is how the CUDA path gets checked where one is lent.
# 1. the tests that run only where CUDA is (fp32 on CUDA equals the CPU; SDPA's grouped-query attention;
#    2 x 2 workers on one GPU give the single-process losses) and the device-facing tests around them;
# 2. the device's profile as an agent publishes it (name, memory, measured matmul TFLOP/s);
# 3. `p2ptrain train` on the GPU, fp32 and bf16: tokens/s and MFU;
# 4. real swarms of four agents sharing the GPU (bf16 compute; bf16, then int8 wire; 1F1B, overlap);
# 5. `p2ptrain bench runtime --sizes 1 --repeats 100`: the transport against a raw stream on a machine with
#    cores to spare (the 2-core CI machine shares its cores with both libp2p daemons);
# 6. what keeping a stage's state after every step costs a GPU trainer (benchmarks/keeper_copy.py; CUDA only);
# 7. gpt3-xl and llama-1b with their recipes, 50 steps in bf16: no loss spike, tokens/s and MFU
#    (benchmarks/large_presets.py; CUDA only).
# 8. verified work on the GPU: the floating-point deviations the recompute check's allowance is made of, on
#    trained states (benchmarks/verify_noise.py --measure, to 1,000 steps), and a swarm of four whose members
#    recompute one of each other's 8 micro-batches a step in bf16 (every check on; nobody may be blamed).
# 9. issue 46's goals, each as a ratio beside its baseline (benchmarks/gpu_goals.py: `gpt2` in one process and
#    compiled, its 4-agent swarm with the checks off and on, `llama-1b` compiled; not yet run on a GPU):
#    ONLY=goals runs it alone.
# 10. a stage boundary of k values a token in quality (issue 49): `gpt2` (d = 768) cut into 4 stages, 300 steps on
#    the Python standard library's source, uncompressed beside subspaces of d/32 (GPT-3 XL's k = 64 in
#    proportion) and d/8, and d/32 with int8 coefficients (benchmarks/boundary_quality.py, four runs at once on
#    the GPU): ONLY=subspace runs it alone.
# Each part has its own deadline and its log goes to OUTDIR (default ./cuda-check; WORK: where the rest
# goes); a part that fails is reported and the next one still runs; the exit status is 1 if any failed.
# DEVICE=cpu runs the same parts on the CPU (a dry run of the script).
# ONLY="NAME ..." runs only the parts named (e.g. ONLY="verify-measure swarm-verify").
set -u
OUT_DIR=${1:-cuda-check}
DEVICE=${DEVICE:-cuda}
WORK=${WORK:-$OUT_DIR/work}  # the tests' temp dirs and the swarms' workdirs
mkdir -p "$OUT_DIR" "$WORK"
export PYTHONUNBUFFERED=1
status=0

part() {  # part NAME SECONDS COMMAND...: run with a deadline, keep the log, note the outcome
    local name=$1 limit=$2; shift 2
    if [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $name "* ]]; then return; fi
    local t0=$SECONDS
    echo "=== $name (deadline ${limit}s): $*"
    timeout --kill-after=10 "$limit" "$@" > "$OUT_DIR/$name.log" 2>&1
    local rc=$?
    tail -n 25 "$OUT_DIR/$name.log"
    echo "=== $name: rc=$rc in $((SECONDS - t0))s"
    [ $rc -eq 0 ] || status=1
}

command -v nvidia-smi > /dev/null && nvidia-smi -L
python3 -c "import torch, hivemind, p2ptrain; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else '', 'hivemind', hivemind.__version__,
      'p2ptrain', p2ptrain.__version__)"

part tests 240 python3 -m pytest -q -p no:cacheprovider --basetemp="$WORK/pytest" \
    tests/model/test_precision_modes.py tests/model/test_outer.py tests/runtime/test_distributed_tokenized.py \
    tests/runtime/test_reference.py tests/model/test_llama.py
part profile 60 python3 -c "import json, dataclasses, torch
from p2ptrain.agent.profile import profile_device
from p2ptrain.runtime.reference import resolve_device
print(json.dumps(dataclasses.asdict(profile_device(resolve_device('$DEVICE'), refresh=True))))"
for precision in fp32 bf16; do
    part "train-$precision" 120 python3 -m p2ptrain train --model small --steps 30 --device "$DEVICE" \
        --precision "$precision" --json
done
for wire in bf16 int8; do
    part "swarm-$wire" 200 python3 -m p2ptrain swarm --agents 4 --stages 2 --steps 20 --scenario none --model small \
        --device "$DEVICE" --precision bf16 --wire "$wire" --schedule 1f1b --overlap --workdir "$WORK/swarm-$wire" --json
done
part transport 120 python3 -m p2ptrain bench runtime --sizes 1 --repeats 100 --json
part verify-measure 240 python3 benchmarks/verify_noise.py --measure --device "$DEVICE" --checkpoints 0,200,1000 --json
part swarm-verify 200 python3 -m p2ptrain swarm --agents 4 --stages 2 --steps 20 --scenario none --model small \
    --device "$DEVICE" --precision bf16 --wire bf16 --micro-batches 8 --batch-size 32 --workdir "$WORK/swarm-verify" --json
if [ -d "$WORK/swarm-verify" ] && grep -l '"event":"verify_failed"' "$WORK"/swarm-verify/agent-*.events.jsonl > /dev/null 2>&1; then
    echo "=== swarm-verify: an honest member was blamed"; status=1
fi
[ -d "$WORK/swarm-verify" ] && grep -h "recompute check took" "$WORK"/swarm-verify/agent-*.log
[ "$DEVICE" = cuda ] && part keeper 120 python3 benchmarks/keeper_copy.py
[ "$DEVICE" = cuda ] && part presets 300 python3 benchmarks/large_presets.py
if [ "$DEVICE" = cuda ]; then
    part goals 590 python3 benchmarks/gpu_goals.py --out "$WORK/goals"
else  # a dry run: the same parts on a model the CPU trains in seconds
    part goals 590 python3 benchmarks/gpu_goals.py --device "$DEVICE" --model tiny --large "" --steps 4 --out "$WORK/goals"
fi
if [ "$DEVICE" = cuda ]; then
    SUBSPACE=(--model gpt2 --steps 300 --settings fp32,fp32/k24,fp32/k96,int8/k24)
else  # a dry run
    SUBSPACE=(--model tiny --steps 4 --settings fp32,fp32/k2,int8/k2)
fi
if [ -z "${ONLY:-}" ] || [[ " $ONLY " == *" subspace "* ]]; then
    STDLIB=$(python3 -c "import sysconfig; print(sysconfig.get_paths()['stdlib'])")
    find "$STDLIB" -name '*.py' -not -path '*/test*' -not -path '*/site-packages/*' | sort | xargs cat 2>/dev/null \
        | head -c 24000000 > "$WORK/stdlib.txt"
fi
part subspace 420 python3 benchmarks/boundary_quality.py "${SUBSPACE[@]}" --stages 4 --seeds 0 --device "$DEVICE" \
    --corpus "$WORK/stdlib.txt" --jobs 4 --eval-every 100
exit $status
