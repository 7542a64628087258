# Sluice: `make run` serves on the embedded default policy; `make test` runs every check.
# Both do their own set-up: a virtualenv in .venv, generated protobuf code, and (as root, when
# missing) the Debian packages the tests need.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
POLICY ?= policies/default.yaml
PYTEST_ARGS ?=
# The request-path suites, run a second time interpreted (SLUICE_PURE=1) after the compiled run:
# the compiled and the interpreted program differ (narrowing across an await, exception state),
# and a developer who edits a compiled module runs the interpreted one until the next build.
PURE_SUITES = tests/forward tests/adapters tests/upstream tests/filters tests/core
# The docs site (mkdocs.yml), built strictly: a broken link or anchor, or a page left out of the
# navigation, fails. About a second; the site goes to build/site (ignored by git).
DOCS_BUILD = NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet --site-dir build/site

.PHONY: run test setup system-deps lint typecheck unit bench clean proto image native docs

run: setup
	$(BIN)/sluice serve --policy $(POLICY)

test: setup system-deps
	$(BIN)/ruff format --check gateway tests
	$(BIN)/ruff check gateway tests
	$(BIN)/mypy
	$(DOCS_BUILD)
	$(BIN)/python -m pytest $(PYTEST_ARGS)
	SLUICE_PURE=1 $(BIN)/python -m pytest $(PYTEST_ARGS) $(PURE_SUITES)

setup: $(VENV)/.stamp-deps proto native

# The request path compiled with mypyc (gateway/native.py); a no-op while it matches its sources.
native: $(VENV)/.stamp-deps proto
	$(BIN)/python -m gateway.build_native

proto: gateway/proto/inference_pb2.py

gateway/proto/inference_pb2.py: gateway/proto/inference.proto $(VENV)/.stamp-deps
	$(BIN)/python -c "from gateway.proto import generate; generate()"

$(VENV)/.stamp-deps: pyproject.toml
	@if ! $(PYTHON) -c "import ensurepip, venv" 2>/dev/null; then \
		if [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv; \
		else echo "python3-venv is missing: run as root or install it" >&2; exit 1; fi; fi
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $@

# Debian packages used by the tests (redis-server, bcc, kernel headers, iproute2, wrk, h2load).
system-deps:
	bash deploy/host-setup.sh

# The docs site into build/site (open build/site/index.html). After a change to the policy
# models, regenerate the reference first: .venv/bin/sluice policy docs > docs/reference/policy.md
docs: $(VENV)/.stamp-deps
	$(DOCS_BUILD)

bench: setup system-deps
	$(BIN)/sluice bench

# The container image (podman + runc; makes its own Debian base image when none is present).
image: system-deps
	bash deploy/build-image.sh

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache gateway/proto/*_pb2*.py build
	find gateway -name '*.so' -delete; rm -f gateway/_native.json
