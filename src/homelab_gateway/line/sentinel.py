"""Where the cluster's Redis primary is, when Redis Sentinel manages it (`[cluster] sentinels`).

The primary is asked of the Sentinels before every connection (txredisapi's `Sentinel`, which
takes the first Sentinel to name a primary that none thinks down), and each Sentinel is
watched for `+switch-master`, subscribed before the first question, so that a failover after an
answer is always heard: it drops the link (or the connection under way), so the gateway connects
to the promoted replica and rebuilds its lines there, counting its running requests again as
after a restart (a replica may not have the last writes). txredisapi's own `master_for`
connection is not used: it reconnects by itself, and the line must see the link go and come
back to rebuild.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import txredisapi
from twisted.internet.defer import Deferred, DeferredList, succeed
from twisted.internet.defer import TimeoutError as DeferredTimeout
from twisted.internet.endpoints import HostnameEndpoint

from homelab_gateway.config import ClusterConfig

SWITCH = "+switch-master"  # Sentinel's event: "<name> <old ip> <old port> <new ip> <new port>"


class _Switches(txredisapi.SubscriberProtocol):
    def connectionMade(self) -> Any:
        ready = super().connectionMade()
        self.subscribe(SWITCH).addCallback(lambda _: self.factory.heard())
        return ready

    def connectionLost(self, why: Any) -> Any:
        self.factory.subscribed = False
        return super().connectionLost(why)

    def messageReceived(self, pattern: Any, channel: Any, message: Any) -> None:
        self.factory.on_switch(str(message))


class _Watch(txredisapi.SubscriberFactory):  # type: ignore[misc]
    """One Sentinel's `+switch-master` events, reconnecting while the gateway runs."""

    protocol = _Switches
    maxDelay = 5.0

    def __init__(self, on_switch: Callable[[str], None], password: str | None) -> None:
        super().__init__()
        self.on_switch = on_switch
        self.password = password
        self.subscribed = False
        self._waiting: list[Deferred[None]] = []

    def heard(self) -> None:
        self.subscribed = True
        waiting, self._waiting = self._waiting, []
        for d in waiting:
            d.callback(None)

    def when_subscribed(self) -> Deferred[None]:
        if self.subscribed:
            return succeed(None)
        d: Deferred[None] = Deferred()
        self._waiting.append(d)
        return d


class Primary:
    """The Sentinels of `config`: `find` the primary; `watch` for a switch, told to
    `on_switch` with the new address."""

    def __init__(
        self, config: ClusterConfig, reactor: Any, on_switch: Callable[[str], None]
    ) -> None:
        self.config = config
        self.reactor = reactor
        self.on_switch = on_switch
        self._sentinels: Any = None
        self._watches: list[_Watch] = []

    async def find(self) -> tuple[str, int]:
        """The primary's address; MasterNotFoundError (a link failure) if no Sentinel names
        one in a lease."""
        if self._sentinels is None:
            self._sentinels = txredisapi.Sentinel(
                list(self.config.sentinels),
                password=self.config.sentinel_password,
                convertNumbers=False,
            )
            self._sentinels.discovery_timeout = self.config.lease
        host, port = await self._sentinels.discover_master(self.config.sentinel_master)
        return str(host), int(port)

    async def watch(self) -> None:
        """Subscribed to a Sentinel's switches, within a lease (TimeoutError if not): asked
        before `find`, so a failover after its answer is told."""
        if not self._watches:
            for host, port in self.config.sentinels:
                watch = _Watch(self._switched, self.config.sentinel_password)
                watch.startConnecting(HostnameEndpoint(self.reactor, host, port))
                self._watches.append(watch)
        first = DeferredList(
            [watch.when_subscribed() for watch in self._watches],
            fireOnOneCallback=True,
            consumeErrors=True,
        )
        try:
            await first.addTimeout(self.config.lease, self.reactor)
        except DeferredTimeout:
            raise TimeoutError("no Sentinel took the subscription to its switches") from None

    def _switched(self, message: str) -> None:
        name, *_, host, port = message.split()
        if name == self.config.sentinel_master:
            self.on_switch(f"{host}:{port}")

    async def close(self) -> None:
        for watch in self._watches:
            await watch.disconnect()
        self._watches = []
        if self._sentinels is not None:
            await self._sentinels.disconnect()
            self._sentinels = None
