#!/usr/bin/env bash
# Everything the GPU issues owe, as two device calls of under 9 minutes each (wheels included).
#
# A lent GPU machine gives a session 15 minutes in all and 10 minutes per command, and starts
# bare (stage 1 fits; stage 2 takes GPU_SESSION_BUDGET from what is left, docs/gpu.md):
# this script is what such a session runs, so none of it is improvised under the clock. On
# this machine first: `../shared/gpu/wheels.sh` (fills .gpu/), then one device `run` per stage,
# each with `carry: [".gpu"]` and the command `bash bench/gpu_session.sh 1` (then `2`):
#
#   1  make test-gpu (the cuda-marked tests, tests/e2e/test_gpu_runs.py's short runs included;
#      4 workers, a JUnit report); the ms1mv3-r50 recipe on one GPU (NPROC_PER_NODE=1) on the
#      synthetic stream; bench/head.py at C_local 1M r=1 (fp32 and bf16 state), r=0.1, 4M r=0.1
#   2  bench/train.py, iresnet50 bf16 batch 128: the step's overheads each switched back on
#      (--variant: one_rank_ddp, prefetch, fused_updates; 1k and 1M r=1), DeepSpeed ZeRO-1's
#      settings (overlap_comm, contiguous_gradients, bucket sizes) and a torch.profiler trace
#      of its step (bench/pace.py profile-train --engine deepspeed: $OUT/profile/), iresnet100
#      on DDP and on DeepSpeed; then (1k and 1M classes) DDP, DeepSpeed ZeRO-1;
#      the short scale demo (make demo-scale, 300 steps, the four runs two at a time);
#      torch.compile; the bf16 head state; bench/loader.py on the node's cores (1, 4, 8 workers:
#      the planner's loader rate, trainer/plan_figures.json, was measured on a 2-core VM)
#   3  after mending what 1 and 2 showed, on what device time is left: make test-gpu again;
#      the CPU suite with the GPU visible (it must pass there too; a JUnit report); what is
#      alive at the head's CUDA memory peak (bench/cuda_peak.py, r=0.1 and r=1); the recipe;
#      DeepSpeed's bench; torch.compile; the loader
#   pace  the stage a lent GPU runs first, one call (GPU_SESSION_BUDGET=520), the steps whose
#      figures $OUT/gpu-pace.json holds first: the kernels' sweep (bench/pace.py tune:
#      $OUT/tuned.json, the committed table with this card's winners, to copy over
#      partial_fc/tiles/tuned.json); the head at C_local 1M N 1024 bf16, r=1 and r=0.1, beside
#      its matmuls and the textbook head (bench/head.py); bench/train.py at 1k r=1 and 1M r=0.1
#      against the backbone's ceiling; arcface_torch's own train_v2.py on synthetic input
#      (bench/arcface_torch_pace.py, from .gpu/insightface: docs/gpu.md); the recipe,
#      shorter; the largest C_local that trains at r=0.1 bf16 state beside launch.plan's;
#      then what the budget may skip: PyTorch's, Cut Cross-Entropy's and Liger's fused losses
#      at 1M r=1 beside the head (bench/head.py --peers; their wheels: bench/peer_wheels.sh),
#      the kernels' filtered backward beside the exact one (bench/pace.py filtered),
#      torch.profiler traces of the head's and the trainer's steps ($OUT/profile/, their
#      per-kernel tables in the logs); $OUT/gpu-pace.json (gpu_summary.py pace)
#
# Each stage first installs .gpu/whl into /tmp/site (as .gpu/device-setup.sh does, wheel by
# wheel when one fails). Every step runs under `timeout`, its limit clipped so the stage ends
# within GPU_SESSION_BUDGET seconds (default 500; a step left less than half its limit is
# skipped); a failed, timed-out or skipped step never stops the next. $OUT gets three files:
# gpu_summary.json (bench/gpu_summary.py: versions, each test's outcome, img/s, ms, GB, the
# head's GEMM share), session-STAGE.log (all output) and logs-STAGE.tgz (each step's log, the
# JUnit XML, the benches' JSON, the runs' metrics.jsonl, the demo's figures).
#
# GPU_SESSION_STEPS="NAME ...": run only these steps (setup and versions always), e.g. the
# pace stage's tail in a second call when the budget skipped it in the first.
# GPU_SESSION_DRY=1 (or --dry-run): print each step's command and run none; the summary is
# still written. PY (default python3) is the interpreter the steps use.
set -uo pipefail
dry=${GPU_SESSION_DRY:-0}
args=()
for a in "$@"; do
    if [[ $a == --dry-run ]]; then dry=1; else args+=("$a"); fi
