#!/usr/bin/env bash
# Everything the GPU issues still owe, as four device calls of under 10 minutes each.
#
# A lent GPU machine gives a session 30 minutes and 10 minutes per command, and starts bare:
# this script is what such a session runs, so none of it is improvised under the clock. On
# this machine first: `../shared/gpu/wheels.sh` (fills .gpu/), then one device `run` per stage,
# each with `carry: [".gpu"]` and the command `bash bench/gpu_session.sh STAGE`:
#
#   tests  make test-gpu (the cuda-marked tests and tests/e2e/test_gpu_runs.py), then the
#          ms1mv3-r50 recipe started on one GPU (NPROC_PER_NODE=1) on the synthetic stream
#   head   bench/kernels.py; bench/head.py at C_local 1M r=1 (fp32 and bf16 state), r=0.1, 4M r=0.1
#   train  bench/train.py, iresnet50 bf16 batch 128: 1k and 1M classes, bf16 head state,
#          DeepSpeed ZeRO-1 against DDP, torch.compile, 30M classes r=0.1 (does it fit)
#   demo   make demo-scale: the 1M-class scale-dynamics runs and their report's figures
#
# Every step runs under `timeout` so one hang cannot eat the call, goes on after a failure, and
# tees its output into $OUT/STAGE-STEP.log (the device returns at most 8 files per call); the
# last lines say which steps passed. Record the figures in docs/gpu.md and the README tables.
set -uo pipefail
stage=${1:?usage: bash bench/gpu_session.sh tests|head|train|demo}
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
step() {  # step LOG/LABEL SECONDS COMMAND...: run it under a time limit into $out/STAGE-LOG.log
    local name=$1 limit=$2 log="$out/$stage-${1%%/*}.log"
    shift 2
    echo "== $name ($(date -u +%H:%M:%S), limit ${limit}s): $*" | tee -a "$log"
    timeout --signal=INT --kill-after=20 "$limit" "$@" 2>&1 | tee -a "$log"
    results+=("$name rc=${PIPESTATUS[0]}")
}
head_bench() { step "head/$*" 75 python3 bench/head.py --device cuda -P 1 -N 1024 --amp bf16 \
    --steps 20 "$@"; }
train_bench() { step "train/${*:2}" "$1" python3 bench/train.py "${@:2}"; }

case $stage in
tests)
    step test-gpu 330 make test-gpu "${make_py[@]}"
    step recipe 150 make ms1mv3-r50 "${make_py[@]}" NPROC_PER_NODE=1 MAX_RESTARTS=0 \
        ARGS="data.source=synthetic data.num_samples=null data.synthetic_images_per_class=55 \
train.max_steps=150 log.every=10 log.progress=false log.wandb=disabled \
output=/tmp/runs/ms1mv3_r50 checkpoint.every=100"
    ;;
head)
    step kernels 90 python3 bench/kernels.py --classes 1000000 100000
    head_bench -C 1000000 -r 1.0
    head_bench -C 1000000 -r 0.1
    head_bench -C 1000000 -r 1.0 --state-dtype bf16
    head_bench -C 4000000 -r 0.1
    ;;
train)
    train_bench 120 --runs 1000:1.0,1000000:1.0,1000000:0.1
    train_bench 90 --state-dtype bf16 --runs 1000000:1.0,1000000:0.1
    train_bench 100 --engine deepspeed --runs 1000:1.0,1000000:0.1
    train_bench 150 --compile --warmup 30 --runs 1000:1.0,1000000:0.1
    train_bench 120 --state-dtype bf16 --runs 30000000:0.1 --steps 20
    ;;
demo)
    # 2,000 steps: the four runs within one call (configs/scale_demo.yaml estimates 3,000 at
    # 12-15 minutes, unmeasured); the report's figures come back as one archive.
    step demo 560 make demo-scale "${make_py[@]}" DEVICE=cuda STEPS=2000
    (cd docs && tar czf "$out/demo-figures.tgz" synthetic_scale_demo_1m 2>/dev/null) || true
    ;;
*)
    echo "unknown stage '$stage': expected tests, head, train or demo" >&2
    exit 2
    ;;
esac
printf '%s\n' "${results[@]}" | tee "$out/$stage-summary.log"
