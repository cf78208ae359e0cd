# make lab   installs what is missing, then opens JupyterLab on the lab
# make test  installs what is missing, then runs every test and every notebook
# make serve installs what is missing, then serves the target model over HTTP (lab 09), on 127.0.0.1:8000
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# installed: the lab (what a student's notebooks and the server need); or the lab and what the tests need besides
STAMP := $(VENV)/.labkit-installed
TEST_STAMP := $(VENV)/.labkit-test-installed
LAB_ARGS ?=
# jupyter refuses to run as root unless told; containers often run as root
ROOT_ARGS := $(if $(filter 0,$(shell id -u)),--allow-root)
PYTEST_ARGS ?=
# Tests and notebooks run in WORKERS processes (pytest-xdist), a whole test file or a whole lab's two
# notebooks to each (loadfile, as tests/conftest.py splits it: a file's fixtures are built once), each
# process with THREADS torch threads, so that the workers share the cores instead of fighting over them.
# WORKERS=1 runs them one by one.
WORKERS ?= 2
THREADS ?= 1
PARALLEL := $(if $(filter-out 1,$(WORKERS)),-n $(WORKERS) --dist loadfile)
SHARE_CORES := $(if $(filter-out 1,$(WORKERS)),OMP_NUM_THREADS=$(THREADS))

.PHONY: install lab serve test test-unit test-notebooks test-browser release grade clean

install: $(STAMP)

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# constraints.txt pins torch so a CPU machine never pulls the CUDA build.
# pip would compile every installed module to bytecode one file at a time, most of an install's time;
# COMPILE does it on every core (BENCHMARKS.md, "CI time on a slower day, and the install"). Like pip, it skips
# what is not this Python's syntax (torch ships a test file for 3.12) and keeps its warnings to itself.
COMPILE = $(BIN)/python -W ignore -m compileall -q -j 0 $(VENV)/lib > /dev/null || $(BIN)/python -c pass
# One pip run a stamp: make test installs the test tools with the lab, not after it, since a second run would
# resolve every requirement again and COMPILE walk the whole venv again (BENCHMARKS.md, "The install in one pip
# run"); so its stamp stands for the lab's install too.
LAB_EXTRAS := lab,serve
TEST_EXTRAS := $(LAB_EXTRAS),test
define INSTALL
	$(BIN)/python -m pip install --upgrade pip
	$(BIN)/python -m pip install --no-compile -c constraints.txt -e ".[$(1)]"
	$(COMPILE)
	$(BIN)/python -m ipykernel install --sys-prefix --name labkit --display-name "Python (labkit)"
endef

$(STAMP): pyproject.toml constraints.txt | $(BIN)/python
	$(call INSTALL,$(LAB_EXTRAS))
	touch $@

$(TEST_STAMP): pyproject.toml constraints.txt | $(BIN)/python
	$(call INSTALL,$(TEST_EXTRAS))
	touch $(STAMP) $@

lab: $(STAMP)
	$(BIN)/jupyter lab notebooks/00_welcome.ipynb $(ROOT_ARGS) $(LAB_ARGS)

# SERVE_ARGS: more options of python -m labkit.serve, e.g. SERVE_ARGS="--port 8001 --api-key secret"
SERVE_ARGS ?=
serve: $(STAMP)
	$(BIN)/python -m labkit.serve --model $(or $(MODEL),target) $(SERVE_ARGS)

# The unit tests and the notebooks in one run, the notebooks handed out first and the test files around
# them (tests/conftest.py), so that neither waits for the other's last file; then the browser tests.
test: $(TEST_STAMP)
	$(SHARE_CORES) $(BIN)/python -m pytest tests -m "not browser" $(PARALLEL) --durations=20 $(PYTEST_ARGS)
	$(MAKE) test-browser

test-unit: $(TEST_STAMP)
	$(SHARE_CORES) $(BIN)/python -m pytest tests -m "not browser and not notebook" $(PARALLEL) --durations=10 $(PYTEST_ARGS)

# One kernel per lab (tests/test_notebooks.py): solutions/ whole with LABKIT_STRICT=1, so a failing
# inline check fails the run, then notebooks/ from its first exercise on, every exercise still a stub
# (its cells before that are the solution's).
test-notebooks: $(TEST_STAMP)
	$(SHARE_CORES) $(BIN)/python -m pytest tests/test_notebooks.py -m notebook $(PARALLEL) --durations=13 $(PYTEST_ARGS)

# the browser tests drive JupyterLab, which starts kernels of its own: they run on their own, last;
# their file alone, since collecting every test file imports the rest of labkit for nothing (15 s)
test-browser: $(TEST_STAMP)
	$(BIN)/python -m pytest tests/test_browser.py -m browser $(PYTEST_ARGS)

release: $(STAMP)
	$(BIN)/python -m labkit.release

grade: $(STAMP)
	$(BIN)/python -m labkit.grade $(or $(SUBMISSIONS),notebooks) $(GRADE_ARGS)

clean:
	rm -rf $(VENV) grades .pytest_cache
