# Every target sets up .venv itself (re-installing when pyproject.toml changes), so a fresh
# clone needs only python3 (3.11+, as pyproject.toml requires) and make.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The official TensorFlow Serving client lives apart from our code: both define the same protos.
OFFICIAL := $(VENV)/official
OFFICIAL_STAMP := $(OFFICIAL)/.installed
# Triton's client (the Open Inference Protocol tests) apart too: it registers the same `inference`
# proto symbols as our generated code, and pins protobuf<7, which TensorFlow 2.21 does not use.
# Its own needs (grpcio, numpy, protobuf, packaging, urllib3) are already in .venv.
TRITON := $(VENV)/tritonclient
TRITON_STAMP := $(TRITON)/.installed
# Triton's C++ load generator, perf_analyzer: shipped only in the tritonclient 2.40.0 wheel. It links
# libcudart.so.12 (from NVIDIA's runtime wheel, on LD_LIBRARY_PATH for that binary alone; no GPU
# needed) and Debian's libb64.
PERF := $(VENV)/perf_analyzer
PERF_STAMP := $(PERF)/.installed
# TensorFlow with CUDA (the `gpu` extra), for `make gpu-check` only.
GPU_STAMP := $(VENV)/.installed-gpu
export TF_CPP_MIN_LOG_LEVEL ?= 2
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: serve test bench bench-frontends versus soak gpu-check lint typecheck protos protos-check clean prometheus image

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $@

$(OFFICIAL_STAMP): $(STAMP)
	$(PY) -m pip install --quiet --no-deps --target $(OFFICIAL) tensorflow-serving-api==2.21.0
	touch $@

$(TRITON_STAMP): $(STAMP)
	$(PY) -m pip install --quiet --no-deps --target $(TRITON) tritonclient==2.73.0 python-rapidjson==1.25
	touch $@

$(PERF_STAMP): $(STAMP)
	@ldconfig -p 2>/dev/null | grep -q libb64.so.0d || { echo "installing Debian's libb64-0d"; \
	  $(SUDO) apt-get install -y -qq libb64-0d >/dev/null 2>&1 || { $(SUDO) apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq libb64-0d >/dev/null; }; }
	$(PY) -m pip install --quiet --no-deps --target $(PERF) tritonclient==2.40.0 nvidia-cuda-runtime-cu12==12.1.105
	printf '#!/bin/sh\nhere=$$(dirname "$$(readlink -f "$$0")")\nLD_LIBRARY_PATH="$$here/nvidia/cuda_runtime/lib" exec "$$here/bin/perf_analyzer" "$$@"\n' > $(PERF)/perf_analyzer
	chmod +x $(PERF)/perf_analyzer
	touch $@

$(GPU_STAMP): $(STAMP)
	$(PY) -m pip install --quiet -e '.[dev,gpu]'
	touch $@

serve: $(STAMP)
	$(PY) -m server $(ARGS)

# Debian's Prometheus, for the test that scrapes the server with a real one.
prometheus:
	@command -v prometheus >/dev/null || { \
	  echo "installing Debian's prometheus package"; \
	  $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends prometheus >/dev/null; }

test: $(STAMP) $(OFFICIAL_STAMP) $(TRITON_STAMP) $(PERF_STAMP) prometheus
	$(PY) -m protos.build --check
	$(PY) -m ruff check .
	$(PY) -m mypy server client bench protos/build.py
	OFFICIAL_CLIENT_PATH=$(abspath $(OFFICIAL)) TRITON_CLIENT_PATH=$(abspath $(TRITON)) \
	  PERF_ANALYZER=$(abspath $(PERF))/perf_analyzer $(PY) -m pytest -q --durations=15 $(PYTEST_ARGS)

# The performance tables and goals (build/bench/results.md, frontends-mlp.md, latency-target.md): about 45
# minutes; run it on a quiet machine.
bench: $(STAMP) $(PERF_STAMP)
	PERF_ANALYZER=$(abspath $(PERF))/perf_analyzer $(PY) -m bench.suite $(BENCH_ARGS)
	PERF_ANALYZER=$(abspath $(PERF))/perf_analyzer $(PY) -m bench.frontends --out build/bench $(FRONTENDS_ARGS)
	$(PY) -m bench.latency_target --out build/bench $(TARGET_ARGS)

# The front-ends table alone (build/bench/frontends-mlp.md; about 6 minutes): --frontends 1, 2 and 4
# driven by perf_analyzer, a connection per caller (bench/frontends.py).
bench-frontends: $(STAMP) $(PERF_STAMP)
	PERF_ANALYZER=$(abspath $(PERF))/perf_analyzer $(PY) -m bench.frontends --out build/bench $(FRONTENDS_ARGS)

# This build against another revision, or against itself with other flags, served side by side and
# measured in turns (bench/versus.py), e.g. make versus REV=main VERSUS_ARGS="--model cnn
# --concurrency 1,16 --server-flags '--replicas 2'", or REV= VERSUS_ARGS="--other-flags '...'"
REV ?= main
versus: $(STAMP)
	$(PY) -m bench.versus $(REV) $(VERSUS_ARGS)

# The replica path on a real GPU (bench/gpu_check.py; about 5 minutes): one table, exit 1 on a
# failed check. Without a GPU, a dry run on 2 logical CPU devices (`make test` runs it short).
gpu-check: $(GPU_STAMP) $(OFFICIAL_STAMP) $(TRITON_STAMP) $(PERF_STAMP)
	OFFICIAL_CLIENT_PATH=$(abspath $(OFFICIAL)) TRITON_CLIENT_PATH=$(abspath $(TRITON)) \
	  PERF_ANALYZER=$(abspath $(PERF))/perf_analyzer PYTHONUNBUFFERED=1 $(PY) -m bench.gpu_check $(GPU_CHECK_ARGS)

# Full-length load tests: the same tests `make test` runs short.
soak: $(STAMP)
	SOAK_REQUESTS=$${SOAK_REQUESTS:-400000} OVERLOAD_SECONDS=$${OVERLOAD_SECONDS:-120} \
	  $(PY) -m pytest -q -s -m slow tests/integration $(PYTEST_ARGS)

# The container image (deploy/Dockerfile); VARIANT=gpu for TensorFlow with CUDA. Needs docker or podman.
VARIANT ?= cpu
ENGINE ?= $(shell command -v docker || command -v podman)
image:
	@test -n "$(ENGINE)" || { echo "make image needs docker or podman"; exit 1; }
	$(ENGINE) build -f deploy/Dockerfile --build-arg VARIANT=$(VARIANT) -t mirrorserve:$(VARIANT) .

lint: $(STAMP)
	$(PY) -m ruff check .

typecheck: $(STAMP)
	$(PY) -m mypy server client bench protos/build.py

protos: $(STAMP)
	$(PY) -m protos.build

protos-check: $(STAMP)
	$(PY) -m protos.build --check

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
