"""Where the cluster's Redis primary is, when Redis Sentinel manages it (`[cluster] sentinels`).

The primary is asked of the Sentinels before every connection (txredisapi's `Sentinel`, which
takes the first Sentinel to name a primary that none thinks down). Each Sentinel is watched for
`+switch-master`, subscribed before the first question so that a failover after an answer is
always told: the gateway then connects to the promoted replica and rebuilds its lines there,
counting its running requests again as after a restart (a replica may not have the last
writes). txredisapi's own `master_for` connection is not used: it reconnects by itself, and the
line must see the link go and come back to rebuild.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import txredisapi
from twisted.internet.defer import Deferred
from twisted.internet.defer import TimeoutError as DeferredTimeout
from twisted.internet.endpoints import HostnameEndpoint
from twisted.logger import Logger

from homelab_gateway.config import ClusterConfig

log = Logger()
SWITCH = "+switch-master"  # Sentinel's event: "<name> <old ip> <old port> <new ip> <new port>"


class _Switches(txredisapi.SubscriberProtocol):
    def connectionMade(self) -> Any:
        ready = super().connectionMade()
        # Lost before its reply (the Sentinel paused or restarted, or the stop): the watch
        # connects again, and subscribes again.
        subscribed = self.subscribe(SWITCH)
        subscribed.addCallbacks(lambda _: self.factory.primary.heard(self.factory), lambda _: None)
        return ready

    def connectionLost(self, why: Any) -> Any:
        self.factory.subscribed = False
        return super().connectionLost(why)

    def messageReceived(self, pattern: Any, channel: Any, message: Any) -> None:
        self.factory.primary.switched(str(message))


class _Watch(txredisapi.SubscriberFactory):  # type: ignore[misc]
    """One Sentinel's `+switch-master` events, reconnecting while the gateway runs."""

    protocol = _Switches
    maxDelay = 5.0

    def __init__(self, primary: Primary, password: str | None) -> None:
        super().__init__()
        self.primary = primary
        self.password = password
        self.subscribed = False


class Primary:
    """The Sentinels of `config`: `find` the primary; `watch` for a switch, told to
    `on_switch` with the new address."""

    def __init__(
        self, config: ClusterConfig, reactor: Any, on_switch: Callable[[tuple[str, int]], None]
    ) -> None:
        self.config = config
        self.reactor = reactor
        self.on_switch = on_switch
        self._sentinels: Any = None
        self._watches: list[_Watch] = []
        self._waiting: list[Deferred[None]] = []  # `watch` calls, until a Sentinel subscribes

    async def find(self) -> tuple[str, int]:
        """The primary's address; MasterNotFoundError (a link failure) if no Sentinel names
        one in a lease."""
        if self._sentinels is None:
            self._sentinels = txredisapi.Sentinel(
                list(self.config.sentinels),
                password=self.config.sentinel_password,
                convertNumbers=False,
            )
            for (host, port), sentinel in zip(
                self.config.sentinels, self._sentinels.sentinels, strict=True
            ):  # `_connected`: the factory's Deferred of its first connection (txredisapi 1.6)
                sentinel._connected.addErrback(self._refused, f"{host}:{port}")
        # txredisapi's `discover_master`, with a timer that a cancelled attempt (a stop)
        # cancels too: the first Sentinel to name a primary in a good state is believed.
        name, sentinels = self.config.sentinel_master, self._sentinels
        found: Deferred[tuple[str, int]] = Deferred()

        def answered(masters: dict[str, Any]) -> None:
            state = masters.get(name)
            if not found.called and state and sentinels.check_master_state(state):
                found.callback((str(state["ip"]), int(state["port"])))

        for sentinel in sentinels.sentinels:
            sentinel.sentinel_masters().addCallbacks(answered, lambda _: None)
        try:
            return await found.addTimeout(self.config.lease, self.reactor)
        except DeferredTimeout:
            raise txredisapi.MasterNotFoundError(f"No master found for {name}") from None

    async def watch(self) -> None:
        """Subscribed to a Sentinel's switches, within a lease (TimeoutError if not): asked
        before `find`, so that a failover after its answer is told."""
        if not self._watches:
            for host, port in self.config.sentinels:
                watch = _Watch(self, self.config.sentinel_password)
                watch.deferred.addErrback(self._refused, f"{host}:{port}")
                watch.startConnecting(HostnameEndpoint(self.reactor, host, port))
                self._watches.append(watch)
        if any(watch.subscribed for watch in self._watches):
            return
        d: Deferred[None] = Deferred()
        self._waiting.append(d)
        try:
            await d.addTimeout(self.config.lease, self.reactor)
        except DeferredTimeout:
            raise TimeoutError(
                f"no Sentinel took the subscription to its switches in {self.config.lease:g}s"
            ) from None
        finally:
            if d in self._waiting:
                self._waiting.remove(d)

    def heard(self, watch: _Watch) -> None:
        """`watch`'s Sentinel answered the subscription."""
        watch.subscribed = True
        waiting, self._waiting = self._waiting, []
        for d in waiting:
            d.callback(None)

    def _refused(self, failure: Any, where: str) -> None:
        """A Sentinel refused a connection's AUTH (txredisapi then stops trying it)."""
        log.warn(
            "Sentinel {where} refused the gateway: {error}",
            where=where,
            error=failure.getErrorMessage(),
        )

    def switched(self, message: str) -> None:
        name, *_, host, port = message.split()
        if name == self.config.sentinel_master:
            self.on_switch((host, int(port)))

    async def close(self) -> None:
        for watch in self._watches:
            await watch.disconnect()
        self._watches = []
        if self._sentinels is not None:
            await self._sentinels.disconnect()
            self._sentinels = None
