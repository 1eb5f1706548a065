"""From a Config to a listening gateway: the objects one running daemon holds, and its Service.

`Gateway` builds the per-upstream clients and slots, the policy, telemetry and the web site from
the config, taking the reactor as a parameter so tests can hand it their own. `GatewayService`
binds the port in `privilegedStartService`, so a port that cannot be bound stops start-up with
one line and a non-zero exit, and drains on stop: no new connections, new requests refused,
queued ones failed, in-flight ones given `shutdown_grace` seconds, then cancelled.
"""

from __future__ import annotations

import cProfile
import os
import sys
from typing import IO, Any

from twisted.application.service import MultiService, Service
from twisted.internet.defer import Deferred, ensureDeferred, maybeDeferred
from twisted.internet.endpoints import serverFromString
from twisted.internet.error import CannotListenError
from twisted.internet.interfaces import IListeningPort, IStreamServerEndpoint
from twisted.logger import ILogObserver, Logger, jsonFileLogObserver
from twisted.python.failure import Failure
from twisted.web.client import Agent

from homelab_gateway.access import AccessPolicy
from homelab_gateway.channel import GatewaySite, WireLimits
from homelab_gateway.config import Config, with_backlog
from homelab_gateway.errors import GatewayError
from homelab_gateway.heap import settle_heap
from homelab_gateway.inflight import InFlight
from homelab_gateway.limiter import PositionedSemaphore
from homelab_gateway.llm import Messages
from homelab_gateway.pool import Pool
from homelab_gateway.proxy import ProxyRoute, ReverseProxy
from homelab_gateway.readiness import Readiness
from homelab_gateway.telemetry import Telemetry
from homelab_gateway.upstream import RawHTTP, Upstream, UpstreamPool, llm_http
from homelab_gateway.web import GatewayApp

log = Logger()
PROFILE_ENV = "HOMELAB_GATEWAY_PROFILE"  # a path: profile the reactor thread, write stats on stop


class Gateway:
    def __init__(self, config: Config, reactor: Any) -> None:
        self.config = config
        self.reactor = reactor
        server = config.server
        self.http_pool = UpstreamPool(reactor, persistent=True)
        self.http_pool.maxPersistentPerHost = max(
            [16, *(u.slots for u in config.upstreams.values())]
        )
        self.pools: dict[str, Pool] = {}
        for name, upstream in config.upstreams.items():
            self.pools[name] = Pool(
                upstream=self._client(
                    name,
                    upstream.url,
                    upstream.connect_timeout,
                    upstream.idle_timeout,
                    upstream.api_key,
                    transparent=False,
                ),
                slots=PositionedSemaphore(
                    upstream.slots, reactor, queue_limit=upstream.queue_limit
                ),
                queue_timeout=upstream.queue_timeout,
                continuous_usage_stats=upstream.continuous_usage_stats,
            )
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
        self.telemetry = Telemetry(reactor, self.pools)
        self.inflight = InFlight(reactor, self.telemetry)
        self.readiness = Readiness(self.pools, reactor, server.probe_interval)
        self.access = AccessPolicy(
            config.auth.api_keys,
            protect_metrics=config.auth.protect_metrics,
            cors_origins=server.cors_origins,
        )
        self.app = GatewayApp(
            models=config.models,
            pools=self.pools,
            proxy=ReverseProxy(routes, reactor, server.write_stall_timeout),
            messages=Messages(
                models=config.models,
                pools=self.pools,
                clock=reactor,
                ping_interval=server.ping_interval,
                write_stall_timeout=server.write_stall_timeout,
            ),
            access=self.access,
            inflight=self.inflight,
            telemetry=self.telemetry,
            readiness=self.readiness,
        )
        limits = WireLimits(
            max_body_bytes=server.max_body_bytes,
            max_header_bytes=server.max_header_bytes,
            request_timeout=server.request_timeout,
        )
        self.site = GatewaySite(self.app.app.resource(), limits, reactor=reactor)
        self.site.displayTracebacks = False

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
        agent = Agent(self.reactor, connectTimeout=connect_timeout, pool=self.http_pool)
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
        self.readiness.start()

    async def drain(self) -> None:
        """Refuse new work, fail the queued, give in-flight requests the grace period."""
        self.inflight.draining = True
        for pool in self.pools.values():
            pool.slots.fail_waiting(
                GatewayError(529, "the gateway is shutting down", outcome="shutdown")
            )
        await self.inflight.drain(self.config.server.shutdown_grace)

    async def close(self) -> None:
        self.readiness.stop()
        for pool in self.pools.values():
            pool.slots.close()
        await self.http_pool.closeCachedConnections()


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
    def __init__(
        self,
        config: Config,
        reactor: Any,
        listen: str | None = None,
        json_log: IO[str] | None = None,
    ) -> None:
        self.config = config
        self.reactor = reactor
        self.listen = listen or config.server.listen
        self.json_log = json_log
        self.gateway: Gateway | None = None
        self.port: IListeningPort | None = None
        self._profiler: cProfile.Profile | None = None

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
            endpoint = serverFromString(self.reactor, with_backlog(self.listen))
            self.port = listen_now(endpoint, self.gateway.site)
        except CannotListenError as e:
            raise SystemExit(
                f"homelab-gateway: cannot listen on {self.listen!r}: {e.socketError or e}"
            ) from None
        log.info("homelab-gateway listening on {address}", address=describe(self.port))

    def startService(self) -> None:
        super().startService()
        assert self.gateway is not None
        self.gateway.start()
        settle_heap()
        if os.environ.get(PROFILE_ENV):
            self._profiler = cProfile.Profile()
            self._profiler.enable()

    def stopService(self) -> Deferred[None]:
        super().stopService()
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
            # Written here, not at exit: twistd re-raises SIGTERM, which ends the process.
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
