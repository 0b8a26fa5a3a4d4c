#!/usr/bin/env bash
# Everything the GPU issues still owe, as three device calls of under 10 minutes each.
#
# A lent GPU machine gives a session 30 minutes and 10 minutes per command, and starts bare:
# this script is what such a session runs, so none of it is improvised under the clock. On
# this machine first: `../shared/gpu/wheels.sh` (fills .gpu/), then one device `run` per stage,
# each with `carry: [".gpu"]` and the command `bash bench/gpu_session.sh STAGE`:
#
#   tests  make test-gpu (the cuda-marked tests and tests/test_gpu_runs.py), then the
#          ms1mv3-r50 recipe started on one GPU (NPROC_PER_NODE=1) on the synthetic stream
#   bench  bench/kernels.py, bench/head.py (C_local 1M r=1 and r=0.1, 4M r=0.1, bf16 state) and
#          bench/train.py (iresnet50 bf16 batch 128: 1k and 1M classes, bf16 head state,
#          30M classes r=0.1, DeepSpeed ZeRO-1 against DDP, torch.compile)
#   demo   make demo-scale: the 1M-class scale-dynamics runs and their report's figures
#
# Every step runs under `timeout` so one hang cannot eat the call, goes on after a failure, and
# tees its output into $OUT/STAGE-STEP.log (the device returns at most 8 files per call); the
# last lines say which steps passed. Record the figures in docs/gpu.md and the README tables.
set -uo pipefail
stage=${1:?usage: bash bench/gpu_session.sh tests|bench|demo}
out=${OUT:-/tmp/gpu_session}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 WANDB_MODE=disabled
# The machine's python3 carries the CUDA torch; the Makefile's `setup` (a CPU venv) must not run.
make_py=(SETUP= PY=python3 "TORCHRUN=python3 -m torch.distributed.run")

if [[ -f .gpu/device-setup.sh ]]; then
    # shellcheck disable=SC1091
    source .gpu/device-setup.sh || exit 1
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/$stage-device.log"

results=()
step() {  # step NAME SECONDS COMMAND...: run it under a time limit, log it, note the outcome
    local name=$1 limit=$2
    shift 2
    echo "== $name ($(date -u +%H:%M:%S), limit ${limit}s): $*" | tee -a "$out/$stage-$name.log"
    timeout --signal=INT --kill-after=20 "$limit" "$@" 2>&1 | tee -a "$out/$stage-$name.log"
    local rc=${PIPESTATUS[0]}
    results+=("$name rc=$rc")
}

case $stage in
tests)
    step test-gpu 330 make test-gpu "${make_py[@]}"
    step recipe 150 make ms1mv3-r50 "${make_py[@]}" NPROC_PER_NODE=1 MAX_RESTARTS=0 \
        ARGS="data.source=synthetic data.num_classes=93431 train.max_steps=150 \
log.every=10 log.progress=false log.wandb=disabled output=/tmp/runs/ms1mv3_r50 \
checkpoint.every=100"
    ;;
bench)
    step kernels 90 python3 bench/kernels.py --classes 1000000 100000
    head="python3 bench/head.py --device cuda -P 1 -N 1024 --amp bf16 --steps 20"
    step head 240 bash -c "$head -C 1000000 -r 1.0 && $head -C 1000000 -r 0.1 \
&& $head -C 4000000 -r 0.1 && $head -C 1000000 -r 1.0 --state-dtype bf16"
    step train 270 bash -c "python3 bench/train.py --runs 1000:1.0,1000000:1.0,1000000:0.1 \
&& python3 bench/train.py --state-dtype bf16 --runs 1000000:1.0,1000000:0.1,30000000:0.1 \
&& python3 bench/train.py --engine deepspeed --runs 1000:1.0,1000000:0.1 \
&& python3 bench/train.py --compile --warmup 30 --runs 1000:1.0,1000000:0.1"
    ;;
demo)
    step demo 560 make demo-scale "${make_py[@]}" DEVICE=cuda
    (cd docs && tar czf "$out/demo-figures.tgz" synthetic_scale_demo_1m 2>/dev/null) || true
    ;;
*)
    echo "unknown stage '$stage': expected tests, bench or demo" >&2
    exit 2
    ;;
esac
printf '%s\n' "${results[@]}" | tee "$out/$stage-summary.log"
