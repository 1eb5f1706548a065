"""Writes to a client go out at once when nothing is buffered (`channel.ClientTransport`), and
Twisted's way otherwise: the same bytes in the same order, and nothing after an abort. Writes
inside `sending.ONE_SEND` go out in one send at its end: an answer's headers with its first
bytes, a pooled upstream connection's request (headers and body) before the reactor turns."""

from __future__ import annotations

import socket
from typing import Any

from twisted.internet import reactor
from twisted.internet.defer import ensureDeferred
from twisted.internet.endpoints import TCP4ClientEndpoint, connectProtocol
from twisted.internet.protocol import Factory, Protocol
from twisted.internet.testing import MemoryReactor
from twisted.trial.unittest import TestCase
from twisted.web.client import Agent
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET, Site

from homelab_gateway.sending import ONE_SEND, UpstreamTransport, reactor_for_upstreams
from homelab_gateway.upstream.client import EndpointPerHost, Upstream, llm_http
from homelab_gateway.upstream.connections import UpstreamPool
from homelab_gateway.web.channel import ClientTransport, GatewaySite, WireLimits, send_at_once
from testsupport.helpers import wait_for


class _CountingSocket:
    """A transport's socket that records each send."""

    def __init__(self, sock: socket.socket) -> None:
        self._socket = sock
        self.sends: list[bytes] = []

    def send(self, data: bytes) -> int:
        sent = self._socket.send(data)
        self.sends.append(bytes(data[:sent]))
        return sent

    def __getattr__(self, name: str) -> Any:
        return getattr(self._socket, name)


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


