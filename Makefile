SHELL := /bin/bash

PYTHON ?= python3
VENV ?= .venv
PY := $(if $(VENV),$(VENV)/bin/python,$(PYTHON))
TORCH_VERSION ?= 2.13.0
TORCH_INDEX ?=
OPEN_UNLEARNING_URL ?= https://github.com/locuslab/open-unlearning
OPEN_UNLEARNING_COMMIT := d3d7cf9e6b3c125d16687d4232680d8d83548f1a
OPEN_UNLEARNING_DIR ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/palu-trainer/open-unlearning
SHARED ?= $(abspath ../shared)

export PY TORCH_VERSION TORCH_INDEX OPEN_UNLEARNING_URL OPEN_UNLEARNING_COMMIT OPEN_UNLEARNING_DIR

.PHONY: setup test lint format demo

# make demo [FAST=1] [DATA=tofu [TOFU_DIR=...]] [RUN=name]: the offline miniature experiment, results/<run>/
DATA ?= synthetic
TOFU_DIR ?= $(SHARED)/data/tofu

setup:
	@if [ -n "$(VENV)" ] && [ ! -x "$(PY)" ]; then $(PYTHON) -m venv $(VENV); fi
	@bash scripts/setup.sh

test:
	PALU_SHARED=$(SHARED) $(PY) -m pytest -ra tests

lint:
	$(PY) -m ruff check src tests scripts
	$(PY) -m ruff format --check src tests scripts

format:
	$(PY) -m ruff check --fix src tests scripts
	$(PY) -m ruff format src tests scripts

demo:
	$(PY) -m palu_trainer.demo --data $(DATA) $(if $(FAST),--fast) $(if $(RUN),--run $(RUN)) \
		$(if $(JOBS),--jobs $(JOBS)) $(if $(filter tofu,$(DATA)),--tofu-dir $(TOFU_DIR))
