# llmgw developer commands. `make run` and `make test` are the two that matter;
# both install what they need first (setup is idempotent and quick when done).

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.setup-stamp
# llama.cpp's native build (-march=native) segfaults on these machines' CPUs.
export CMAKE_ARGS ?= -DGGML_NATIVE=OFF
# Where test artifacts (screenshots, logs) go.
TEST_OUTPUT ?= $(CURDIR)/test-output
LLMGW_TEST_PG_URL ?= postgresql://postgres@127.0.0.1:5432/test
export LLMGW_TEST_PG_URL

.PHONY: setup engines oidc-provider run test lint bench bench-quick chaos soak postgres clean

setup: $(STAMP)

$(STAMP): pyproject.toml scripts/setup.sh
	@PYTHON=$(PYTHON) VENV=$(VENV) bash scripts/setup.sh
	@touch $(STAMP)

# vLLM (CPU build), llama-server, SGLang (its parsers only) and the starter model as a Hugging Face
# model, each in its own place under LLMGW_ENGINES_DIR (scripts/engines.sh):
# what tests/engines/ drives. Cached: a second run takes seconds.
LLMGW_ENGINES_DIR ?= $(HOME)/.cache/llmgw/engines
export LLMGW_ENGINES_DIR

engines: setup
	@PYTHON=$(PYTHON) VENV=$(VENV) bash scripts/engines.sh

# The OpenID Connect provider the SSO tests sign in through (tests/oidc/;
# npm, pinned by its lock file, cached under ~/.cache/llmgw/oidc-provider).
oidc-provider:
	@bash scripts/oidc-provider.sh

run: setup
	$(BIN)/llmgw up $(ARGS)

postgres:
	@bash scripts/ensure-postgres.sh

test: setup engines oidc-provider postgres
	mkdir -p $(TEST_OUTPUT)
	LLMGW_TEST_OUTPUT=$(TEST_OUTPUT) $(BIN)/pytest -q -p no:cacheprovider $(PYTEST_ARGS)

lint: setup
	$(BIN)/ruff check src tests bench deploy
	$(BIN)/mypy

# The chaos suite and the soak have their own targets: the first needs
# PostgreSQL, etcd and root, the second takes half an hour.
# Every benchmark runs, whichever fails; the exit code says whether all passed.
bench: setup
	@failed=""; for b in $(filter-out bench/chaos.py bench/soak.py,$(wildcard bench/*.py)); do \
		echo "== $$b"; $(BIN)/python $$b $(BENCH_ARGS) || failed="$$failed $$b"; done; \
	if [ -n "$$failed" ]; then echo "benchmarks that failed:$$failed"; exit 1; fi

bench-quick:
	$(MAKE) bench BENCH_ARGS=--quick

# Faults under load (bench/chaos.py); CHAOS_ARGS=--quick runs each once, briefly.
chaos: setup postgres
	$(BIN)/python bench/chaos.py $(CHAOS_ARGS)

# Mixed load on the simulated fleet for 30 minutes: do RSS, open files and
# asyncio tasks of every process stay flat? (bench/soak.py; SOAK_ARGS=--quick: 3 minutes)
soak: setup
	$(BIN)/python bench/soak.py $(SOAK_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info $(TEST_OUTPUT)
