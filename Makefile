# Enginekit: `make test` (lint + the whole suite, CPU) and `make run` (the demo; arrives with the FSDP backend).
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: test lint format install clean run

# The stamp is rebuilt when pyproject.toml changes, so new dependencies get installed.
$(VENV)/.installed: pyproject.toml ci/setup_venv.sh
	bash ci/setup_venv.sh $(VENV)
	touch $@

install: $(VENV)/.installed

lint: install
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

format: install
	$(PY) -m ruff check --fix .
	$(PY) -m ruff format .

test: lint
	$(PY) -m pytest $(PYTEST_ARGS)

# The demo: SFT of a tiny HF model on a digit-sorting task through the FSDP engine (configs/sft_tiny.yaml).
# Extra dot-list overrides: make run ARGS="trainer.total_steps=100 engine.micro_batch_size=8".
run: install
	$(PY) -m recipes.sft --config configs/sft_tiny.yaml $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache build *.egg-info
