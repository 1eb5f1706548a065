"""Writes that go out at once, and writes that go out together.

Twisted's TCP transport only buffers a write and asks the reactor to say when the socket is
writable: the `send` comes one reactor iteration later, after an `epoll_ctl` to watch for
writability and before another to stop. `SendsAtOnce` sends a write at once when nothing is
waiting to be sent, as asyncio's transports do; whatever the kernel does not take, and every
write while anything is buffered, goes Twisted's way, with its producer pausing.

Sending at once would split what Twisted joins in its buffer: the status line and headers of
an answer and its first bytes, an upstream request's headers and its body, each a write of its
own, would each be a `send` (and a wake-up of the peer). Writes made inside `ONE_SEND` (a
context manager) are held and sent at its end, one `send` per transport.

Transports that send this way: the gateway's client connections (`channel.ClientTransport`,
installed on the listening port) at every write; the upstream connections of plain-HTTP upstreams
(`UpstreamTransport`, made by `reactor_for_upstreams`) only for writes inside `ONE_SEND`
(`Upstream.open` writes a pooled connection's request that way), all other writes Twisted's way.
"""

from __future__ import annotations

from typing import Any

from twisted.internet import tcp
from twisted.internet.posixbase import PosixReactorBase
from zope.interface import directlyProvides, providedBy


class _OneSend:
    """`with ONE_SEND:` holds the writes to `SendsAtOnce` transports until the outermost block
    ends, then sends each transport's in one `send`, in the order of their first write."""

    __slots__ = ("_depth", "_held")

    def __init__(self) -> None:
        self._depth = 0
        self._held: dict[SendsAtOnce, list[bytes]] = {}

    @property
    def holding(self) -> bool:
        return self._depth > 0

    def hold(self, transport: SendsAtOnce, data: bytes) -> None:
        if not isinstance(data, bytes):
            raise TypeError(f"Data must be bytes, not {type(data).__name__}")
        if data:
            self._held.setdefault(transport, []).append(data)

    def release(self, transport: SendsAtOnce) -> None:
        """What `transport` holds is sent now: it is about to close, and the bytes go first."""
        parts = self._held.pop(transport, None)
        if parts is not None:
            transport.send_at_once(b"".join(parts))

    def discard(self, transport: SendsAtOnce) -> None:
        """`transport` is aborted: what it holds is dropped, as Twisted drops its buffer."""
        self._held.pop(transport, None)

    def __enter__(self) -> None:
        self._depth += 1

    def __exit__(self, *exc_info: object) -> None:
        self._depth -= 1
        if self._depth or not self._held:
            return
        held, self._held = self._held, {}
        for transport, parts in held.items():
            transport.send_at_once(parts[0] if len(parts) == 1 else b"".join(parts))


ONE_SEND = _OneSend()


class SendsAtOnce(tcp.Connection):
    """A TCP connection whose `send_at_once` sends with no reactor iteration in between."""

    def send_at_once(self, data: bytes) -> None:
        if (
            data
            and not self.TLS  # startTLS: the TLS layer encrypts first
            and not self._tempDataBuffer
            and not self.dataBuffer
            and self.connected
            and not self.disconnecting
            and not self._aborting  # abortConnection: Twisted drops what is written now
            and not self._writeDisconnected
        ):
            try:
                sent = self.socket.send(data)
            except OSError:
                # No room now (EAGAIN) or a broken socket: buffered below, where Twisted's own
                # send waits for room, or meets the error and closes the connection.
                sent = 0
            if sent == len(data):
                return
            data = data[sent:]
        self.buffer(data)

    def buffer(self, data: bytes) -> None:
        """Twisted's own write: buffered, sent when the reactor finds the socket writable."""
        tcp.Connection.write(self, data)

    def write(self, data: bytes) -> None:
        if ONE_SEND.holding:
            ONE_SEND.hold(self, data)
        else:
            self.send_at_once(data)

    def writeSequence(self, iovec: Any) -> None:
        self.write(b"".join(iovec))

    def loseConnection(self, *args: Any) -> None:
        ONE_SEND.release(self)
        super().loseConnection(*args)

    def abortConnection(self) -> None:
        ONE_SEND.discard(self)
        super().abortConnection()


class UpstreamTransport(SendsAtOnce, tcp.Client):
    """An upstream connection: writes inside `ONE_SEND` are sent together at its end, at once;
    every other write Twisted's way. A fresh connection's request is written when the connection
    is made, outside any `ONE_SEND`, and would otherwise go out as two sends (headers, body).

    A pause asked for while a read is being handled takes effect when the read is done, unless
    a resume came first: Twisted's HTTP client pauses the connection when a response's headers
    are in and resumes it when the body is asked for, which the gateway does in the same read,
    and each of the two cost an `epoll_ctl` (the reactor reads the socket again only after
    this read anyway, so no byte arrives in between either way)."""

    _in_read = False
    _pause_after_read = False

    def write(self, data: bytes) -> None:
        if ONE_SEND.holding:
            ONE_SEND.hold(self, data)
        else:
            self.buffer(data)

    def doRead(self) -> Any:
        self._in_read = True
        try:
            return super().doRead()
        finally:
            self._in_read = False
            if self._pause_after_read:
                self._pause_after_read = False
                super().pauseProducing()

    def pauseProducing(self) -> None:
        if self._in_read:
            self._pause_after_read = True
        else:
            super().pauseProducing()

    def resumeProducing(self) -> None:
        if self._pause_after_read:
            self._pause_after_read = False
        else:
            super().resumeProducing()


class _Connector(tcp.Connector):
    def _makeTransport(self) -> UpstreamTransport:
        # Twisted's one place that names the transport class of a connection it makes (an
        # underscored hook of `BaseConnector`); if it is ever renamed, connections are plain
        # `tcp.Client`s again and writes go Twisted's way.
        return UpstreamTransport(self.host, self.port, self.bindAddress, self, self.reactor)


class _ConnectsUpstreams:
    """The reactor, but for `connectTCP`, which makes `UpstreamTransport` connections. It is
    what the plain-HTTP upstream endpoints are given (`HostnameEndpoint` resolves names and
    schedules its attempts through it as through the reactor)."""

    def __init__(self, reactor: PosixReactorBase) -> None:
        self._reactor = reactor
        directlyProvides(self, providedBy(reactor))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._reactor, name)

    def connectTCP(
        self,
        host: str,
        port: int,
        factory: Any,
        timeout: float = 30.0,
        bindAddress: Any = None,
    ) -> tcp.Connector:
        connector = _Connector(host, port, factory, timeout, bindAddress, self._reactor)
        connector.connect()
        return connector


def reactor_for_upstreams(reactor: Any) -> Any:
    """What plain-HTTP upstream endpoints should connect through: `reactor` itself unless it is
    one of Twisted's POSIX reactors (a test's memory reactor records connections instead)."""
    if isinstance(reactor, PosixReactorBase):
        return _ConnectsUpstreams(reactor)
    return reactor
