# Entry points for a new user on a fresh Debian/Ubuntu machine:
#   make run    set up (venv, install, dataset) and run the default pipeline (dvc repro)
#   make test   set up and run the test suite
#   make test-fast   the suite without the slow end-to-end tests (pytest -m slow: dvc repro, servers, ...)
# All are idempotent: set-up steps are skipped once done.

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(CURDIR)/$(VENV)/bin
DATASET := /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
export PATH := $(BIN):$(PATH)
export MLFLOW_DISABLE_TELEMETRY := true
export DO_NOT_TRACK := true

.PHONY: run test test-fast setup compiler bench clean-venv

run: setup
	dvc repro
	python -m stages.report --show

# Two workers, a test file each at a time (a module's fixtures, such as the pipeline's one dvc repro, are
# built once): much of the suite waits on subprocesses and servers, so the second core would idle otherwise.
PYTEST := python -m pytest -q -n 2 --dist loadfile

test: setup
	$(PYTEST)

# cuda: deselected too, so a GPU machine's run stays as quick (bench/gpu.py runs those tests there)
test-fast: setup
	$(PYTEST) -m "not slow and not cuda"

setup: $(VENV)/.installed $(DATASET) compiler

# The venv holds torch's CUDA build (the only torch/torchvision pair that installs here): it
# measured 6.4 GiB (du -sk .venv, 2026-11-24). Check the disk first, so a full disk fails in a
# second with the figure instead of minutes later inside pip with "Errno 28".
VENV_NEED_KIB := 7340032

$(VENV)/.installed: pyproject.toml constraints.txt
	@free=$$(df --output=avail -k . | tail -n 1); [ "$$free" -ge $(VENV_NEED_KIB) ] || { \
		echo "not enough disk for $(VENV): $$((free / 1048576)) GiB free in $(CURDIR), $$(($(VENV_NEED_KIB) / 1048576)) GiB needed" \
		     "(torch's CUDA build is 6.4 GiB): free some space, e.g. old clones or ~/.cache/pip"; exit 1; }
	$(PYTHON) -m venv $(VENV) || { echo "python3-venv missing: $(SUDO) apt-get install -y python3-venv"; exit 1; }
	$(BIN)/python -m pip install --upgrade --quiet pip
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[dev]'
	touch $@

$(DATASET):
	$(SUDO) apt-get update -qq
	$(SUDO) apt-get install -y -qq dataset-fashion-mnist

# BitTrain's C++ bitmap kernel is compiled on first use (edgeflux/bittrain/kernel.py); without a
# compiler edgeflux still works, on a slower torch-op path.
compiler:
	@command -v g++ >/dev/null || { $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq g++; } \
		|| echo "g++ could not be installed: BitTrain runs on its slower torch-op path"

bench: setup
	python -m bench.memory_baseline

clean-venv:
	rm -rf $(VENV)
