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
# tests/test_container.py builds and runs the image with Debian's podman (on runc) FROM a
# stand-in base that Debian's mmdebstrap makes; podman's image store keeps the base between runs.
PODMAN := /usr/bin/podman
MMDEBSTRAP := /usr/bin/mmdebstrap
RUNC := /usr/sbin/runc
# tests/test_codex.py runs OpenAI's Codex CLI, at the version package-lock.json pins, from
# node_modules/ (npm ci); npm is Debian's where the machine has none.
NPM := $(or $(shell command -v npm 2>/dev/null),/usr/bin/npm)
CODEX := node_modules/@openai/codex

.PHONY: demo test install bench chaos chaos-cluster

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

$(PODMAN) $(MMDEBSTRAP) $(RUNC):
	apt-get update -qq
	DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends podman mmdebstrap runc >/dev/null

$(NPM):
	apt-get update -qq
	DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends nodejs npm >/dev/null

# Again whenever package-lock.json is newer than the installed package (npm ci starts afresh).
$(CODEX): package-lock.json | $(NPM)
	npm ci --no-audit --no-fund
	touch $(CODEX)

test: install $(CHROMIUM) $(REDIS) $(CODEX) $(PODMAN) $(MMDEBSTRAP) $(RUNC)
	$(BIN)/ruff check src tests testsupport twisted bench
	$(BIN)/ruff format --check src tests testsupport twisted bench
	$(BIN)/python -m pytest

bench: install
	$(BIN)/python -m bench

chaos: install
	$(BIN)/python -m bench.chaos

chaos-cluster: install $(REDIS)
	$(BIN)/python -m bench.chaos --cluster