async def _close(transport: Any, client: _Collect) -> None:
    transport.abortConnection()
    await wait_for(lambda: client.lost, what="the client to see the connection close")


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
        self.addCleanup(_close, transport, client)
        return transport, client

    async def test_a_write_to_an_idle_connection_is_sent_before_the_reactor_turns(self) -> None:
        transport, client = await self._connected()
        self.assertIsInstance(transport, ClientTransport)
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

    async def test_writes_inside_together_go_out_in_one_send_at_its_end(self) -> None:
        transport, client = await self._connected()
        transport.socket = counting = _CountingSocket(transport.socket)
        with ONE_SEND:
            transport.write(b"HTTP/1.1 200 OK\r\n\r\n")
            with ONE_SEND:  # an inner block ends nothing
                transport.writeSequence([b"5\r\n", b"hello\r\n"])
            self.assertEqual(counting.sends, [], "sent before the block's end")
        self.assertEqual(counting.sends, [b"HTTP/1.1 200 OK\r\n\r\n5\r\nhello\r\n"])
        self.assertNotIn(transport, reactor.getWriters(), "left for the next iteration")
        await wait_for(lambda: client.data == counting.sends[0], what="the bytes")

    async def test_what_is_held_goes_before_a_close_inside_together(self) -> None:
        transport, client = await self._connected()
        with ONE_SEND:
            transport.write(b"the last words")
            transport.loseConnection()
        await wait_for(lambda: client.lost, what="the close")
        self.assertEqual(client.data, b"the last words")

    async def test_nothing_held_is_sent_once_the_connection_is_aborted(self) -> None:
        transport, client = await self._connected()
        with ONE_SEND:
            transport.write(b"held")
            transport.abortConnection()
        await wait_for(lambda: client.lost, what="the client to see the abort")
        self.assertEqual(client.data, b"")

    async def test_an_answers_headers_go_out_with_its_first_bytes(self) -> None:
        class Twice(Resource):
            isLeaf = True

            def render_GET(self, request: Any) -> Any:
                request.write(b"first")
                request.write(b"second")
                request.finish()
                return NOT_DONE_YET

        site = GatewaySite(Twice(), WireLimits(1024, 8192, 5.0))
        port = reactor.listenTCP(0, site, interface="127.0.0.1")
        self.addCleanup(port.stopListening)
        send_at_once(port)
        client = _Collect()
        endpoint = TCP4ClientEndpoint(reactor, "127.0.0.1", port.getHost().port)
        await connectProtocol(endpoint, client)
        await wait_for(lambda: bool(site.connections), what="the connection to be accepted")
        transport = next(iter(site.connections)).transport
        transport.socket = counting = _CountingSocket(transport.socket)
        client.transport.write(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        await wait_for(lambda: client.lost, what="the answer")
        sends = [data for data in counting.sends if data]  # Twisted's close sends b""
        self.assertEqual(len(sends), 3, sends)
        head, first = sends[0].split(b"\r\n\r\n")
        self.assertTrue(head.startswith(b"HTTP/1.1 200 OK"), head)
        self.assertEqual(first, b"5\r\nfirst\r\n")
        self.assertEqual(sends[1:], [b"6\r\nsecond\r\n", b"0\r\n\r\n"])


class _Answer(Resource):
    """A plain Twisted HTTP server's resource that keeps the transports it answered on."""

    isLeaf = True

    def __init__(self) -> None:
        super().__init__()
        self.transports: list[Any] = []

    def render_POST(self, request: Any) -> bytes:
        self.transports.append(request.transport)
        return b"ok"


class UpstreamSendingTests(TestCase):
    async def test_plain_http_upstreams_connect_through_a_reactor_that_sends_together(
        self,
    ) -> None:
        port = reactor.listenTCP(0, Factory.forProtocol(Protocol), interface="127.0.0.1")
        self.addCleanup(port.stopListening)
        client = _Collect()
        endpoint = TCP4ClientEndpoint(
            reactor_for_upstreams(reactor), "127.0.0.1", port.getHost().port
        )
        await connectProtocol(endpoint, client)
        self.assertIsInstance(client.transport, UpstreamTransport)
        client.transport.loseConnection()
        await wait_for(lambda: client.lost, what="the connection to close")
        memory = MemoryReactor()
        self.assertIs(reactor_for_upstreams(memory), memory, "a test's reactor records connects")

    async def test_a_pooled_connections_request_is_on_the_wire_before_the_reactor_turns(
        self,
    ) -> None:
        answer = _Answer()
        port = reactor.listenTCP(0, Site(answer), interface="127.0.0.1")
        self.addCleanup(port.stopListening)
        pool = UpstreamPool(reactor, persistent=True)
        self.addCleanup(pool.closeCachedConnections)
        agent = Agent.usingEndpointFactory(reactor, EndpointPerHost(reactor, 5.0), pool=pool)
        upstream = Upstream(
            name="box",
            url=f"http://127.0.0.1:{port.getHost().port}/v1",
            http=llm_http(agent),
            clock=reactor,
            connect_timeout=5.0,
            idle_timeout=5.0,
        )
        url = upstream.url + "/chat/completions"
        first = await upstream.open("POST", url, {}, b'{"n": 1}')
        self.assertEqual(await upstream.read_limited(first), b"ok")
        writers = set(reactor.getWriters())

        second = ensureDeferred(upstream.open("POST", url, {}, b'{"n": 2}'))
        self.assertEqual(len(answer.transports), 1)
        self.assertFalse(
            [w for w in reactor.getWriters() if isinstance(w, UpstreamTransport)],
            "left for the reactor's next iteration",
        )
        waiting = answer.transports[0].socket.recv(65536, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        self.assertTrue(waiting.startswith(b"POST /v1/chat/completions HTTP/1.1\r\n"), waiting)
        self.assertTrue(waiting.endswith(b'\r\n\r\n{"n": 2}'), waiting)
        self.assertEqual(await upstream.read_limited(await second), b"ok")
        self.assertIs(answer.transports[1], answer.transports[0], "a pooled connection")
        self.assertEqual(set(reactor.getWriters()) - writers, set())

    async def test_a_pause_during_a_read_takes_effect_when_the_read_is_done(self) -> None:
        served: list[Protocol] = []

        class Server(Protocol):
            def connectionMade(self) -> None:
                served.append(self)

        class Client(_Collect):
            """Pauses in its first read; in its second too, then resumes at once."""

            registered_after_pause: list[bool] = []

            def dataReceived(self, data: bytes) -> None:
                super().dataReceived(data)
                self.transport.pauseProducing()
                self.registered_after_pause.append(self.transport in reactor.getReaders())
                if len(self.received) == 2:
                    self.transport.resumeProducing()

        port = reactor.listenTCP(0, Factory.forProtocol(Server), interface="127.0.0.1")
        self.addCleanup(port.stopListening)
        client = Client()
        endpoint = TCP4ClientEndpoint(
            reactor_for_upstreams(reactor), "127.0.0.1", port.getHost().port
        )
        await connectProtocol(endpoint, client)
        self.addCleanup(_close, client.transport, client)
        await wait_for(lambda: bool(served), what="the connection to be accepted")
        served[0].transport.write(b"headers")
        await wait_for(lambda: client.data == b"headers", what="the first read")
        self.assertEqual(client.registered_after_pause, [True], "no epoll_ctl until the read ends")
        self.assertNotIn(client.transport, reactor.getReaders(), "paused once the read was done")
        served[0].transport.write(b"body")
        client.transport.resumeProducing()
        await wait_for(lambda: client.data == b"headersbody", what="the second read")
        self.assertIn(client.transport, reactor.getReaders(), "resumed in the read: reading")
        served[0].transport.write(b"!")
        await wait_for(lambda: client.data == b"headersbody!", what="a read after the resume")
