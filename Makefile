# Dev/CI environment. TORCH_SPEC is pinned to the CPU build that lies on this
# machine's disk (an unpinned torch pulls a multi-GB CUDA build); override it
# on a machine with CUDA: make install TORCH_SPEC="torch==2.5.1"
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
# make test runs the suite on this many processes (pytest-xdist; one test file per process at a
# time, so a file's module fixtures are built once; the slowest files first, tests/conftest.py):
# the dev machine has 2 cores.
TEST_WORKERS ?= 2
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install test bench-tests demo bench lint clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $(STAMP)

test: install
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder -m "not bench"

# The slow checks that repeat what a faster test shows on another size or model (marked
# bench: pyproject.toml); make bench runs them first.
bench-tests: install
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m bench

demo: install
	$(BIN)/taichi-plan record --model gpt2 --layers 4 --hidden 256 --heads 4 --vocab 8192 \
		--seq 256 --batch 8 -o traces/demo-gpt2 --force
	$(BIN)/taichi-plan inspect traces/demo-gpt2
	$(BIN)/taichi-plan solve traces/demo-gpt2 --budget 50% --time-limit 20 \
		-o plans/demo-gpt2.plan.json --force
	$(BIN)/taichi-plan inspect plans/demo-gpt2.plan.json --png plans/demo-gpt2.png --force

bench: bench-tests
	$(BIN)/python -m benchmarks.run

lint: install
	$(BIN)/ruff check taichi_plan tests benchmarks

clean:
	rm -rf $(VENV) .pytest_cache
