"""From a Config to a listening gateway: the objects one running daemon holds, and its Service.

`Gateway` builds the per-upstream clients and slots and the web site from the config, taking
the reactor as a parameter so tests can hand it their own. `GatewayService` binds the listening
port in `privilegedStartService`, so a port that cannot be bound stops start-up with one line
and a non-zero exit instead of a daemon that runs and serves nothing.
"""

from __future__ import annotations

from typing import Any

from twisted.application.service import MultiService, Service
from twisted.internet.defer import Deferred, DeferredList, maybeDeferred
from twisted.internet.endpoints import serverFromString
from twisted.internet.error import CannotListenError
from twisted.internet.interfaces import IListeningPort, IStreamServerEndpoint
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.client import Agent, HTTPConnectionPool
from twisted.web.server import Site

from homelab_gateway.config import Config
from homelab_gateway.limiter import PositionedSemaphore
from homelab_gateway.llm import Pool
from homelab_gateway.proxy import ProxyRoute, ReverseProxy
from homelab_gateway.upstream import RawHTTP, Upstream, llm_http
from homelab_gateway.web import GatewayApp

log = Logger()


class Gateway:
    def __init__(self, config: Config, reactor: Any) -> None:
        self.config = config
        self.http_pool = HTTPConnectionPool(reactor, persistent=True)
        self.http_pool.maxPersistentPerHost = max(
            [16, *(u.slots for u in config.upstreams.values())]
        )
        self.pools: dict[str, Pool] = {}
        for name, upstream in config.upstreams.items():
            self.pools[name] = Pool(
                upstream=self._client(
                    reactor,
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
            name = route.upstream or route.prefix
            api_key = config.upstreams[route.upstream].api_key if route.upstream else None
            client = self._client(
                reactor,
                name,
                url,
                route.connect_timeout,
                route.idle_timeout,
                api_key,
                transparent=True,
            )
            routes.append(ProxyRoute(prefix=route.prefix.encode(), upstream=client, pool=pool))
        self.app = GatewayApp(
            models=config.models,
            pools=self.pools,
            proxy=ReverseProxy(routes, reactor),
            clock=reactor,
            ping_interval=config.server.ping_interval,
            max_body_bytes=config.server.max_body_bytes,
        )
        self.site = Site(self.app.app.resource())
        self.site.displayTracebacks = False

    def _client(
        self,
        reactor: Any,
        name: str,
        url: str,
        connect_timeout: float,
        idle_timeout: float,
        api_key: str | None,
        *,
        transparent: bool,
    ) -> Upstream:
        agent = Agent(reactor, connectTimeout=connect_timeout, pool=self.http_pool)
        return Upstream(
            name=name,
            url=url,
            http=RawHTTP(agent) if transparent else llm_http(agent),
            clock=reactor,
            connect_timeout=connect_timeout,
            idle_timeout=idle_timeout,
            api_key=api_key,
        )

    def close(self) -> Deferred[Any]:
        for pool in self.pools.values():
            pool.slots.close()
        return self.http_pool.closeCachedConnections()


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
    def __init__(self, config: Config, reactor: Any, listen: str | None = None) -> None:
        self.config = config
        self.reactor = reactor
        self.listen = listen or config.server.listen
        self.gateway: Gateway | None = None
        self.port: IListeningPort | None = None

    def privilegedStartService(self) -> None:
        super().privilegedStartService()
        self.gateway = Gateway(self.config, self.reactor)
        try:
            self.port = listen_now(serverFromString(self.reactor, self.listen), self.gateway.site)
        except CannotListenError as e:
            raise SystemExit(
                f"homelab-gateway: cannot listen on {self.listen!r}: {e.socketError or e}"
            ) from None
        log.info("homelab-gateway listening on {address}", address=describe(self.port))

    def stopService(self) -> Deferred[Any]:
        super().stopService()
        waits: list[Deferred[Any]] = []
        if self.port is not None:
            waits.append(maybeDeferred(self.port.stopListening))
        if self.gateway is not None:
            waits.append(self.gateway.close())
        return DeferredList(waits)


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
