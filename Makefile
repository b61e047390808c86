# Two commands on a fresh machine with Python >= 3.10 and pip:
#   make pretrain   set up .venv, build the default corpus + tokenizer + token files, train configs/default.yaml offline
#   make test       set up .venv, run the test suite (make test-fast: unit tests only)
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
NPROC := $(shell nproc 2>/dev/null || echo 1)

.PHONY: setup pretrain smoke test test-fast test-durations benchmark lint slurm-cluster clean

setup: $(STAMP)

$(STAMP): requirements.txt pyproject.toml
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -r requirements.txt
	$(BIN)/python -m pip install --quiet --no-deps -e .
	touch $(STAMP)

# Offline: the default corpus (Python's standard library source), its tokenizer and its token files
# (datatrove pipeline, data/prepare.py) are built locally on first use and cached in ~/.cache/lmpretrain.
# `python -m lmpretrain.launch` = `accelerate launch`, except that a user error ends on its message (exit 2).
pretrain: setup
	HF_HUB_OFFLINE=1 WANDB_MODE=offline $(BIN)/python -m lmpretrain.launch --config_file configs/accelerate/cpu.yaml \
		recipes/pretrain.py configs/default.yaml --logging.wandb_mode=offline $(ARGS)

smoke: setup
	HF_HUB_OFFLINE=1 $(BIN)/python -m lmpretrain.launch --config_file configs/accelerate/cpu.yaml \
		recipes/pretrain.py configs/smoke.yaml $(ARGS)

# pytest-xdist workers: most tests wait on process start-up (imports, rendezvous, W&B's service), so two
# workers keep two cores busy. A test that starts 2 ranks uses 2 cores, hence one worker per 2 cores
# beyond that. --dist loadfile: a test file runs on one worker, so its module-scoped runs are made once
# (a session-scoped run that several files read, e.g. two_ranks_accum2, is made once per worker that
# needs it). --no-loadscope-reorder: files go out longest first, as tests/conftest.py orders them from
# tests/durations.jsonl (make test-durations rewrites it). TEST_WORKERS=0 runs the suite in this one
# process; PYTEST_ARGS come last (e.g. "-k resume").
TEST_WORKERS ?= $(shell n=$$(( $(NPROC) / 2 )); [ $$n -lt 2 ] && n=2; echo $$n)
PYTEST := HF_HUB_OFFLINE=1 WANDB_MODE=offline $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

test: setup
	$(PYTEST) $(PYTEST_ARGS)

# The quick lane: unit tests only (no test marked slow, i.e. none that launches the recipe or several processes).
test-fast: setup
	$(PYTEST) -m "not slow" $(PYTEST_ARGS)

# Each test's CPU seconds (its child processes included), the order make test hands files out in.
test-durations: setup
	rm -f tests/durations.jsonl.new
	LMPRETRAIN_TEST_CPU_LOG=$(CURDIR)/tests/durations.jsonl.new $(PYTEST) $(PYTEST_ARGS)
	sort tests/durations.jsonl.new > tests/durations.jsonl && rm tests/durations.jsonl.new

benchmark: setup
	$(BIN)/python scripts/benchmark.py configs/default.yaml

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# A real single-node SLURM on this machine (root; Debian's slurm-wlm, slurmdbd, munge and mariadb-server
# packages): munged, slurmctld, slurmd and slurmdbd on localhost. The tests marked `slurm` run when its
# sinfo answers and are skipped otherwise (LMPRETRAIN_REQUIRE_SLURM=1, set by .ci/run: they fail instead).
slurm-cluster:
	scripts/slurm/local_cluster.sh

clean:
	rm -rf runs .pytest_cache
