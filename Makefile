# The two set-up commands are `make run` and `make test`: each creates .venv if missing,
# installs the project into it, generates the protos, then does its job.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
PROTOS := $(wildcard protos/tandem/v1/*.proto)
PB_STAMP := tandem_wire/pb/store_pb2.py

NODE_STAMP := clients/node/node_modules/.package-lock.json

.PHONY: run test soak bench protos lint check clean dist go-check train train-check train-check-all

$(STAMP): pyproject.toml setup.py
	@scripts/install-blas.sh
	@echo "==> $(VENV): a virtualenv of its own"
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "==> installing tandem and its dependencies (mlx, mlx-lm, grpcio...; the first time takes a few minutes)"
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $@

$(PB_STAMP): $(STAMP) $(PROTOS) scripts/gen_protos.py
	@echo "==> generating the gRPC stubs from protos/"
	$(PY) scripts/gen_protos.py

protos: $(STAMP)
	$(PY) scripts/gen_protos.py

run: $(PB_STAMP)
	$(PY) -m tandem_client.cli up --data-dir .tandem

# The Node.js client's packages, from its committed lockfile.
$(NODE_STAMP): clients/node/package.json clients/node/package-lock.json
	cd clients/node && npm ci --no-audit --no-fund --loglevel=error
	touch $@

# Two workers (pytest-xdist), a test file to each at a time (its module fixtures' servers
# stay in one worker): most of the suite waits on the servers it starts, so two workers on
# CI's two cores take ~2/3 of the serial time. A third worker did not shorten the run on two
# cores (10:04 against 9:24-10:08, 2026-12-03): what it fills of the waits it loses to
# contention. Files start longest first (tests/file_costs.py) so that the run does not end
# on one worker finishing a long file alone.
TEST_WORKERS ?= 2
test: $(PB_STAMP) $(NODE_STAMP)
	@# Bytecode for our own modules once: the suite starts hundreds of Python processes, and
	@# where PYTHONDONTWRITEBYTECODE is set (CI images) each would compile them again.
	$(PY) -m compileall -q -j 0 engine_service store_service gateway_service tandem_wire clients/python/tandem_client tests
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

# The fault-injection suites at length: many store and engine SIGKILLs (tests/test_faults.py;
# the engine's at seeded random moments, some between a checkpoint's capture and its Put),
# engines killed under streams through the gateway (tests/test_gateway_failover.py), and an
# engine of every zoo architecture killed after its first tokens (tests/test_engine_zoo_processes.py),
# and whole nodes (store and engine, disk gone) lost under streams on the shared tier
# (tests/test_tier_nodes.py), and the projection kernel compiled at every tiling and shape it
# serves (tests/test_cuda_kernels.py; the suite compiles each tiling at its extremes). Each
# run draws a fresh seed, printed: `make soak SOAK_SEED=<seed>` replays one.
SOAK_KILLS ?= 30
ifndef SOAK_SEED
SOAK_SEED := $(shell od -An -N4 -tu4 /dev/urandom | tr -d ' ')
endif
soak: $(PB_STAMP) $(NODE_STAMP)
	@echo "==> soak seed $(SOAK_SEED) (replay: make soak SOAK_SEED=$(SOAK_SEED))"
	TANDEM_SOAK_KILLS=$(SOAK_KILLS) TANDEM_SOAK_SEED=$(SOAK_SEED) \
		TANDEM_GATEWAY_KILLS=$(SOAK_KILLS) TANDEM_ZOO_KILLS=all TANDEM_NODE_KILLS=$(SOAK_KILLS) \
		TANDEM_ALL_TILINGS=1 $(PY) -m pytest -q -s tests/test_faults.py tests/test_gateway_failover.py \
		tests/test_engine_zoo_processes.py tests/test_tier_nodes.py tests/test_cuda_kernels.py

# What a user installs elsewhere, into dist/: the server sdist and wheel (tandem), the client
# sdist and wheel (tandem-client: grpcio + protobuf, the CLI) and the Node.js client's tarball
# (protos inside). Each wheel is built from its sdist, which proves the sdist complete.
dist: $(PB_STAMP) $(NODE_STAMP)
	rm -rf dist && mkdir -p dist
	$(PY) -m build --no-isolation --outdir dist . >/dev/null
	$(PY) scripts/build_client_dist.py dist
	cd clients/node && npm pack --pack-destination ../../dist --loglevel=error
	@ls -1 dist

# The Go client built from the protos with Debian's toolchain and gRPC modules (needs apt).
GO_PACKAGES := golang-go golang-google-grpc-dev golang-google-protobuf-dev protobuf-compiler \
	protoc-gen-go-grpc golang-github-golang-protobuf-1-5-dev
go-check: $(PB_STAMP)
	DEBIAN_FRONTEND=noninteractive apt-get install -y -q $(GO_PACKAGES) >/dev/null
	$(PY) -m pytest -q checks/test_go_client.py

# The embedded trained models, from scratch on the Python standard library's source
# (docs/training.md): `train` rewrites engine_service/model/default_model/trained/ (all three,
# in two data-parallel ranks on a CPU: tandem-tiny 40 min, its draft 12, the hybrid ~33 on 2
# cores); `train-check` retrains the draft into .train_check/ and compares its held-out loss
# with the committed run's (~12 minutes on 2 cores), `train-check-all` all three. None is part
# of `make test`.
train: $(STAMP)
	$(PY) -m training

train-check: $(STAMP)
	$(PY) -m training --out .train_check --models tandem-tiny-draft --check

train-check-all: $(STAMP)
	$(PY) -m training --out .train_check --check

bench: $(PB_STAMP)
	$(PY) bench/store_bench.py
	$(PY) bench/engine_bench.py

PY_SOURCES := store_service engine_service gateway_service tandem_wire clients/python/tandem_client \
	training

# mypy: the packages strict, the tests with check_untyped_defs (pyproject's [tool.mypy]).
lint: $(PB_STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check $(PY_SOURCES) tests bench scripts
	$(PY) -m mypy $(PY_SOURCES) tests

check: lint
	$(MAKE) test

clean:
	rm -rf $(VENV) tandem_wire/pb/*_pb2* .pytest_cache .mypy_cache .ruff_cache \
		clients/node/node_modules
