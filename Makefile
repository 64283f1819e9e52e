# epserve: install, test, run.  `make help` prints this text.
#
# Targets:
#   make install    use the system python3 if it already has everything (the GPU machine),
#                   else create .venv and install epserve[test] there (with epserve[mpich],
#                   the MPICH wheel, when the machine has no MPI launcher); a no-op once done
#   make test       every test this machine can run (GPU tests skip, saying why, without a GPU)
#   make test-gpu   only the tests marked gpu; fails, saying why, when every one was skipped
#   make run        python -m epserve.main on NP ranks under launch/run.py (needs GPUs)
#   make bench      the benchmark on NP ranks: table on stdout, JSON and plots in BENCH_OUT
#   make fuzz       random layers, fused == unfused bitwise and float64 reference (SEED, COUNT)
#   make soak       CALLS back-to-back forward calls on one service: same bits, no memory growth
#   make dead-peer  a killed and a stuck rank: the others raise naming the peer and the stage;
#                   fails, saying why, when every test was skipped (no GPU)
#   make sanitize   compute-sanitizer (SANITIZE_TOOLS) over a short two-rank job, both sinks,
#                   bf16 and FP8 experts, bf16 with GEMM 2 split in K (SANITIZE_CASES)
#   make clean      remove .venv, caches and build outputs
#   make help       this text
#
# Variables (make NAME=value target):
#   NP=2            ranks for run, bench, fuzz and soak
#   BENCH_ARGS=     more arguments for python -m epserve.bench, e.g. BENCH_ARGS="--presets
#                   dsv3-decode --routing balanced"; `python -m epserve.bench --help` lists them
#   BENCH_OUT=results/h200x$(NP)   where bench writes bench.json and its plots
#   SEED=1          fuzz: the seed every case is drawn from (a case replays from SEED and its index)
#   COUNT=500       fuzz: how many cases
#   CALLS=1000      soak: how many forward calls
#   SANITIZE_TOOLS="memcheck racecheck synccheck"   sanitize: the compute-sanitizer tools to run
#                   (initcheck only when asked: it cannot see memory a peer wrote through CUDA IPC)
#   SANITIZE_CASES="bf16 fp8 bf16-split"   sanitize: the job's cases under each tool: the
#                   expert dtype, and bf16-split for bf16 with GEMM 2's split build forced

SHELL := /bin/bash
.DEFAULT_GOAL := test

VENV := .venv
STAMP := $(VENV)/.epserve-installed
NP ?= 2

# What a ready Python must import, and the MPI launcher it needs (on PATH, or beside the
# interpreter where the mpich wheel puts it, as launch/run.py looks).
READY_CHECK := import numpy, cupy, cuda.bindings, mpi4py, ml_dtypes, pytest, os, shutil, sys; \
	here = os.path.dirname(sys.executable); \
	sys.exit(0 if any(shutil.which(n) or shutil.which(n, path=here) for n in ("mpiexec", "mpirun")) else 1)

# Decided once per make run: the system python3 when it has everything, else the venv's.
SYSTEM_READY := $(shell python3 -c '$(READY_CHECK)' >/dev/null 2>&1 && echo yes)

ifeq ($(SYSTEM_READY),yes)
PY := python3
RUN_ENV :=
else
PY := $(VENV)/bin/python
# The venv's bin first, so the mpich wheel's mpiexec is the launcher the tests find.
RUN_ENV := PATH="$(CURDIR)/$(VENV)/bin:$$PATH"
endif

.PHONY: install test test-gpu run bench fuzz soak dead-peer sanitize clean help

ifeq ($(SYSTEM_READY),yes)
install:
	@echo "make install: the system python3 ($$(command -v python3)) has numpy, cupy, cuda.bindings, mpi4py, ml_dtypes, pytest and an MPI launcher: using it, installing nothing"
else
install: $(STAMP)
	@echo "make install: $(VENV) is ready (remove $(STAMP) to reinstall)"

$(STAMP): setup.cfg setup.py pyproject.toml
	@command -v python3 >/dev/null || { echo "make install: no python3 on PATH" >&2; exit 1; }
	@echo "make install: the system python3 lacks some of numpy, cupy, cuda.bindings, mpi4py, ml_dtypes, pytest or an MPI launcher: installing into $(VENV)"
	python3 -m venv $(VENV) || { echo "make install: 'python3 -m venv' failed; on Debian/Ubuntu install python3-venv" >&2; exit 1; }
	@if command -v mpiexec >/dev/null || command -v mpirun >/dev/null; then \
		echo "make install: using the MPI launcher on PATH ($$(command -v mpiexec || command -v mpirun))"; \
		extras=test; \
	else \
		echo "make install: no mpiexec/mpirun on PATH: installing epserve[mpich] (the MPICH wheel)"; \
		extras=test,mpich; \
	fi; \
	$(VENV)/bin/python -m pip install --progress-bar off -e ".[$$extras]"
	$(VENV)/bin/python -c '$(READY_CHECK)' || { echo "make install: $(VENV) is still missing a module or an MPI launcher" >&2; exit 1; }
	touch $@
