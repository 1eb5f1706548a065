"""The upstream connection pool: Twisted's, minus the ways it hands out a dead connection, and
handing connections out in the order they were asked for.

Order matters because the line grants slots in order, and the upstream (vLLM's scheduler is
first come, first served within a priority) should see the requests in that order. Twisted's
pool gives an idle connection to whoever asks while it has one and opens a new connection for
whoever asks while it has none; a request granted while no connection was idle then waits for
its connect, and one granted a moment later, when the previous answer's connection has come
back, overtakes it (a burst of 5,000 saw one or two such overtakes: the first grants after the
line's blockers were cut, and an answer whose `[DONE]` granted the next slot before its body's
end gave the connection back). Here asks for a key wait in a first-in, first-out line while
anyone is waiting: the oldest is served by the first connection to be ready, new or returned.
"""

from __future__ import annotations

import socket
from collections import deque
from typing import Any

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IDelayedCall
from twisted.python.failure import Failure
from twisted.web.client import HTTPConnectionPool, _HTTP11ClientFactory


class _QuietFactory(_HTTP11ClientFactory):
    """Twisted's factory for one upstream connection, without its "Starting factory" and
    "Stopping factory" log lines: a pair for every connection, where the request log has one
    line per request."""

    noisy = False


class _Asks:
    """The asks for one key that wait for a connection, and the connects made for them."""

    __slots__ = ("connecting", "endpoint", "serving", "waiting")

    def __init__(self, endpoint: Any) -> None:
        self.endpoint = endpoint
        self.waiting: deque[Deferred[Any]] = deque()  # oldest first
        self.connecting: list[Deferred[Any]] = []  # at least one per waiting ask, oldest first
        self.serving: IDelayedCall | None = None  # a returned connection to hand on next turn


class UpstreamPool(HTTPConnectionPool):
    """Persistent upstream connections, handed out in the order asked, never a dead one.

    A response can finish in the same read in which we asked its connection to close (the
    translator gave up on a stream whose `[DONE]` came in that read); Twisted would cache that
    closing connection. An idle connection is kept 240 s by default, while uvicorn (vLLM)
    closes its side after 5 s. And an idle connection whose close (or anything else: an idle
    connection has nothing to say) has arrived but not yet been read by the reactor looks
    alive: it is checked before a request is written on it, as urllib3 does, because after
    the write nothing can tell whether the upstream read the request.

    While nobody waits, an ask is served as Twisted serves it: an idle connection at once, or
    a new one. An ask that finds no idle connection waits in its key's line with a connect
    made for it; the first connection ready, whether that connect's or one an answer gave
    back, goes to the oldest waiting ask. A connect that fails fails the oldest ask only when
    the connects still under way are fewer than the asks waiting; an ask withdrawn (its
    request cancelled) cancels a connect nobody else needs, as Twisted's pool would.
    """

    cachedConnectionTimeout = 4
    _factory = _QuietFactory  # HTTPConnectionPool's documented hook for its connections' factory

    def __init__(self, reactor: Any, persistent: bool = True) -> None:
        super().__init__(reactor, persistent)
        self._asks: dict[Any, _Asks] = {}
        self._closed = False

    def closeCachedConnections(self) -> Deferred[None]:
        """Close the idle connections, and from now on each one an answer gives back: a body
        that ends after the gateway closed would otherwise be kept, with its idle timer. A
        connect still under way for an ask a returned connection served is cancelled: it
        would otherwise finish after the close, or keep its attempt timer past it."""
        self._closed = True
        for key, asks in list(self._asks.items()):
            connecting, asks.connecting = asks.connecting, []
            for connect in connecting:
                connect.cancel()
            self._tidy(key, asks)
        return super().closeCachedConnections()

    def getConnection(self, key: Any, endpoint: Any) -> Deferred[Any]:
        asks = self._asks.get(key)
        if asks is None:
            if self._idle(key):
                return super().getConnection(key, endpoint)  # nobody ahead: as Twisted
            asks = self._asks[key] = _Asks(endpoint)
        asks.endpoint = endpoint
        ask: Deferred[Any] = Deferred(lambda d: self._withdraw(key, d))
        asks.waiting.append(ask)
        self._serve(key, asks)
        return ask

    def _putConnection(self, key: Any, connection: Any) -> None:
        transport = connection.transport
        if transport is None or getattr(transport, "disconnecting", False):
            return  # already closing: its connectionLost takes it out of every list
        if self._closed:
            transport.loseConnection()
            return
        super()._putConnection(key, connection)
        asks = self._asks.get(key)
        if asks is not None and asks.waiting and asks.serving is None:
            # Not now: Twisted calls this before it has let go of the response just ended, so
            # a request written on the connection in this call would lose its parser.
            asks.serving = self._reactor.callLater(0, self._serve_returned, key)

    def _serve_returned(self, key: Any) -> None:
        asks = self._asks[key]
        asks.serving = None
        self._serve(key, asks)

    def _idle(self, key: Any) -> bool:
        """Whether an idle connection can be handed out now, after dropping those that cannot:
        lost while idle, or with input waiting (see the class)."""
        connections = self._connections.get(key)
        while connections and (connections[0].state != "QUIESCENT" or _has_input(connections[0])):
            stale = connections.pop(0)
            self._timeouts.pop(stale).cancel()
            if stale.state == "QUIESCENT":
                stale.transport.abortConnection()
        return bool(connections)

    def _serve(self, key: Any, asks: _Asks) -> None:
        """Idle connections to the oldest asks; a connect under way for every ask left."""
        while asks.waiting and self._idle(key):
            super().getConnection(key, asks.endpoint).chainDeferred(asks.waiting.popleft())
        while len(asks.connecting) < len(asks.waiting):
            connect = self._newConnection(key, asks.endpoint)
            asks.connecting.append(connect)
            connect.addBoth(self._connected, key, connect)
        self._tidy(key, asks)

    def _connected(self, result: Any, key: Any, connect: Deferred[Any]) -> None:
        asks = self._asks.get(key)
        if asks is None or connect not in asks.connecting:
            return  # cancelled as nobody's (`_withdraw`)
        asks.connecting.remove(connect)
        if isinstance(result, Failure):
            if len(asks.waiting) > len(asks.connecting):
                asks.waiting.popleft().errback(result)
        elif asks.waiting:
            asks.waiting.popleft().callback(result)
        else:
            self._putConnection(key, result)  # asked for by a request that left: kept
        self._tidy(key, asks)

    def _withdraw(self, key: Any, ask: Deferred[Any]) -> None:
        asks = self._asks.get(key)
        if asks is None or ask not in asks.waiting:
            return
        asks.waiting.remove(ask)
        while len(asks.connecting) > len(asks.waiting):
            asks.connecting.pop().cancel()
        self._tidy(key, asks)

    def _tidy(self, key: Any, asks: _Asks) -> None:
        if asks.waiting:
            return
        if asks.serving is not None:
            asks.serving.cancel()
            asks.serving = None
        if not asks.connecting and self._asks.get(key) is asks:
            del self._asks[key]


def _has_input(connection: Any) -> bool:
    """Whether an idle connection's socket has input waiting (the peer's close, or a reset)."""
    transport = connection.transport
    while transport is not None:
        handle = transport.getHandle() if hasattr(transport, "getHandle") else None
        if isinstance(handle, socket.socket):
            try:
                handle.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
            except BlockingIOError:
                return False  # nothing waiting: the connection is as idle as it looks
            except OSError:
                return True  # a reset
            return True  # the peer's close (b""), or bytes an idle connection should not send
        transport = getattr(transport, "transport", None)  # TLS: the TCP transport beneath
    return False
