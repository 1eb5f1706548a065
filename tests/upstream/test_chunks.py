"""Work per upstream read, not per chunk: what decoding a whole read at once may change (calls)
and what it must not (bytes, the end of the body, errors, the pooled connection afterwards)."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.serialization import Encoding
from cryptography.x509.oid import NameOID
from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.internet import reactor, ssl
from twisted.protocols.policies import WrappingFactory
from twisted.trial.unittest import TestCase
from twisted.web import http
from twisted.web.client import Agent, BrowserLikePolicyForHTTPS
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET, Site

from homelab_gateway.core.chunks import ChunkedBody, MalformedChunks
from homelab_gateway.core.sse import encode_event
from homelab_gateway.core.translator import StreamTranslator, UpstreamDecoder
from homelab_gateway.upstream.client import Upstream, WholeReads, llm_http
from homelab_gateway.upstream.connections import UpstreamPool
from testsupport.helpers import Servers


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


@st.composite
def chunked_bodies(draw: st.DrawFn) -> tuple[list[bytes], bytes]:
    """A chunked body as servers write it, in the shapes this decoder takes and in those it
    leaves to Twisted: size lines in either case or zero-padded past 16 digits, extensions,
    trailers, and the next response's bytes behind the last chunk."""
    payloads = draw(st.lists(st.binary(min_size=1, max_size=40), max_size=20))
    body = b""
    for payload in payloads:
        size = b"%x" % len(payload)
        size = draw(st.sampled_from([size, size.upper(), size.zfill(draw(st.integers(1, 18)))]))
        extension = draw(st.sampled_from([b"", b"", b"", b";name=value", b";x"]))
        body += size + extension + b"\r\n" + payload + b"\r\n"
    body += b"0\r\n" + draw(st.sampled_from([b"", b"X-Trailer: 1\r\n"])) + b"\r\n"
    return payloads, body


def cut(data: bytes, draw: st.DrawFn) -> list[bytes]:
    points = sorted(set(draw(st.lists(st.integers(0, len(data)), max_size=12))))
    return [data[a:b] for a, b in zip([0, *points], [*points, len(data)], strict=True)]


def decode(reads: list[bytes], take_over_at: int | None, end: bool = False) -> tuple[Any, ...]:
    """Twisted's decoder fed `reads`, alone (`take_over_at` None) or with `WholeReads` in
    front of it from that read on: (data, the bytes after the body, failed, per-read calls)."""
    got: list[bytes] = []
    finished: list[bytes] = []
    twisted = http._ChunkedTransferDecoder(got.append, finished.append)
    decoder: Any = twisted
    calls = []
    try:
        for i, data in enumerate(reads):
            if i == take_over_at:
                decoder = WholeReads(twisted)
            before = len(got)
            decoder.dataReceived(data)
            calls.append(len(got) - before)
        if end:
            decoder.noMoreData()
    except Exception:
        return None, None, True, calls
    return b"".join(got), finished, False, calls


@settings(max_examples=500)
@given(chunked_bodies(), st.binary(max_size=8), st.data())
def test_whole_reads_decode_what_twisted_decodes(
    body: tuple[list[bytes], bytes], after: bytes, data: st.DataObject
) -> None:
    payloads, encoded = body
    reads = cut(encoded[:-1], data.draw)
    reads[-1] += encoded[-1:] + after  # the body's end and what follows it in one read
    take_over_at = data.draw(st.integers(0, len(reads) - 1))
    alone = decode(reads, None)
    assert alone[:3] == (b"".join(payloads), [after], False)
    assert decode(reads, take_over_at)[:3] == alone[:3]


@settings(max_examples=300)
@given(chunked_bodies(), st.data())
def test_a_body_cut_short_is_data_loss_either_way(
    body: tuple[list[bytes], bytes], data: st.DataObject
) -> None:
    _, encoded = body
    short = encoded[: data.draw(st.integers(0, len(encoded) - 1))]
    reads = cut(short, data.draw)
    take_over_at = data.draw(st.integers(0, len(reads) - 1))
    assert decode(reads, None, end=True)[2] is True
    assert decode(reads, take_over_at, end=True)[2] is True