endif

test: install
	$(RUN_ENV) $(PY) -m pytest -q tests

# --fail-if-all-skipped (tests/conftest.py): a GPU target that tested nothing must not pass.
test-gpu: install
	$(RUN_ENV) $(PY) -m pytest -q -m gpu --fail-if-all-skipped tests

run: install
	@$(RUN_ENV) $(PY) -m epserve.runtime.gpu_probe || { echo "make run: stopped; run it on a machine with NVIDIA Hopper GPUs" >&2; exit 1; }
	$(RUN_ENV) $(PY) launch/run.py -n $(NP) -- $(PY) -m mpi4py -m epserve.main

# Where the benchmark writes bench.json and its plots, and what else it is told.
BENCH_OUT ?= results/h200x$(NP)
BENCH_ARGS ?=

bench: install
	@$(RUN_ENV) $(PY) -m epserve.runtime.gpu_probe || { echo "make bench: stopped; run it on a machine with NVIDIA Hopper GPUs" >&2; exit 1; }
	$(RUN_ENV) $(PY) launch/run.py -n $(NP) --timeout 1800 -- $(PY) -m mpi4py -m epserve.bench --out $(BENCH_OUT) $(BENCH_ARGS)

SEED ?= 1
COUNT ?= 500
CALLS ?= 1000
# initcheck is left out: it cannot see memory a peer process initialised through CUDA IPC
# (count rows, signal counters) and reports every read of it (make sanitize SANITIZE_TOOLS=initcheck).
SANITIZE_TOOLS ?= memcheck racecheck synccheck
SANITIZE_CASES ?= bf16 fp8 bf16-split

fuzz: install
	@$(RUN_ENV) $(PY) -m epserve.runtime.gpu_probe || { echo "make fuzz: stopped; run it on a machine with NVIDIA Hopper GPUs" >&2; exit 1; }
	$(RUN_ENV) $(PY) launch/run.py -n $(NP) --timeout 3600 -- $(PY) -m mpi4py launch/jobs/fuzz.py --seed $(SEED) --start 0 --count $(COUNT) --share-gpu-ok

soak: install
	@$(RUN_ENV) $(PY) -m epserve.runtime.gpu_probe || { echo "make soak: stopped; run it on a machine with NVIDIA Hopper GPUs" >&2; exit 1; }
	$(RUN_ENV) $(PY) launch/run.py -n $(NP) --timeout 1800 -- $(PY) -m mpi4py launch/jobs/soak.py --calls $(CALLS)

dead-peer: install
	$(RUN_ENV) $(PY) -m pytest -q -rs -m gpu --fail-if-all-skipped tests/gpu/test_reliability.py -k peer

# Each tool on a short two-rank job (both sinks), once per case. memcheck needs
# --report-api-errors no: a loaded library probes driver symbols with cuGetProcAddress, and
# each refusal would count.
sanitize: install
	@command -v compute-sanitizer >/dev/null || { echo "make sanitize: compute-sanitizer is not on PATH (CUDA toolkit, e.g. /usr/local/cuda/bin)" >&2; exit 1; }
	@status=0; for tool in $(SANITIZE_TOOLS); do for case in $(SANITIZE_CASES); do \
		args="--expert-dtype $${case%-split}"; [ "$$case" = "$${case%-split}" ] || args="$$args --gemm2-split always"; \
		echo "== compute-sanitizer --tool $$tool, sanitize_job.py $$args"; \
		$(RUN_ENV) $(PY) launch/run.py -n 2 --share-gpu --timeout 600 -- compute-sanitizer --tool $$tool --report-api-errors no --error-exitcode 9 $(abspath $(shell command -v $(PY))) -m mpi4py launch/jobs/sanitize_job.py $$args || { echo "== $$tool, $$case: exit $$?"; status=1; }; \
	done; done; exit $$status

# The comment block at the top of this file, without its comment marks.
help:
	@sed -n '1,/^$$/s/^# \{0,1\}//p' $(firstword $(MAKEFILE_LIST))

clean:
	rm -rf $(VENV) .pytest_cache .cache build dist out epserve/_cuda
	find . \( -path ./.git -o -path ./shared \) -prune -o \( -name '*.egg-info' -o -name __pycache__ \) -prune -exec rm -rf {} +