done
stage=${args[0]:-}
[[ $stage == [123] || $stage == pace ]] || {
    echo "usage: bash bench/gpu_session.sh 1|2|3|pace [--dry-run]" >&2; exit 2; }
out=${OUT:-/tmp/gpu_session/out}
work=${GPU_SESSION_WORK:-/tmp/gpu_session}
budget=${GPU_SESSION_BUDGET:-500}
only=${GPU_SESSION_STEPS:-}  # step names; empty: every step of the stage
reserve=25  # the summary, the archive and one step's --kill-after
export PY=${PY:-python3} SITE=/tmp/site PYTHONUNBUFFERED=1 WANDB_MODE=disabled
logs=$work/logs-$stage
rm -rf "$logs" && mkdir -p "$out" "$logs" "$work/runs"

# The machine's python3 carries the CUDA torch; the Makefile's `setup` (a CPU venv) must not run.
make_py=(SETUP= "PY=$PY")

shown() {  # the command as one line, arguments with spaces quoted
    local a line=()
    for a in "$@"; do [[ $a == *" "* ]] && line+=("'$a'") || line+=("$a"); done
    echo "${line[*]}"
}

step() {  # step NAME LIMIT COMMAND...: run it under a time limit into $logs/NAME.log
    local name=$1 limit=$2 status rc=0 t0=$SECONDS
    shift 2
    local left=$((budget - reserve - SECONDS)) cmd
    cmd=$(shown "$@")
    if [[ -n $only && $name != setup && $name != versions && " $only " != *" $name "* ]]; then
        status=skipped
        echo "== $name: skipped, not in GPU_SESSION_STEPS ($only)"
    elif ((left * 2 < limit)); then
        status=skipped
        echo "== $name: skipped, ${left}s left of the stage's ${budget}s budget, it needs $((limit / 2))s"
    elif [[ $dry == 1 ]]; then
        status=dry
        echo "== $name (limit ${limit}s): would run: $cmd"
    else
        ((limit > left)) && limit=$left
        echo "== $name ($(date -u +%H:%M:%S), limit ${limit}s): $cmd"
        timeout --signal=INT --kill-after=15 "$limit" "$@" 2>&1 | tee "$logs/$name.log"
        rc=${PIPESTATUS[0]}
        case $rc in 0) status=ok ;; 124 | 137) status=timeout ;; *) status=failed ;; esac
        echo "== $name: $status (exit $rc) in $((SECONDS - t0))s"
    fi
    printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$name" "$status" "$rc" "$((SECONDS - t0))" "$limit" \
        "$cmd" >> "$logs/steps.tsv"
}

