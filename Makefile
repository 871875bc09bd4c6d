# Enginekit: `make test` (lint + the whole suite, CPU) and `make run` (the PPO demo); `make sft` (the SFT demo).
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=
# pytest-xdist workers for `make test` (2: CI's cores); whole test files go to one worker
# (--dist loadfile), so a module's shared fixtures are built once. docs/testing.md: why and measured.
TEST_WORKERS ?= 2

.PHONY: test test-fast lint format install clean run sft bench gpu-check gpu-wheels mutate constraints

# The stamp is rebuilt when pyproject.toml or the pins change, so new dependencies get installed.
$(VENV)/.installed: pyproject.toml ci/setup_venv.sh ci/constraints.txt
	bash ci/setup_venv.sh $(VENV)
	touch $@

# What the demos need alone (`make run`, `make sft`): the project and its core dependencies, at
# the pinned versions; a fresh machine starts the demo in minutes. `make test` installs the rest.
$(VENV)/.installed-run: pyproject.toml ci/setup_venv.sh ci/constraints.txt
	bash ci/setup_venv.sh $(VENV) run
	touch $@

install: $(VENV)/.installed

lint: install
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

format: install
	$(PY) -m ruff check --fix .
	$(PY) -m ruff format .

# The whole suite; ends with the 25 slowest tests, the costliest files, the fixed costs and the total.
test: lint
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --durations=25 $(PYTEST_ARGS)

# The inner loop while developing: every test that starts no process (ranks, scripts, servers), in
# a few minutes; the others are skipped with the reason. CI runs everything (`make test`).
test-fast: install
	$(PY) -m pytest --in-process -n $(TEST_WORKERS) --dist loadfile -q -rfE $(PYTEST_ARGS)

# Regenerate ci/constraints.txt (the CI environment's exact versions) from a fresh resolve; then
# run the suite on it and commit the file only if green (docs/testing.md: when and how to bump).
constraints:
	bash ci/regen_constraints.sh

# The demo: PPO (critic + GAE) on a digit-sorting task through the roles and the FSDP engine
# (configs/ppo_tiny.yaml). Overrides: make run ARGS="engine.strategy=megatron trainer.total_steps=60";
# GRPO: make run ARGS="--config configs/grpo_tiny.yaml".
run: $(VENV)/.installed-run
	$(PY) -m recipes.ppo $(if $(findstring --config,$(ARGS)),,--config configs/ppo_tiny.yaml) $(ARGS)

# Supervised fine-tuning of the same tiny model (configs/sft_tiny.yaml): make sft ARGS="...".
sft: $(VENV)/.installed-run
	$(PY) -m recipes.sft --config configs/sft_tiny.yaml $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache build *.egg-info

# Benchmarks (engine vs hand-written baselines, as ratios): regenerates BENCHMARKS.md's tables on
# CPU (slow; not in CI); the GPU row runs when CUDA is present. Extra flags: make bench ARGS="--quick".
bench: install
	$(PY) -m benchmarks.run_all $(ARGS)

# Every GPU-only path in one go, one report (benchmarks/gpu_check.py), within 8 minutes on one
# H200: the gpu-marked tests (bf16 FSDP vs Megatron, offload, ...; modules that need an optional
# extra the machine lacks are skipped), then the throughput rows: the hand-written FSDP2 loop, the
# FSDP engine (compile off and on) and megatron, with tokens/s, MFU and the engine/loop ratio. On
# a bare GPU machine (Python 3.12 + CUDA torch) carry the wheels of `make gpu-wheels` (.whl/)
# along; without CUDA it runs its CPU smoke mode. Options: make gpu-check ARGS="--budget 600".
gpu-check:
	bash ci/gpu_check.sh $(ARGS)

# The wheels gpu-check needs beyond the GPU image, at ci/constraints.txt's pins, into .whl/.
gpu-wheels:
	bash ci/gpu_wheels.sh

# Mutation testing (mutmut) of the modules in pyproject.toml [tool.mutmut] against the fast tests;
# slow, not part of `make test`. One module alone: MUTATE_ONLY="engine_api/batch.py" make mutate.
# Raw per-mutant results: outputs/mutation/results.txt (git-ignored); summary and survivors: docs/mutation.md.
mutate: install
	bash ci/mutate.sh $(VENV)
