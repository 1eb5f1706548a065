"""Writes to a client go out at once when nothing is buffered (`channel.SendAtOnce`), and
Twisted's way otherwise: the same bytes in the same order, and nothing after an abort."""

from __future__ import annotations

from typing import Any

from twisted.internet import reactor
from twisted.internet.endpoints import TCP4ClientEndpoint, connectProtocol
from twisted.internet.protocol import Factory, Protocol
from twisted.trial.unittest import TestCase

from homelab_gateway.channel import SendAtOnce, send_at_once
from tests.helpers import wait_for


class _Collect(Protocol):
    def __init__(self) -> None:
        self.received: list[bytes] = []
        self.lost = False

    def dataReceived(self, data: bytes) -> None:
        self.received.append(data)

    def connectionLost(self, reason: Any) -> None:
        self.lost = True

    @property
    def data(self) -> bytes:
        return b"".join(self.received)


class SendAtOnceTests(TestCase):
    async def _connected(self) -> tuple[Any, _Collect]:
        """A server-side transport from a port given `send_at_once`, and the client's end."""
        accepted: list[Protocol] = []

        class Server(Protocol):
            def connectionMade(self) -> None:
                accepted.append(self)

        port = reactor.listenTCP(0, Factory.forProtocol(Server), interface="127.0.0.1")
        self.addCleanup(port.stopListening)
        send_at_once(port)
        client = _Collect()
        endpoint = TCP4ClientEndpoint(reactor, "127.0.0.1", port.getHost().port)
        await connectProtocol(endpoint, client)
        await wait_for(lambda: bool(accepted), what="the connection to be accepted")
        transport = accepted[0].transport
        self.addCleanup(self._close, transport, client)
        return transport, client

    async def _close(self, transport: Any, client: _Collect) -> None:
        transport.abortConnection()
        await wait_for(lambda: client.lost, what="the client to see the connection close")

    async def test_a_write_to_an_idle_connection_is_sent_before_the_reactor_turns(self) -> None:
        transport, client = await self._connected()
        self.assertIsInstance(transport, SendAtOnce)
        transport.writeSequence([b"event: ping\n", b"data: {}\n\n"])
        self.assertNotIn(transport, reactor.getWriters(), "left for the next iteration")
        await wait_for(lambda: client.data == b"event: ping\ndata: {}\n\n", what="the frame")

    async def test_what_the_socket_does_not_take_follows_in_order(self) -> None:
        transport, client = await self._connected()
        big = bytes(range(256)) * (64 * 1024)  # 16 MB: more than the socket buffers hold
        transport.write(big)
        transport.write(b"after")
        self.assertIn(transport, reactor.getWriters(), "the rest waits for room, Twisted's way")
        await wait_for(lambda: len(client.data) == len(big) + 5, what="every byte")
        self.assertEqual(client.data, big + b"after")

    async def test_nothing_is_sent_once_the_connection_is_aborted(self) -> None:
        transport, client = await self._connected()
        transport.write(b"before")
        await wait_for(lambda: client.data == b"before", what="the first write")
        transport.abortConnection()
        transport.write(b"after the abort")
        await wait_for(lambda: client.lost, what="the client to see the abort")
        self.assertEqual(client.data, b"before")
