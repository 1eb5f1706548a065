# homelab-gateway as a container image: docs/deploy.md.
#
#   docker build -t homelab-gateway .
#   docker run -p 8080:8080 homelab-gateway --demo
#
# BASE is any Debian bookworm with python3 (3.11+) and its venv module: the official python
# image by default, or a stand-in made of Debian's own packages where no registry is reachable
# (tests/test_container.py builds one with mmdebstrap). Both stages build FROM it, so the venv's
# python is the same interpreter at the same path in both.
ARG BASE=docker.io/library/python:3.12-slim-bookworm

FROM ${BASE} AS build
RUN python3 -m venv /opt/homelab-gateway
ENV PATH=/opt/homelab-gateway/bin:$PATH
WORKDIR /src
# The dependencies first, in a layer of their own that a change of the source does not undo.
COPY pyproject.toml .
RUN python -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb')); \
print(*p['project']['dependencies'], *p['build-system']['requires'], sep='\n')" > requirements.txt \
 && pip install --no-cache-dir --quiet -r requirements.txt
COPY . .
# Not editable: twistd finds the plugin in site-packages/twisted/plugins/. The image needs
# neither pip nor setuptools (15 MB). The plugin cache is written here, as root, since the
# daemon's user may not write to site-packages.
RUN pip install --no-cache-dir --quiet --no-deps --no-build-isolation . \
 && pip uninstall --quiet --yes setuptools pip \
 && python -c "from twisted.plugin import IPlugin, getPlugins; list(getPlugins(IPlugin))"

FROM ${BASE}
COPY --from=build /opt/homelab-gateway /opt/homelab-gateway
# A fixed uid, so that a bind mount can be given to it (chown 10001).
RUN useradd --user-group --uid 10001 --no-create-home \
        --home-dir /var/lib/homelab-gateway --shell /usr/sbin/nologin homelab-gateway \
 && install -d -o homelab-gateway -g homelab-gateway /var/lib/homelab-gateway \
 && install -d /etc/homelab-gateway
ENV PATH=/opt/homelab-gateway/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    HOMELAB_GATEWAY_PORT=8080
USER homelab-gateway
# The state: the usage ledger (usage.sqlite3, [usage] database) lands here.
WORKDIR /var/lib/homelab-gateway
VOLUME /var/lib/homelab-gateway
EXPOSE 8080
HEALTHCHECK --interval=30s --timeout=5s --start-period=10s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request as r; r.urlopen('http://127.0.0.1:%s/healthz' % os.environ['HOMELAB_GATEWAY_PORT'], timeout=4)"]
# twistd is PID 1 (exec): SIGTERM from `docker stop` drains, and a completed drain exits 0.
# It listens on every interface of the container, on HOMELAB_GATEWAY_PORT, which the
# healthcheck asks; a --listen among the arguments comes later and wins.
ENTRYPOINT ["/bin/sh", "-c", "exec twistd --nodaemon --pidfile= homelab-gateway --listen \"tcp:$HOMELAB_GATEWAY_PORT\" \"$@\"", "homelab-gateway"]
# Arguments to `docker run IMAGE ...` replace these: `--demo`, or another --config.
CMD ["--config", "/etc/homelab-gateway/gateway.toml"]
