"""From a Config to a listening gateway: the objects one running daemon holds, and its Service.

`Gateway` builds the per-upstream clients and slots, the policy, telemetry and the web site from
the config, taking the reactor as a parameter so tests can hand it their own. `GatewayService`
binds the port in `privilegedStartService`, so a port that cannot be bound stops start-up with
one line and a non-zero exit, and drains on stop: no new connections, new requests refused,
queued ones failed, in-flight ones given `shutdown_grace` seconds, then cancelled; the process
exits only once every answer has been written out. SIGHUP reloads the config in place.
"""

from __future__ import annotations

import cProfile
import os
import signal
import sys
from collections.abc import Mapping
from contextlib import suppress
from pathlib import Path
from typing import IO, Any
from weakref import WeakValueDictionary

from treq.client import HTTPClient
from twisted.application.service import MultiService, Service
from twisted.internet.defer import Deferred, ensureDeferred, maybeDeferred
from twisted.internet.defer import TimeoutError as DeferredTimeout
from twisted.internet.endpoints import serverFromString
from twisted.internet.error import CannotListenError
from twisted.internet.interfaces import IListeningPort, IStreamServerEndpoint
from twisted.logger import ILogObserver, Logger, jsonFileLogObserver
from twisted.python.failure import Failure
from twisted.web.client import Agent

from homelab_gateway.collector import tune_collector
from homelab_gateway.config import (
    Config,
    ConfigError,
    ModelConfig,
    UpstreamConfig,
    load_config,
    with_backlog,
)
from homelab_gateway.core.errors import GatewayError
from homelab_gateway.core.reload import config_changes
from homelab_gateway.core.replicas import DOWN
from homelab_gateway.ledger import MEMORY, Ledger, LedgerError
from homelab_gateway.line.cluster import Cluster
from homelab_gateway.line.limiter import PositionedSemaphore, Replica
from homelab_gateway.line.pool import Pool
from homelab_gateway.line.residency import Residency
from homelab_gateway.line.shared import shared_line
from homelab_gateway.line.tokens import RedisTokens
from homelab_gateway.quotas import Local, Quotas, Shared
from homelab_gateway.surfaces.attempts import Retries
from homelab_gateway.surfaces.proxy import ProxyRoute, ReverseProxy
from homelab_gateway.surfaces.skeleton import SurfaceSettings
from homelab_gateway.telemetry import Telemetry
from homelab_gateway.upstream.client import EndpointPerHost, RawHTTP, Upstream, llm_http
from homelab_gateway.upstream.connections import UpstreamPool
from homelab_gateway.upstream.kinds import KINDS
from homelab_gateway.upstream.readiness import Probe, Readiness
from homelab_gateway.web.access import AccessPolicy
from homelab_gateway.web.app import GatewayApp
from homelab_gateway.web.channel import GatewaySite, WireLimits, send_at_once
from homelab_gateway.web.inflight import InFlight

log = Logger()
# After the grace period and the last answer: how long a client that stopped reading may keep
# the process waiting for its buffered bytes (systemd's TimeoutStopSec must leave room).
CLOSE_TIMEOUT = 5.0
TCP_CONNECT_TIMEOUT = 10.0
"""A box on the LAN answers a connection in milliseconds; one that has not within this many
seconds is off or unreachable, and the request can go to another replica (nothing was sent).
`connect_timeout` still bounds the wait for the response headers (Ollama loads a model first)."""
PROFILE_ENV = "HOMELAB_GATEWAY_PROFILE"  # a path: profile the reactor thread, write stats on stop