@settings(max_examples=400)
@given(chunked_bodies(), st.data())
def test_a_damaged_body_fails_where_twisted_fails(
    body: tuple[list[bytes], bytes], data: st.DataObject
) -> None:
    """One byte changed, dropped or added anywhere: the same verdict, and the same data when
    the damage still decodes."""
    _, encoded = body
    at = data.draw(st.integers(0, len(encoded) - 1))
    byte = bytes([data.draw(st.sampled_from(b"0aF\r\n;: x\x00"))])
    damaged = data.draw(
        st.sampled_from(
            [
                encoded[:at] + byte + encoded[at + 1 :],
                encoded[:at] + encoded[at + 1 :],
                encoded[:at] + byte + encoded[at:],
            ]
        )
    )
    reads = cut(damaged, data.draw)
    take_over_at = data.draw(st.integers(0, len(reads) - 1))
    assert decode(reads, take_over_at, end=True)[:3] == decode(reads, None, end=True)[:3]


def test_every_chunk_of_a_read_comes_out_in_one_piece() -> None:
    encoded = b"".join(b"%x\r\n%d,\r\n" % (len(b"%d," % i), i) for i in range(300))
    data, _, failed, calls = decode([encoded[:1000], encoded[1000:]], 0)
    assert (data, failed) == (b"".join(b"%d," % i for i in range(300)), False)
    assert calls == [1, 1]


def test_the_decoder_alone_returns_what_it_does_not_take() -> None:
    decoder = ChunkedBody()
    assert decoder.feed(b"3\r\nabc\r\n4\r\nde") == (b"abcde", None)
    assert decoder.feed(b"fg\r\n2;ext\r\nhi\r\n") == (b"fg", b"2;ext\r\nhi\r\n")
    assert decoder.feed(b"more") == (b"", b"more")
    with pytest.raises(MalformedChunks):
        ChunkedBody().feed(b"3\r\nabcX\r\n")


def test_without_a_chunked_body_twisted_decodes_alone() -> None:
    assert WholeReads.install(object()) is False


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


def localhost_certificate() -> tuple[Any, Any]:
    """A self-signed certificate for `localhost`: its key and the certificate."""
    private = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.now(UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(private.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - timedelta(minutes=1))
        .not_valid_after(now + timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(private, hashes.SHA256())
    )
    return private, certificate


class OneCallPerRead(TestCase):
    """A real upstream connection, plain and over TLS: 300 chunks sent together reach `on_data`
    in a few calls, and the connection goes back to the pool fit for the next answer."""

    async def _stream_twice(self, scheme: str, agent: Any, listen: Any) -> None:
        resource = _ManyChunks(300)
        port = listen(Site(resource))
        upstream = Upstream(
            name="u",
            url=f"{scheme}://localhost:{port}",
            http=llm_http(agent),
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
            assert len(calls) < 30

    def _pool(self) -> UpstreamPool:
        pool = UpstreamPool(reactor, persistent=True)
        pool.maxPersistentPerHost = 1
        self.addCleanup(pool.closeCachedConnections)
        return pool

    async def test_plain(self) -> None:
        servers = Servers(self)
        await self._stream_twice("http", Agent(reactor, pool=self._pool()), servers.listen)

    async def test_tls(self) -> None:
        key, certificate = localhost_certificate()
        servers = Servers(self)

        def listen(site: Site) -> int:
            factory = WrappingFactory(site)
            options = ssl.CertificateOptions(privateKey=key, certificate=certificate)
            port = reactor.listenSSL(0, factory, options, interface="127.0.0.1")
            servers.factories.append(factory)  # closed with the rest at the end
            servers.ports.append(port)
            return port.getHost().port

        policy = BrowserLikePolicyForHTTPS(
            trustRoot=ssl.Certificate.loadPEM(certificate.public_bytes(Encoding.PEM))
        )
        agent = Agent(reactor, contextFactory=policy, pool=self._pool())
        await self._stream_twice("https", agent, listen)