install_wheels() {  # .gpu/whl into $SITE; a wheel that fails is reported, the others go in
    local pip=("$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir
               --upgrade --target "$SITE") failed=0 w
    compgen -G ".gpu/whl/*.whl" > /dev/null || { echo "no .gpu/whl/*.whl: run ../shared/gpu/wheels.sh here first"; return 1; }
    if ! "${pip[@]}" .gpu/whl/*.whl; then
        for w in .gpu/whl/*.whl; do "${pip[@]}" "$w" || { echo "wheel failed: $w"; failed=1; }; done
    fi
    for w in .gpu/whl/deepspeed-*.tar.gz; do  # DeepSpeed from its sdist, ops left to JIT
        [[ -f $w ]] || { echo "no deepspeed sdist in .gpu/whl"; failed=1; continue; }
        PYTHONPATH=$SITE DS_BUILD_OPS=0 "${pip[@]}" --no-build-isolation "$w" || failed=1
    done
    return $failed
}
export -f install_wheels

head_bench() {  # head_bench NAME FLAGS...: bench/head.py, one GPU = one rank
    local name=$1
    shift
    step "head-$name" 75 "$PY" bench/head.py --device cuda -P 1 -N 1024 --amp bf16 --steps 20 "$@"
}
train_bench() {  # train_bench NAME LIMIT FLAGS...: bench/train.py with its figures as JSON
    local name=$1 limit=$2
    shift 2
    step "train-$name" "$limit" "$PY" bench/train.py --json "$logs/train-$name.json" "$@"
}

cuda_tests() {  # make test-gpu with a JUnit report
    local workers=""
    "$PY" -c "import xdist" 2> /dev/null && workers="-n 4"
    step cuda-tests 270 make -s test-gpu "${make_py[@]}" \
        "PYTEST_ARGS=$workers -p no:randomly --junitxml=$logs/cuda-tests.xml"
}
cpu_suite() {  # make test's tests with the GPU visible (they must pass there too), a JUnit report
    # wandb and moto are not carried, so their tests fail with "No module named" in the report.
    step cpu-suite 240 "$PY" -m pytest -q -n 14 -p no:randomly --timeout 120 \
        -m "not plan_full and not cuda" "--junitxml=$logs/cpu-suite.xml"
}
recipe() {  # recipe [STEPS LIMIT]: the ms1mv3-r50 recipe on one GPU, on the synthetic stream
    local steps=${1:-150} limit=${2:-150}
    step recipe "$limit" make -s ms1mv3-r50 "${make_py[@]}" NPROC_PER_NODE=1 MAX_RESTARTS=0 \
        ARGS="data.source=synthetic data.num_samples=null data.synthetic_images_per_class=55 \
train.max_steps=$steps log.every=10 log.progress=false log.wandb=disabled \
output=$work/runs/recipe checkpoint.every=100 checkpoint.resume=none"
}

stage1() {
    cuda_tests
    recipe
    head_bench 1m-r1 -C 1000000 -r 1.0
    head_bench 1m-r0.1 -C 1000000 -r 0.1
    head_bench 1m-r1-bf16-state -C 1000000 -r 1.0 --state-dtype bf16
    head_bench 4m-r0.1 -C 4000000 -r 0.1
}

stage2() {
    # first what no session has measured: the step's overheads, each switched back on, at 1k
    # and 1M (docs/benchmarks.md); DeepSpeed's own settings and a trace of its backward;
    # iresnet100 on both engines (the engine defaults take iresnet50's order for it)
    train_bench overheads 180 --runs 1000:1.0,1000000:1.0 --variant wrapped=one_rank_ddp=true \
        --variant no-prefetch=prefetch=false --variant no-fused=fused_updates=false \
        --variant before=one_rank_ddp=true,prefetch=false,fused_updates=false
    train_bench deepspeed-settings 150 --engine deepspeed --runs 1000:1.0 \
        --variant no-overlap=zero_settings.overlap_comm=0,zero_settings.contiguous_gradients=0 \
        --variant overlap=zero_settings.overlap_comm=1,zero_settings.contiguous_gradients=1 \
        --variant buckets=zero_settings.reduce_bucket_size=50000000,zero_settings.allgather_bucket_size=50000000
    step profile-train-deepspeed 90 "$PY" bench/pace.py profile-train --engine deepspeed \
        --steps 2 --out "$out/profile"
    train_bench r100-ddp 90 --backbone iresnet100 --runs 1000:1.0 --steps 30 --warmup 5
    train_bench r100-deepspeed 120 --backbone iresnet100 --runs 1000:1.0 --steps 30 --warmup 5 \
        --engine deepspeed
    train_bench ddp 120 --runs 1000:1.0,1000000:1.0,1000000:0.1
    train_bench deepspeed 100 --engine deepspeed --runs 1000:1.0,1000000:0.1
    step demo 200 make -s demo-scale "${make_py[@]}" DEVICE=cuda STEPS=300 JOBS=2 \
        "DEMO_PNG=$work/demo_png" ARGS="--work $work/runs/demo --fresh"
    train_bench compile 150 --compile --warmup 30 --runs 1000:1.0,1000000:0.1
    train_bench bf16-state 90 --state-dtype bf16 --runs 1000000:1.0,1000000:0.1
    step loader 90 "$PY" bench/loader.py --images 16000 --repeats 2 --workers 1,4,8
}

stage3() {
    cuda_tests
    cpu_suite
    step peak-r0.1 45 "$PY" bench/cuda_peak.py --rate 0.1
    step peak-r1 45 "$PY" bench/cuda_peak.py --rate 1.0
    recipe
    train_bench deepspeed 100 --engine deepspeed --runs 1000:1.0,1000000:0.1
    train_bench compile 150 --compile --warmup 30 --runs 1000:1.0,1000000:0.1
    step loader 90 "$PY" bench/loader.py --images 16000 --repeats 2 --workers 1,4,8
}

stagepace() {
    # First the steps whose figures gpu-pace.json holds (the tuned table before them: the later
    # steps run its winners), then what may be skipped when the budget runs out (about 560 s
    # of steps against 495 usable): the peers at the same shape, the filtered backward beside
    # the exact one, the two traces.
    step tune 150 "$PY" bench/pace.py tune --out "$out/tuned.json" --report "$logs/tune.json"
    head_bench pace-r1 -C 1000000 -r 1.0
    head_bench pace-r0.1 -C 1000000 -r 0.1
    train_bench pace 120 --runs 1000:1.0,1000000:0.1
    step arcface-torch 100 "$PY" bench/arcface_torch_pace.py --insightface .gpu/insightface \
        --seconds 60 --json "$logs/arcface-torch.json"
    recipe 80 100
    step largest 120 "$PY" bench/pace.py largest --tries 4 --json "$logs/largest.json"
    # Cut Cross-Entropy and Liger from .gpu/whl (bench/peer_wheels.sh); their first calls compile
    # (CCE autotunes), and Liger at 1M classes runs its chunks one row at a time: fewer steps
    step head-pace-peers 120 "$PY" bench/head.py --device cuda -P 1 -N 1024 --amp bf16 --steps 10 \
        --mem-steps 1 -C 1000000 -r 1.0 --peers torch_lce,cce,liger --skip-textbook
    step filtered 60 "$PY" bench/pace.py filtered --json "$logs/filtered.json"
    step profile-head 60 "$PY" bench/pace.py profile-head --out "$out/profile"
    step profile-train 90 "$PY" bench/pace.py profile-train --steps 2 --out "$out/profile"
}

collect() {  # the runs' metrics and the demo's figures join the logs, then the summary
    local m summary=(python3 bench/gpu_summary.py summary --stage "$stage" --logs "$logs"
                     --out "$out/gpu_summary.json" --budget "$budget" --elapsed "$SECONDS")
    [[ -f $work/runs/recipe/metrics.jsonl ]] && cp "$work/runs/recipe/metrics.jsonl" "$logs/metrics-recipe.jsonl"
    for m in "$work"/runs/demo/*/metrics.jsonl; do
        [[ -f $m ]] && cp "$m" "$logs/metrics-demo-$(basename "$(dirname "$m")").jsonl"
    done
    [[ -d $work/demo_png ]] && cp -r "$work/demo_png" "$logs/"
    [[ $dry == 1 ]] && summary+=(--dry)
    "${summary[@]}" || echo "gpu_summary.py failed: no $out/gpu_summary.json"
    [[ -d $out/profile ]] && mv "$out"/profile/*-kernels.txt "$logs/" 2> /dev/null
    if [[ $stage == pace ]]; then
        python3 bench/gpu_summary.py pace --logs "$logs" --out "$out/gpu-pace.json" \
            || echo "gpu_summary.py pace failed: no $out/gpu-pace.json"
    fi
    tar czf "$out/logs-$stage.tgz" -C "$work" "logs-$stage"
    echo "stage $stage done in ${SECONDS}s:"
    awk -F'\t' '{ printf "  %-22s %-8s exit %-4s %5ss\n", $1, $2, $3, $4 }' "$logs/steps.tsv"
    ! cut -f2 "$logs/steps.tsv" | grep -qxE 'failed|timeout'  # the exit status: all held
}

main() {
    step setup 120 bash -c install_wheels
    export PYTHONPATH=$SITE:$PWD  # whatever installed; a missing package fails its steps only
    step versions 60 "$PY" bench/gpu_summary.py versions --out "$logs/versions.json"
    "stage$stage"
    collect
}

main 2>&1 | tee -a "$out/session-$stage.log"
