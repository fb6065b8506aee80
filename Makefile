# Quick start: `make run` and `make test` set up .venv themselves on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
SHARED_DATA := ../shared/datasets
# MNIST from ../shared when it is there, else ./data with a torchvision download.
DATA_ARGS := $(if $(wildcard $(SHARED_DATA)/MNIST/raw/train-images-idx3-ubyte),--set data_cache_dir=$(SHARED_DATA),--set data_cache_dir=./data --set download=true)

.PHONY: setup run test test-fast lint bench-speed table1 clean
setup: $(STAMP) data/MNIST

# The shipped YAMLs read ./data (data_args.data_cache_dir); where ../shared/datasets exists,
# ./data/MNIST links to it, so the README's commands work as written on a fresh clone.
data/MNIST:
	@if [ -d $(SHARED_DATA)/MNIST ]; then mkdir -p data && ln -s ../$(SHARED_DATA)/MNIST data/MNIST && \
		echo "data/MNIST -> $(SHARED_DATA)/MNIST"; fi

# TORCH_INDEX: a PyTorch wheel index to take torch 2.13.0 from (a CUDA version's; docs/fedml.md,
# "On a CUDA machine"); unset, pip's own configuration decides.
TORCH_INDEX ?=
$(STAMP): setup.py constraints.txt fedml_perfedavg_torchvision.pth
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --no-compile --disable-pip-version-check -c constraints.txt "setuptools<81" wheel
	# torch is named explicitly (==2.13.0) so pip never resolves a newer build.
	$(PY) -m pip install -q --no-compile --disable-pip-version-check -c constraints.txt $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX)) torch==2.13.0 -e ".[mpi,silo,dp,bench,test]"
	# The bytecode pip would write, one file after another (half of the install's 100 s), written on
	# every core instead. As pip does, files that this Python cannot compile are passed over: torch's
	# tests for Python 3.12 syntax. Not the packages' own tests, nor packages nothing here imports
	# (FedML's dependencies pandas, sklearn, onnx, sqlalchemy; pip's tools): 6,800 of 16,100 files,
	# 35 s of CPU instead of 43 (2026-11-29); Python compiles a module on its first import anyway.
	$(PY) -m compileall -qq -j 0 -x '/(tests?|pandas|sklearn|onnx|sqlalchemy|narwhals|pygments|pip|setuptools)/' \
		"$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" || true
	# An editable install does not ship the .pth a wheel install puts in site-packages (setup.py):
	# it makes `import fedml` work before `import fedml_perfedavg`.
	cp fedml_perfedavg_torchvision.pth "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
	touch $@

run: $(STAMP) data/MNIST
	@echo "Per-FedAvg (HF), MNIST, 200 rounds: expect personalized_accuracy=0.5491 in about a minute (benchmarks/RESULTS.md)"
	$(VENV)/bin/fedml-perfedavg --cf yaml_configs/quickstart_mnist_hf.yaml $(DATA_ARGS)

# TEST_WORKERS: pytest-xdist workers (docs/testing.md); 0 runs the suite in one process.
TEST_WORKERS ?= 4
test: $(STAMP) data/MNIST
	# The package's and the tests' bytecode, written once rather than in each of the few hundred
	# processes the suite starts (an editable install compiles nothing; under PYTHONDONTWRITEBYTECODE
	# each process would compile every module it imports). Up-to-date files are passed over.
	$(PY) -m compileall -q -j 0 fedml_perfedavg tests benchmarks examples > /dev/null
	$(PY) -m pytest -q -n $(TEST_WORKERS) --maxschedchunk 1 --durations=30 tests

# Unit and property checks only (no FedML loops, MPI, gRPC, subprocesses or real datasets; tests/conftest.py
# makes a fast test that does one of those fail), on FAST_WORKERS xdist workers of one torch thread each.
FAST_WORKERS ?= 2
test-fast: $(STAMP)
	$(PY) -m pytest -q -n $(FAST_WORKERS) -m fast tests

# ruff (lint and format) and mypy, pinned in requirements-lint.txt, in a venv of their own; mypy
# reads the test venv's packages (torch's types). Configured in ruff.toml and mypy.ini.
LINT_VENV := .venv-lint
$(LINT_VENV)/.installed: requirements-lint.txt
	$(PYTHON) -m venv $(LINT_VENV)
	$(LINT_VENV)/bin/pip install -q --disable-pip-version-check -r requirements-lint.txt
	touch $@

lint: $(STAMP) $(LINT_VENV)/.installed
	$(LINT_VENV)/bin/ruff check .
	$(LINT_VENV)/bin/ruff format --check .
	$(LINT_VENV)/bin/mypy --python-executable $(PY)

# Per-client path, vmap and default engine paths (with spread), scaling, a 1000-round run; then grid
# mode against separate runs. Results in benchmarks/results/speed.md and grid_speed.md.
bench-speed: $(STAMP)
	$(PY) benchmarks/speed.py --full-run
	$(PY) benchmarks/grid_speed.py

# Table 1 grid (MNIST cells, 4 methods + FedAvg+ARUBA where its YAML is, 5 seeds, K=1000), logged to
# offline wandb runs, with the stationarity measure; resumable. CIFAR-10: add --datasets mnist cifar10.
table1: $(STAMP)
	$(PY) benchmarks/table1.py --jobs 2 --wandb --set stationarity_every=100 $(DATA_ARGS)

clean:
	rm -rf $(VENV) $(LINT_VENV) runs *.egg-info
