#!/usr/bin/env bash
# The peers' wheels for the lent GPU machine, which reaches no registry: run from the project's
# root here, after ../shared/gpu/wheels.sh (which fills .gpu/whl with the project's own).
#
# bench/head.py --peers cce,liger (bench/head_peers.py) imports Cut Cross-Entropy and Liger,
# the `bench-gpu` optional extra of pyproject.toml, pinned there. Both are pure-Python wheels
# (Triton kernels, compiled on the GPU at their first call) that need only torch and triton,
# which the GPU image carries: downloaded without their dependencies into .gpu/whl, where
# bench/gpu_session.sh's setup step installs every wheel (carry: [".gpu"]). 0.9 MiB in all.
set -euo pipefail
[[ -f pyproject.toml ]] || { echo "run from the project root" >&2; exit 1; }
mkdir -p .gpu/whl
mapfile -t pins < <(python3 - <<'PY'
import tomllib
for pin in tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["bench-gpu"]:
    print(pin.replace(" ", ""))
PY
)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
    -d .gpu/whl "${pins[@]}"
ls .gpu/whl | grep -iE 'cut_cross|liger'
