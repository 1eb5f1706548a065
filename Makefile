# The two commands a newcomer needs: `make demo` and `make test`. Both create .venv if it is
# missing and install the project into it (not editable: twistd finds its plugin in
# site-packages/twisted/plugins/, which an editable install does not provide).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The status page's browser test drives Debian's chromium through Playwright, which is never
# asked to download a browser of its own.
CHROMIUM := /usr/bin/chromium
# The tests of gateways sharing a line run a real Redis: Debian's redis-server.
REDIS := /usr/bin/redis-server

.PHONY: demo test install bench chaos

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

install: $(BIN)/python
	$(BIN)/python -m pip install --quiet ".[test]"

demo: install
	$(BIN)/twistd --nodaemon --pidfile= homelab-gateway --demo

$(CHROMIUM):
	apt-get update -qq
	DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium >/dev/null

$(REDIS):
	apt-get update -qq
	DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends redis-server >/dev/null

test: install $(CHROMIUM) $(REDIS)
	$(BIN)/ruff check src tests twisted bench
	$(BIN)/ruff format --check src tests twisted bench
	$(BIN)/python -m pytest

bench: install
	$(BIN)/python -m bench

chaos: install
	$(BIN)/python -m bench.chaos
