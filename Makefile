# Two commands for a new user: `make quickstart` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup quickstart test test-fast test-recipes test-dispatch test-oldest lint bench clean

setup: $(STAMP)

# The torch pair `make setup` installs: the upper end of the supported range (pyproject.toml,
# torch 2.8 to 2.14), which `make test` runs on; `make test-oldest` builds .venv-oldest with the
# lower end. TORCH_INDEX: PyTorch's wheels from another index, e.g. its CPU-only build (no CUDA
# libraries) https://download.pytorch.org/whl/cpu or a CUDA build for an older driver
# (.../whl/cu126, cu128, cu129, cu130; README). Empty: pip's configured index (PyPI).
TORCH ?= 2.14.1
TORCHVISION ?= 0.29.1
TORCH_INDEX ?=
# SYSTEM_TORCH=1: the venv sees the system's packages and keeps the torch and torchvision
# installed there (a cluster's module, a container's build); pip refuses them, in its own
# words, when they are outside the supported range, instead of replacing them.
SYSTEM_TORCH ?=
KEEP_TORCH := $(filter 1,$(SYSTEM_TORCH))
OLDEST_TORCH := 2.8.0
OLDEST_TORCHVISION := 0.23.0

# Idempotent: the venv is made once and re-installed only when pyproject.toml changes. The
# editable install runs with -q -q: pip's errors still show, setuptools' banner does not.
# setuptools >= 77 reads the license field (pyproject.toml) for pip's --no-build-isolation.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv$(if $(KEEP_TORCH), --system-site-packages) $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip "setuptools>=77"
ifeq ($(KEEP_TORCH),)
	$(BIN)/python -m pip install --quiet$(if $(TORCH_INDEX), --index-url $(TORCH_INDEX)) torch==$(TORCH) torchvision==$(TORCHVISION)
	$(BIN)/python -m pip install -q -q -e ".[dev]"
else
	$(BIN)/python -c "import importlib.util as u, sys; absent = [m for m in ('torch', 'torchvision') if u.find_spec(m) is None]; absent and sys.exit(f'SYSTEM_TORCH=1: no {\" and \".join(absent)} in {sys.executable}; install them there, or leave SYSTEM_TORCH unset'); import torch, torchvision; print(f'torch=={torch.__version__}'); print(f'torchvision=={torchvision.__version__}')" > $(VENV)/system-torch.txt
	$(BIN)/python -m pip install -q -q -c $(VENV)/system-torch.txt -e ".[dev]"
endif
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
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder -m "not recipes"

test-fast: setup
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder -m "not slow and not recipes"

# Every shipped recipe end to end on stand-in data (python -m rebm.standin, docs/first_hour.md),
# one command per dataset, in one process: each command runs 2 training processes already.
test-recipes: setup
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -m recipes tests/test_standin_recipes.py

# The tests that compare numbers (marked `numbers`) again, with PyTorch, oneDNN and MKL forced
# below this CPU's own kernels: bits belong to a machine, so a test that passes only with the
# kernels it was written on fails here (docs/design.md §7, numbers and machines). tests.dispatch
# first checks that the forcing took (ATen ignores a value it does not know without a word).
FORCED_DISPATCH := ATEN_CPU_CAPABILITY=default ONEDNN_MAX_CPU_ISA=SSE41 MKL_ENABLE_INSTRUCTIONS=SSE4_2
test-dispatch: setup
	$(FORCED_DISPATCH) $(BIN)/python -m tests.dispatch
	$(FORCED_DISPATCH) OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder -m numbers

# The fast tier and the tests of the bridges between torch releases (marked `bridge`) on the
# oldest supported torch, in its own venv (a second CUDA build of torch from PyPI, ~7 GB).
test-oldest:
	$(MAKE) --no-print-directory setup VENV=.venv-oldest TORCH=$(OLDEST_TORCH) TORCHVISION=$(OLDEST_TORCHVISION) SYSTEM_TORCH= TORCH_INDEX=$(TORCH_INDEX)
	.venv-oldest/bin/python -c "import sys, torch; torch.__version__.startswith('$(OLDEST_TORCH)') or sys.exit(f'.venv-oldest holds torch {torch.__version__}, not $(OLDEST_TORCH): rm -rf .venv-oldest and run make test-oldest again')"
	OMP_NUM_THREADS=1 .venv-oldest/bin/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder -m "not slow or bridge"

lint: setup
	$(BIN)/ruff check rebm tests benchmarks InNOutRobustnessMean0_cifar100
	$(BIN)/lint-imports

bench: setup
	$(BIN)/python benchmarks/run_all.py

clean:
	rm -rf $(VENV) .venv-oldest runs .pytest_cache
