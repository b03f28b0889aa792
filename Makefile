# Everything starts from nothing: `make test` and `make demo` build .venv themselves.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: install sysdeps test lint demo bench sim clean

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt $(wildcard plugins/*/pyproject.toml) examples/driver/pyproject.toml examples/tcp/pyproject.toml
	$(MAKE) sysdeps
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[test,cli,plot,metrics,torch]' -e plugins/loopback \
		-e 'plugins/mooncake[cpu]' -e plugins/nixl -e examples/driver -e examples/tcp
	# NIXL declares torch (a multi-GB CUDA build here): install it without dependencies.
	$(BIN)/python -m pip install --quiet -c constraints.txt --no-deps nixl-cu12 nixl
	touch $(STAMP)

# System libraries the RDMA drivers load at run time (installed where we are root).
sysdeps:
	@scripts/sysdeps.sh

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

test: install lint
	$(BIN)/python -m pytest

# The main job: the tiny preset handed over by real Sessions in real processes, every byte checked.
demo: install
	$(BIN)/xferkit bench

# Every benchmarks/bench_*.py, each writing benchmarks/results/<name>.json.
bench: install
	for b in benchmarks/bench_*.py; do $(BIN)/python $$b || exit 1; done

# The simulator, longer than CI runs it (docs/reliability.md): 200,000 schedules on both cores.
sim: install
	$(BIN)/python -m xferkit.testing.sim --seeds 100000 --first 1000000 --workers 2
	$(BIN)/python -m xferkit.testing.sim --seeds 100000 --first 2000000 --workers 2 --mix

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis .ruff_cache
