# Every target creates the virtual environment it needs: `make test` and `make demo` work on a
# fresh clone with nothing installed by hand.
PYTHON ?= python3
# Another interpreter, `make test PYTHON=/path/to/python3.13`, gets a virtualenv of its own named
# after its version (.venv-3.13), so that the default .venv is never rebuilt by a run on another
# version (README, "The two commands"). `make check` and `make demo` take PYTHON= likewise.
ifeq ($(origin PYTHON),file)
VENV := .venv
else
PYTHON_VERSION := $(shell $(PYTHON) -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null)
ifeq ($(PYTHON_VERSION),)
$(error PYTHON=$(PYTHON) does not run: give the path of a Python >= 3.11 interpreter)
endif
VENV := .venv-$(PYTHON_VERSION)
endif
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: test check demo lint docs clean venv

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test,perf]'
	touch $(STAMP)

venv: $(STAMP)

# The MQTT tests drive the listener with the Debian mosquitto-clients tools too, and the bridge
# and perf roam tests need a Mosquitto broker of their own (started on a free port by the test,
# never the Debian service's): apt, as root or through sudo; the tests that need them are
# skipped, with the reason, where that cannot install them.
.PHONY: mqtt-tools
mqtt-tools:
	@{ command -v mosquitto_pub >/dev/null && { command -v mosquitto || test -x /usr/sbin/mosquitto; } >/dev/null; } || \
	  { $(SUDO) apt-get update -qq && \
	  $(SUDO) apt-get install -y -qq --no-install-recommends mosquitto-clients mosquitto; } || \
	  echo "mqtt-tools: mosquitto-clients or mosquitto not installed; the tests that need them are skipped"

# The console's browser test (tests/test_console.py) drives Debian's Chromium through Playwright's
# Python package (test extra), never a browser Playwright would download: apt, as root or through
# sudo; the test is skipped, with the reason, where that cannot install it.
.PHONY: browser
browser:
	@test -x /usr/bin/chromium || \
	  { $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq --no-install-recommends chromium; } || \
	  echo "browser: chromium not installed; the console's browser test is skipped"

# The power-loss tests (tests/test_powerloss.py, marker powerloss) mount a FUSE file system
# written in Python (tests/support/powerfs.py, over the mfusepy binding of the `test` extra)
# that needs libfuse 3 and fusermount3: apt, as root or through sudo. Without /dev/fuse or root
# those tests are skipped with the reason; with both but without libfuse 3 they fail.
.PHONY: fuse-tools
fuse-tools:
	@{ command -v fusermount3 >/dev/null && ldconfig -p | grep -q libfuse3.so; } || \
	  { $(SUDO) apt-get update -qq && \
	  $(SUDO) apt-get install -y -qq --no-install-recommends fuse3; } || \
	  echo "fuse-tools: fuse3 not installed; the power-loss tests will fail"

# The whole suite on two workers, the slowest tests listed at the end so that the suite's time
# stays watched. Each worker takes its ports from its own range (tests/support/harness.py,
# AAABUS_PORT_RANGE), so two workers never pick the same free port.
test: $(STAMP) mqtt-tools browser fuse-tools
	$(PY) -m pytest -q -n 2 --durations=20 -m "not brokers and not bench"

# The fast lane: unit, property and sans-IO tests, no server process, no Spark (under a minute).
check: $(STAMP)
	$(PY) -m pytest -q -m "not slow" -n 2

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy aaabus perf tests
	$(VENV)/bin/lint-imports --no-logo

demo: $(STAMP)
	$(PY) -m perf demo

# The documentation site, into site/ (mkdocs.yml): docs/*.md and the API reference read from the
# docstrings. Strict: any warning fails it, a link to a page or a file that is gone and a
# docstring's cross-reference to nothing among them (docs/hooks/). Needs only the `docs` extra,
# installed into the virtual environment once (CI runs it after `make test`).
DOCS_STAMP := $(VENV)/.docs-installed

$(DOCS_STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -e '.[docs]'
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	$(VENV)/bin/mkdocs build --strict --quiet

clean:
	rm -rf $(VENV) .venv-[0-9]* build site *.egg-info .pytest_cache .mypy_cache .ruff_cache

# `make peers`: aaabus against RabbitMQ and Mosquitto (perf/PEERS.md), then the MQTT suite (the
# same paho programs over RabbitMQ's MQTT plugin and Mosquitto) and the edge scenario (three sites
# joined by Mosquitto bridges over delayed links). Installs both brokers from the distribution
# (apt, as root or through sudo) and their Python clients into the virtualenv; the suites start
# private brokers on 127.0.0.1 in a temporary directory and stop them by PID when they end, also
# on failure. Extra options: make peers PEERS_ARGS='...' MQTT_ARGS='...' EDGE_ARGS='...'.
# These runs need the brokers, so they live here rather than in `make test` (CI has none).
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
PEERS_ARGS ?=
MQTT_ARGS ?=
EDGE_ARGS ?= --trials 200 --wan-ms 20

.PHONY: peers
peers: $(STAMP)
	@if ! dpkg -s rabbitmq-server mosquitto >/dev/null 2>&1; then \
	  $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y --no-install-recommends rabbitmq-server mosquitto || exit 1; \
	  if [ -d /run/systemd/system ]; then \
	    echo "peers: stopping the system services apt started (the suite runs its own brokers)"; \
	    $(SUDO) systemctl disable --now rabbitmq-server mosquitto || true; \
	  fi; \
	fi
	$(PY) -m pip install --quiet -e '.[test,perf,peers]'
	$(PY) -m pytest -q -p no:cacheprovider -m "brokers or bench"
	$(PY) -m perf peers $(PEERS_ARGS)
	$(PY) -m perf mqtt $(MQTT_ARGS)
	$(PY) -m perf edge $(EDGE_ARGS)