class Gateway:
    """Every object one running daemon holds. `reload` swaps in a new config in place: the
    maps of models and pools are shared with the web layer, telemetry and readiness and are
    changed in place, so a reload reaches them all; a pool whose upstream stays keeps its
    object, so its held slots and its line of waiters carry over."""

    close_timeout = CLOSE_TIMEOUT

    def __init__(self, config: Config, reactor: Any) -> None:
        self.config = config
        self.reactor = reactor
        self.http_pool = UpstreamPool(reactor, persistent=True)
        self.pools: dict[str, Pool] = {}
        # Pools of removed upstreams, alive only while a request still holds or awaits them:
        # an upstream added back before they finish gets its old slots back, not a second set.
        self._retired: WeakValueDictionary[str, Pool] = WeakValueDictionary()
        self.models: dict[str, ModelConfig] = {}
        # [cluster]: lines shared with other gateways through Redis (read at start only).
        self.cluster = Cluster(config.cluster, reactor) if config.cluster is not None else None
        # Models loaded on demand: made with the first managed upstream.
        self.residency: Residency | None = None
        self._sync_pools(None, config)
        self.models.update(config.models)
        usage = config.usage  # read at start only
        self.ledger = Ledger(usage.database, usage.keep_days, reactor, reactor=reactor)
        store = Local(reactor) if self.cluster is None else Shared(RedisTokens(self.cluster))
        self.quotas = Quotas(_quotas(config), store)
        self.telemetry = Telemetry(
            reactor, self.pools, self.cluster, self.ledger, self.quotas, clients=config.clients
        )
        self.inflight = InFlight(reactor, self.telemetry)
        self.readiness = Readiness(
            self.pools, reactor, config.server.probe_interval, models=self.models
        )
        self._started = False
        self.app = GatewayApp(
            models=self.models,
            pools=self.pools,
            proxy=self._proxy(config),
            settings=self._surface_settings(config),
            access=self._access(config),
            inflight=self.inflight,
            telemetry=self.telemetry,
            readiness=self.readiness,
            cluster=self.cluster,
            ledger=self.ledger,
            quotas=self.quotas,
        )
        self._configure_status_page(config)
        self.site = GatewaySite(self.app.app.resource(), self._limits(config), reactor=reactor)
        self.site.displayTracebacks = False

    def _sync_pools(self, old: Config | None, new: Config) -> None:
        """Make `self.pools` match `new.upstreams`, keeping the Pool of every upstream that
        stays (its held slots and waiters), resizing its slots for new grants only."""
        for name in [n for n in self.pools if n not in new.upstreams]:
            self._retired[name] = self.pools.pop(name)
        for name, upstream in new.upstreams.items():
            pool = self.pools.get(name) or self._retired.pop(name, None)
            if pool is None:
                pool = Pool(
                    upstream=self._upstream_client(upstream),
                    replica=Replica(name, upstream.slots),
                    queue_timeout=upstream.queue_timeout,
                )
            else:
                before = old.upstreams.get(name) if old is not None else None
                if before is None or _connection(before) != _connection(upstream):
                    pool.upstream = self._upstream_client(upstream)
            replica = pool.replica
            replica.limit, replica.fallback = upstream.slots, upstream.fallback
            replica.circuit.failures_to_open = upstream.failures_to_open
            replica.circuit.cooldown = upstream.cooldown
            pool.queue_timeout = upstream.queue_timeout
            pool.kind = KINDS[upstream.kind]
            pool.continuous_usage_stats = (
                upstream.continuous_usage_stats and pool.kind.continuous_usage_stats
            )
            pool.forward_priority = upstream.forward_priority
            self.pools[name] = pool
        self._sync_lines(new)
        self._sync_residency(new)
        self.http_pool.maxPersistentPerHost = max([16, *(u.slots for u in new.upstreams.values())])

    def _sync_residency(self, config: Config) -> None:
        """Put every managed upstream of `config` in the residency's hands (made with the
        first), and let go of those no longer managed, once unloaded."""
        managed = {name: u for name, u in config.upstreams.items() if u.managed}
        if self.residency is None:
            if not managed:
                return
            http = HTTPClient(Agent(self.reactor, pool=self.http_pool))
            self.residency = Residency(self.reactor, self.reactor, http, Path.cwd(), config.boxes)
        self.residency.sync(managed, self.pools, config.boxes)

    def _sync_lines(self, config: Config) -> None:
        """One line per set of upstreams that models join (`shared_lines`). A line whose
        upstreams stay the same is kept; a new one takes over the waiters of the lines its
        upstreams came from, so a reload that gives a model a second box loses nobody's place."""
        for names in shared_lines(config):
            members = [self.pools[name].replica for name in names]
            before = {m.line for m in members if m.line is not None}
            line = next(iter(before)) if len(before) == 1 else None
            if line is None or not line.serves(members):
                # Its settings before it adopts anyone: adopting grants what is free.
                settings = {"on_health": self._health_changed, **_line_settings(config)}
                if self.cluster is None:
                    line = PositionedSemaphore(members, self.reactor, **settings)
                else:
                    line = shared_line(members, self.reactor, cluster=self.cluster, **settings)
                for old in before:
                    line.adopt(old)
            line.queue_limit = sum(config.upstreams[name].queue_limit for name in names)
            line.configure_line(**_line_settings(config))
            line.refresh()

    def _health_changed(self, replica: Replica, state: str, reason: str | None) -> None:
        """One log line when a replica leaves or rejoins rotation."""
        if state == DOWN:
            log.warn(
                "upstream {upstream} is out of rotation for {cooldown:g}s: {reason}",
                upstream=replica.name,
                cooldown=replica.circuit.cooldown,
                reason=reason,
            )
        else:
            log.info(
                "upstream {upstream} is {state}: {reason}",
                upstream=replica.name,
                state="back in rotation" if state == "up" else state,
                reason=reason or "it answered",
            )

    def _upstream_client(self, upstream: UpstreamConfig) -> Upstream:
        return self._client(
            upstream.name,
            upstream.url,
            upstream.connect_timeout,
            upstream.idle_timeout,
            upstream.api_key,
            transparent=False,
        )

    def _proxy(self, config: Config) -> ReverseProxy:
        routes = []
        for route in config.routes:
            pool = self.pools[route.upstream] if route.upstream else None
            url = pool.upstream.url if pool else route.url
            assert url is not None
            api_key = config.upstreams[route.upstream].api_key if route.upstream else None
            client = self._client(
                route.upstream or route.prefix,
                url,
                route.connect_timeout,
                route.idle_timeout,
                api_key,
                transparent=True,
            )
            routes.append(ProxyRoute(prefix=route.prefix.encode(), upstream=client, pool=pool))
        return ReverseProxy(routes, self.reactor, config.server.write_stall_timeout)

    def _surface_settings(self, config: Config) -> SurfaceSettings:
        return SurfaceSettings(
            models=self.models,
            pools=self.pools,
            clock=self.reactor,
            ping_interval=config.server.ping_interval,
            write_stall_timeout=config.server.write_stall_timeout,
            retries=Retries(
                self.reactor, config.server.retries, self.telemetry.retried, self.quotas
            ),
            upstream_window=self.readiness.context_window,
        )

    def _access(self, config: Config) -> AccessPolicy:
        return AccessPolicy(
            config.auth.api_keys,
            protect_metrics=config.auth.protect_metrics,
            cors_origins=config.server.cors_origins,
            clients=config.clients,
            trusted_proxies=config.server.trusted_proxies,
        )

    def _configure_status_page(self, config: Config) -> None:
        """The event stream's cap and stall timeout: for the next subscriber (a reload keeps
        those open, even above a lower cap); the charts' sample interval."""
        page = self.app.status_page
        page.max_subscribers = config.server.max_status_subscribers
        page.stall_timeout = config.server.write_stall_timeout
        page.set_sample_interval(config.server.status_sample_interval)

    def _limits(self, config: Config) -> WireLimits:
        server = config.server
        return WireLimits(
            max_body_bytes=server.max_body_bytes,
            max_header_bytes=server.max_header_bytes,
            request_timeout=server.request_timeout,
        )

    def _client(
        self,
        name: str,
        url: str,
        connect_timeout: float,
        idle_timeout: float,
        api_key: str | None,
        *,
        transparent: bool,
    ) -> Upstream:
        endpoints = EndpointPerHost(self.reactor, min(connect_timeout, TCP_CONNECT_TIMEOUT))
        agent = Agent.usingEndpointFactory(self.reactor, endpoints, pool=self.http_pool)
        return Upstream(
            name=name,
            url=url,
            http=RawHTTP(agent) if transparent else llm_http(agent),
            clock=self.reactor,
            connect_timeout=connect_timeout,
            idle_timeout=idle_timeout,
            api_key=api_key,
        )

    def start(self) -> None:
        self._started = True
        self.readiness.start()
        self.ledger.start()
        if self.ledger.database != MEMORY:  # a new database in memory has no day to read
            self._seed_quotas(self.quotas.limits)
        self.app.status_page.start()
        if self.cluster is not None:
            self.cluster.start()

    def _seed_quotas(self, clients: Mapping[str, int]) -> None:
        """A gateway alone counts only limited clients' tokens: at start and after every
        reload, each one's day is the ledger's."""
        store = self.quotas.store
        if isinstance(store, Local) and clients:
            seeded = ensureDeferred(store.seed(self.ledger, clients))
            seeded.addErrback(lambda f: log.failure("tokens_per_day: cannot read the ledger", f))

    def reload(self, config: Config) -> list[str]:
        """Apply `config` without dropping anything; return what changed, one line each.

        New requests see the new models, routes, keys and limits at once; a request already
        running keeps what it started with (its pool, its upstream client, its route). Removed
        upstreams take no new requests and finish what they hold. New connections get the new
        wire limits; the listening port and the log format stay until a restart.
        """
        old, changes = self.config, config_changes(self.config, config)
        self._sync_pools(old, config)
        self.models.clear()
        self.models.update(config.models)
        limits = _quotas(config)
        self._seed_quotas(limits)
        self.quotas.limits = limits
        self.app.proxy = self._proxy(config)
        self.app.use(self._surface_settings(config))
        self.app.access = self._access(config)
        self.telemetry.clients = frozenset(config.clients)
        self.site.limits = self._limits(config)
        self._configure_status_page(config)
        self.readiness.interval = config.server.probe_interval
        self.readiness.probes = {
            name: self.readiness.probes.get(name) or Probe() for name in self.pools
        }
        if self._started and old.upstreams != config.upstreams:
            self.readiness.stop()  # probe the new set now rather than a round later
            self.readiness.start()
        self.config = config
        return changes

    def _lines(self) -> list[PositionedSemaphore]:
        lines = {pool.line: None for pool in [*self.pools.values(), *self._retired.values()]}
        return list(lines)

    async def drain(self) -> None:
        """Refuse new work, fail the queued, give in-flight requests the grace period, then
        close every connection once it has written out what it holds."""
        self.inflight.draining = True
        for line in self._lines():
            line.fail_waiting(GatewayError(529, "the gateway is shutting down", outcome="shutdown"))
        await self.inflight.drain(self.config.server.shutdown_grace)
        await self._close_connections()

    def cut_short(self) -> bool:
        """End the drain's grace period now; False if no grace period is running."""
        return self.inflight.cut_short()

    async def _close_connections(self) -> None:
        """Close idle keep-alive connections at once and the others once their buffered bytes
        are written, bounded by `close_timeout` for a client that stopped reading."""
        for channel in list(self.site.connections):
            channel.loseConnection()
        with suppress(DeferredTimeout):
            await self.site.all_closed().addTimeout(self.close_timeout, self.reactor)
        for channel in list(self.site.connections):
            channel.transport.abortConnection()

    async def close(self) -> None:
        self.readiness.stop()
        self.app.status_page.stop()
        if self.cluster is not None:
            await self.cluster.stop()
        for line in self._lines():
            line.close()
        if self.residency is not None:
            await self.residency.close()  # no server the gateway started outlives it
        # Every request has finished: its usage is pending. Before the cached connections go,
        # which must be last: a connection put back while the ledger writes would keep a timer.
        await self.ledger.stop()
        await self.http_pool.closeCachedConnections()


