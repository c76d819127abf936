# Two commands for a new user: `make quickstart` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup quickstart test test-fast test-dispatch lint bench clean

setup: $(STAMP)

# PyTorch's wheels from another index, e.g. its CPU-only build (no CUDA libraries, a fraction of
# the size): make setup TORCH_INDEX=https://download.pytorch.org/whl/cpu. Empty: PyPI's default.
TORCH_INDEX ?=

# Idempotent: the venv is made once and re-installed only when pyproject.toml changes. The
# editable install runs with -q -q: pip's errors still show, setuptools' banner does not.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet$(if $(TORCH_INDEX), --index-url $(TORCH_INDEX)) torch==2.14.1 torchvision==0.29.1
	$(BIN)/python -m pip install -q -q -e ".[dev]"
	touch $(STAMP)

# Stage 1 (adversarial training, live BatchNorm), then stage 2 (DAT) from its checkpoint;
# 2 CPU processes each. Results: runs/quickstart/stage2/metrics.jsonl and samples/.
quickstart: setup
	OMP_NUM_THREADS=1 $(BIN)/torchrun --standalone --nproc_per_node=2 InNOutRobustnessMean0_cifar100/train_at.py experiments/quickstart/digits_stage1.yaml run_dir=runs/quickstart/stage1
	OMP_NUM_THREADS=1 $(BIN)/torchrun --standalone --nproc_per_node=2 -m rebm.training.train experiments/quickstart/digits_stage2.yaml run_dir=runs/quickstart/stage2

# The whole suite (what CI runs), and the inner-loop tier without the tests marked `slow` (those
# that start training runs or several processes). Two pytest-xdist workers, one test file each at
# a time: most tests wait on processes they started, so two files share the cores well. Files
# start in the order tests/conftest.py gives them (longest first), not by their number of tests.
# Every process computes on one thread: the workers fill the cores already, and a second OpenMP
# thread per process only spins (measured: 1169 instead of 1403 CPU-seconds for the suite).
TEST_WORKERS ?= 2
test: setup
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

test-fast: setup
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder -m "not slow"

# The tests that compare numbers (marked `numbers`) again, with PyTorch, oneDNN and MKL forced
# below this CPU's own kernels: bits belong to a machine, so a test that passes only with the
# kernels it was written on fails here (docs/design.md §7, numbers and machines). tests.dispatch
# first checks that the forcing took (ATen ignores a value it does not know without a word).
FORCED_DISPATCH := ATEN_CPU_CAPABILITY=default ONEDNN_MAX_CPU_ISA=SSE41 MKL_ENABLE_INSTRUCTIONS=SSE4_2
test-dispatch: setup
	$(FORCED_DISPATCH) $(BIN)/python -m tests.dispatch
	$(FORCED_DISPATCH) OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder -m numbers

lint: setup
	$(BIN)/ruff check rebm tests benchmarks InNOutRobustnessMean0_cifar100
	$(BIN)/lint-imports

bench: setup
	$(BIN)/python benchmarks/run_all.py

clean:
	rm -rf $(VENV) runs .pytest_cache
