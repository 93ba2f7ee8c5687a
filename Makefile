# `make test` and `make demo` work on a fresh machine that reaches PyPI only:
# they create .venv if missing and install the package with its test extras.
#
# T5X is not on PyPI. `make test T5X_WHEELS=dir` installs it from a folder of
# wheels (t5x, airio, jestimator, built from their repositories) and then
# requires every test to run: a skipped test fails the run. CI does this with
# ../shared/wheels. Without T5X_WHEELS, tests that need T5X skip unless T5X is
# installed into .venv some other way (docs/testing.md).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
T5X_WHEELS ?=
T5X_STAMP := $(VENV)/.t5x-installed
# What T5X needs besides this package's pins and does not pull in itself.
T5X_REQUIREMENTS := fiddle chex jaxtyping cached_property tensorstore grain \
	pyglove editdistance

.PHONY: install install-t5x kernel test demo demo-real bench sample-bench fuzz paper-table paper-table-records train-throughput clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# uv installs into the venv what pip would, faster (parallel downloads and
# bytecode compilation); it comes from PyPI like the rest.
$(BIN)/uv: | $(BIN)/python
	$(BIN)/python -m pip install -q -c constraints.txt uv

# constraints.txt holds the exact versions tested; setup.cfg the ranges.
PIP_INSTALL := $(BIN)/uv pip install -q --python $(BIN)/python \
	--compile-bytecode -c constraints.txt

$(STAMP): setup.cfg pyproject.toml constraints.txt | $(BIN)/uv
	$(PIP_INSTALL) -e '.[test]'
	# tensorflow-text names `tensorflow`; tensorflow-cpu provides it.
	$(PIP_INSTALL) --no-deps tensorflow-text seqio
	touch $(STAMP)

# The CPU kernels (t5x_speed/cpu/csrc), built with the system C++ compiler
# into ~/.cache/t5x_speed. Never fails: without a compiler it says so once
# and the package uses XLA's ops.
kernel: install
	$(BIN)/python -m t5x_speed.cpu

install: $(STAMP)

$(T5X_STAMP): $(STAMP) $(wildcard $(T5X_WHEELS)/*.whl)
	@test -n "$(T5X_WHEELS)" || { echo "T5X_WHEELS is not set: make install-t5x T5X_WHEELS=dir"; exit 2; }
	@ls $(T5X_WHEELS)/t5x-*.whl >/dev/null 2>&1 || { echo "No t5x wheel in T5X_WHEELS=$(T5X_WHEELS)"; exit 2; }
	$(PIP_INSTALL) $(T5X_REQUIREMENTS)
	# --no-deps: the wheels' metadata would replace this package's pins.
	$(PIP_INSTALL) --no-deps $(T5X_WHEELS)/*.whl
	$(BIN)/python -c "import t5x.train, t5x.examples.decoder_only.network"
	touch $(T5X_STAMP)

install-t5x: $(T5X_STAMP)

# pytest runs from tests/, where the tests and their helpers live. With
# T5X_WHEELS set, T5X_SPEED_REQUIRE_ALL_TESTS makes any skip an error.
# Much of each test is a single-threaded XLA compile or import, so two
# pytest-xdist workers (one per core on CI's 2 cores) finish the suite sooner
# (docs/testing.md); a test class stays on one worker (--dist loadscope), so
# it shares its setup; --no-loadscope-reorder keeps conftest.py's
# slowest-first order.
# TEST_WORKERS=0 runs everything in one process. TEST_SHARD=K/N runs the
# K-th of N disjoint parts of the suite (tests/sharding.py), for N CI jobs.
TEST_WORKERS ?= 2
TEST_SHARD ?=
test: install kernel $(if $(T5X_WHEELS),install-t5x)
	cd tests && $(if $(T5X_WHEELS),T5X_SPEED_REQUIRE_ALL_TESTS=1) \
	  ../$(BIN)/python -m pytest -q -p no:cacheprovider \
	  $(if $(filter-out 0,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder) \
	  $(if $(TEST_SHARD),--shard $(TEST_SHARD)) $(PYTEST_ARGS)

# The tools run from the repository root (tools/ is not installed). The demo
# trains its small model once into demo_out/ and reloads it on later runs
# (DEMO_ARGS="--retrain" trains again).
demo: install kernel
	$(BIN)/python -m tools.demo $(DEMO_ARGS)

# The performance tables (docs/performance.md); progress goes to stderr, e.g.
# BENCH_ARGS="--quick" or BENCH_ARGS="--quiet".
bench: install kernel
	$(BIN)/python -m tools.bench $(BENCH_ARGS)

# SPEED sampling against sequential sampling (docs/sampling.md), e.g.
# SAMPLE_BENCH_ARGS="--prompts 8".
sample-bench: install kernel
	$(BIN)/python -m tools.sample_bench $(SAMPLE_BENCH_ARGS)

# The paper's comparison on real data (docs/real_data.md): builds the gettext
# English-French set into paper_table_out/data once, trains (runs kept in
# paper_table_out/runs; an interrupted run goes on from its last checkpoint),
# decodes, replays; hours on 2 cores (docs/real_data.md); e.g.
# PAPER_TABLE_ARGS="--trainer t5x", "--data_dir /data/my_tsvs" or "--tiny".
paper-table: install kernel
	$(BIN)/python -m tools.paper_table $(PAPER_TABLE_ARGS)

# The table from the committed run records (figures/real_data/runs): each
# finished run of `make paper-table ... --records_dir figures/real_data/runs`
# writes one (docs/real_data.md#runs-land-one-by-one).
paper-table-records: install
	$(BIN)/python -m tools.paper_table_records

# The trainer's step before and now on this host (docs/real_data.md#training-
# throughput); e.g. TRAIN_THROUGHPUT_ARGS="--configs 4x3 --out /tmp/t".
train-throughput: install
	$(BIN)/python -m tools.train_throughput $(TRAIN_THROUGHPUT_ARGS)

# SPEED on the committed 4x3 that learned real text (figures/real_data/
# models): held-out sentences rebuilt from this machine's gettext catalogs,
# greedy and SPEED checked identical, BLEU, flips, speed (docs/real_data.md).
demo-real: install kernel
	$(BIN)/python -m tools.demo_real $(DEMO_REAL_ARGS)

# The exactness fuzz (docs/exactness.md): e.g. FUZZ_ARGS="--cases 10000 --seed 1".
fuzz: install kernel
	$(BIN)/python -m tools.fuzz $(FUZZ_ARGS)

clean:
	rm -rf $(VENV) *.egg-info