def _line_settings(config: Config) -> dict[str, Any]:
    """The fair line's settings for every upstream's slots, from [queue] and [clients]."""
    clients = config.clients.values()
    return {
        "aging": config.queue.aging,
        "weights": {c.name: c.weight for c in clients},
        "max_waiting": {c.name: c.max_waiting for c in clients if c.max_waiting is not None},
        "max_in_flight": {c.name: c.max_in_flight for c in clients if c.max_in_flight is not None},
    }


def _quotas(config: Config) -> dict[str, int]:
    return {c.name: c.tokens_per_day for c in config.clients.values() if c.tokens_per_day}


def shared_lines(config: Config) -> list[list[str]]:
    """The upstreams that share one line: those a model names together, and transitively
    (vllm-a and ollama serve one model, ollama and nothing else another: one line of three).
    Every other upstream has a line of its own. In the config's order."""
    parent = {name: name for name in config.upstreams}

    def root(name: str) -> str:
        while parent[name] != name:
            name = parent[name]
        return name

    for model in config.models.values():
        first, *others = model.replicas
        for other in others:
            parent[root(other)] = root(first)
    lines: dict[str, list[str]] = {}
    for name in config.upstreams:
        lines.setdefault(root(name), []).append(name)
    return list(lines.values())


def _connection(upstream: UpstreamConfig) -> tuple[object, ...]:
    """What an upstream's HTTP client is built from; a change needs a new client."""
    return (upstream.url, upstream.connect_timeout, upstream.idle_timeout, upstream.api_key)


