"""Work per upstream read, not per chunk: what the batching may change (calls) and what it must
not (bytes, order, the pooled connection afterwards)."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.internet import reactor
from twisted.trial.unittest import TestCase
from twisted.web.client import Agent
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET, Site

from homelab_gateway.reads import ReadBatcher
from homelab_gateway.sse import encode_event
from homelab_gateway.translator import StreamTranslator, UpstreamDecoder
from homelab_gateway.upstream import Upstream, UpstreamPool, llm_http
from tests.helpers import Servers


def sse(document: Any) -> bytes:
    return b"data: " + json.dumps(document).encode() + b"\n\n"


def token(text: str) -> bytes:
    return sse({"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]})


def finish() -> bytes:
    return sse({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}) + sse(
        {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 3}}
    )


def client_bytes(reads: list[bytes]) -> bytes:
    """What EventStream writes for these upstream reads: each read's frames, joined."""
    decoder = UpstreamDecoder(StreamTranslator(model="m", input_tokens=1, message_id="msg_x"))
    out = b""
    for data in reads:
        out += b"".join(map(encode_event, decoder.feed(data)))
    return out + b"".join(map(encode_event, decoder.eof("u")))


@settings(max_examples=200)
@given(st.lists(st.text(max_size=6), max_size=30), st.data())
def test_frames_are_byte_identical_whether_chunks_come_one_by_one_or_joined_per_read(
    texts: list[str], data: st.DataObject
) -> None:
    chunks = [token(t) for t in texts] + [finish(), b"data: [DONE]\n\n"]
    cuts = sorted(set(data.draw(st.lists(st.integers(1, len(chunks) - 1), max_size=8))))
    reads = [b"".join(chunks[a:b]) for a, b in zip([0, *cuts], [*cuts, len(chunks)], strict=True)]
    assert client_bytes(reads) == client_bytes(chunks)


class _Socket:
    def __init__(self, protocol: Any) -> None:
        self.protocol = protocol


class _BodyTransport:
    """The shape Twisted gives a body protocol: a proxy whose `_producer` is the socket."""

    def __init__(self, protocol: Any) -> None:
        self._producer = _Socket(protocol)


class _Parser:
    """Stands for the HTTP client protocol: one socket read -> several body pieces."""

    def __init__(self) -> None:
        self.body: Any = None

    def dataReceived(self, data: bytes) -> None:
        for piece in data.split(b"|"):
            self.body(piece)


def test_the_pieces_of_one_read_are_delivered_once_joined_and_unhooked_at_the_end() -> None:
    delivered: list[bytes] = []
    batcher = ReadBatcher(delivered.append)
    parser = _Parser()
    parser.body = batcher.add
    batcher.attach(_BodyTransport(parser))
    parser.dataReceived(b"a|b|c")
    parser.dataReceived(b"d")
    assert delivered == [b"abc", b"d"]
    batcher.add(b"e")  # a piece outside any socket read (a buffered body): at once
    assert delivered[-1] == b"e"
    batcher.detach()
    assert "dataReceived" not in vars(parser)


def test_without_a_socket_to_hook_each_piece_goes_on_at_once() -> None:
    delivered: list[bytes] = []
    batcher = ReadBatcher(delivered.append)
    batcher.attach(object())
    batcher.add(b"a")
    batcher.add(b"b")
    assert delivered == [b"a", b"b"]


class _ManyChunks(Resource):
    """Answers with headers at once, then, when released, writes `count` HTTP chunks in one
    reactor turn (so they travel in one socket read, after the client took the body)."""

    isLeaf = True

    def __init__(self, count: int) -> None:
        super().__init__()
        self.count = count
        self.waiting: list[Any] = []

    def render_GET(self, request: Any) -> int:
        request.write(b"")  # the headers now
        self.waiting.append(request)
        return NOT_DONE_YET

    def release(self) -> None:
        request = self.waiting.pop()
        for i in range(self.count):
            request.write(b"%d," % i)
        request.finish()


class OneCallPerRead(TestCase):
    """A real upstream connection: 300 chunks sent together reach `on_data` in a few calls."""

    async def test_chunks_of_one_read_reach_on_data_together_and_the_connection_is_reusable(
        self,
    ) -> None:
        servers = Servers(self)
        resource = _ManyChunks(300)
        port = servers.listen(Site(resource))
        pool = UpstreamPool(reactor, persistent=True)
        self.addCleanup(pool.closeCachedConnections)
        upstream = Upstream(
            name="u",
            url=f"http://127.0.0.1:{port}",
            http=llm_http(Agent(reactor, pool=pool)),
            clock=reactor,
            connect_timeout=10,
            idle_timeout=10,
        )
        expected = b"".join(b"%d," % i for i in range(300))
        for _ in range(2):  # the second request reuses the pooled connection
            calls: list[bytes] = []
            response = await upstream.open("GET", upstream.url + "/", {}, None)
            done = upstream.stream(response, calls.append)
            resource.release()
            await done
            assert b"".join(calls) == expected
            assert len(calls) < 300