def listen_now(endpoint: IStreamServerEndpoint, factory: Any) -> IListeningPort:
    """Listen and return the port at once; raise CannotListenError if it cannot be bound.

    Stream endpoints for TCP, UNIX sockets and systemd activation bind synchronously, so the
    Deferred has fired by the time `listen` returns.
    """
    results: list[Any] = []
    endpoint.listen(factory).addBoth(results.append)
    if not results:
        raise CannotListenError(None, None, "the endpoint did not bind synchronously")
    if isinstance(results[0], Failure):
        results[0].raiseException()
    return results[0]


def describe(port: IListeningPort) -> str:
    address = port.getHost()
    host = getattr(address, "host", None)
    return f"http://{host}:{address.port}" if host is not None else str(address)


class GatewayService(Service):
    """Binds, serves, and owns the process's signals once the reactor runs:

    - SIGTERM or SIGINT drains (below) and the process exits 0: a drain that completed is a
      clean stop, for systemd, Docker and shell scripts alike (twistd would re-raise the
      signal, an exit status that tells a clean drain from a kill by nobody).
    - A second SIGTERM or SIGINT ends the grace period at once: what still runs is answered
      with its shutdown error, then the process exits.
    - SIGHUP re-reads `config_path` and applies it (`Gateway.reload`); an invalid file is one
      logged line and the running config stays.
    """

    def __init__(
        self,
        config: Config,
        reactor: Any,
        listen: str | None = None,
        json_log: IO[str] | None = None,
        config_path: str | None = None,
    ) -> None:
        self.config = config
        self.reactor = reactor
        self.listen = listen or config.server.listen
        self.json_log = json_log
        self.config_path = config_path
        self.gateway: Gateway | None = None
        self.port: IListeningPort | None = None
        self._profiler: cProfile.Profile | None = None
        self._stopping = False

    def setServiceParent(self, parent: Any) -> None:
        # twistd asks the application for an ILogObserver before its own text logger, the way
        # a .tac file sets one: that is how `log_format = "json"` reaches every log line.
        if self.json_log is not None and hasattr(parent, "setComponent"):
            parent.setComponent(
                ILogObserver, jsonFileLogObserver(self.json_log, recordSeparator="")
            )
        super().setServiceParent(parent)

    def privilegedStartService(self) -> None:
        super().privilegedStartService()
        self.gateway = Gateway(self.config, self.reactor)
        try:
            self.gateway.ledger.check()
        except LedgerError as e:
            raise SystemExit(f"homelab-gateway: usage.database: {e}") from None
        # SIGHUP's default action ends the process: handle it before saying "listening". The
        # reactor leaves SIGHUP alone; it installs its own SIGTERM and SIGINT as it starts.
        self._handle(signal.SIGHUP)
        try:
            endpoint = serverFromString(self.reactor, with_backlog(self.listen))
            self.port = listen_now(endpoint, self.gateway.site)
            send_at_once(self.port)
        except CannotListenError as e:
            raise SystemExit(
                f"homelab-gateway: cannot listen on {self.listen!r}: {e.socketError or e}"
            ) from None
        log.info("homelab-gateway listening on {address}", address=describe(self.port))

    def startService(self) -> None:
        super().startService()
        assert self.gateway is not None
        self.gateway.start()
        # After the reactor's own handlers, which it installs as it starts running.
        self.reactor.callWhenRunning(self._handle, signal.SIGTERM, signal.SIGINT)
        tune_collector()
        if os.environ.get(PROFILE_ENV):
            self._profiler = cProfile.Profile()
            self._profiler.enable()

    def _handle(self, *numbers: int) -> None:
        for number in numbers:
            signal.signal(number, self._deliver)

    def _deliver(self, number: int, _frame: object) -> None:
        # A signal handler runs between two bytecodes of whatever the reactor was doing: hand
        # the work to the reactor's thread (run once it runs) and return.
        self.reactor.callFromThread(self.on_signal, number)

    def on_signal(self, number: int) -> None:
        name = signal.Signals(number).name
        if number == signal.SIGHUP:
            self.reload(name)
        elif not self._stopping:
            self._stopping = True
            log.info("Received {signal}: draining, then stopping", signal=name)
            self.reactor.stop()
        elif self.gateway is not None and self.gateway.cut_short():
            log.info("Received {signal} again: ending the grace period now", signal=name)
        else:
            log.info("Received {signal} again: already stopping", signal=name)

    def reload(self, why: str = "reload") -> None:
        """Re-read the config file and apply it; keep the running config if it is invalid."""
        if self.config_path is None or self.gateway is None:
            log.info("{why}: no config file to reload", why=why)
            return
        if self._stopping:
            log.info("{why}: ignored while stopping", why=why)
            return
        try:
            config = load_config(self.config_path)
        except ConfigError as e:
            log.error(
                "homelab-gateway: reload failed, still running the previous config: {error}",
                error=str(e),
            )
            return
        changes = self.gateway.reload(config)
        self.config = config
        log.info(
            "homelab-gateway: config reloaded from {path}: {n} changes",
            path=self.config_path,
            n=len(changes),
        )
        for change in changes:
            log.info("reload: {change}", change=change)

    def stopService(self) -> Deferred[None]:
        super().stopService()
        self._stopping = True
        return ensureDeferred(self._stop())

    async def _stop(self) -> None:
        if self.port is not None:
            await maybeDeferred(self.port.stopListening)
        if self.gateway is not None:
            log.info(
                "homelab-gateway draining: {n} requests in flight", n=len(self.gateway.inflight)
            )
            await self.gateway.drain()
            await self.gateway.close()
        if self._profiler is not None:
            self._profiler.disable()
            self._profiler.dump_stats(os.environ[PROFILE_ENV])
        log.info("homelab-gateway stopped")


class DemoService(MultiService):
    """The stub upstreams on free loopback ports, then a gateway configured to use them."""

    def __init__(self, reactor: Any, listen: str, build: Any) -> None:
        super().__init__()
        self.reactor = reactor
        self.listen = listen
        self._build = build
        self.stub_ports: list[IListeningPort] = []

    def privilegedStartService(self) -> None:
        config, sites = self._build(self.reactor)
        urls = {}
        for name, site in sites.items():
            port = listen_now(serverFromString(self.reactor, "tcp:0:interface=127.0.0.1"), site)
            self.stub_ports.append(port)
            urls[name] = describe(port) + "/v1"
            log.info("demo stub upstream {name} at {url}", name=name, url=urls[name])
        GatewayService(config(urls), self.reactor, self.listen).setServiceParent(self)
        super().privilegedStartService()

    def stopService(self) -> Deferred[Any]:
        d = super().stopService()
        for port in self.stub_ports:
            port.stopListening()
        return d


def json_log_stream(twistd_logfile: str | None) -> IO[str]:
    """Where JSON lines go: twistd's --logfile if one was given, else standard output."""
    if twistd_logfile and twistd_logfile != "-":
        return open(twistd_logfile, "a", buffering=1)
    return sys.stdout
