"""Talking to an upstream HTTP server: open a request, then stream its body, cancellably.

`treq.collect` and `treq.content` cannot be cancelled and buffer, so the body goes to
`_BodyStream`, a protocol of ours: its Deferred's canceller stops the upstream transport (the
socket closes, and vLLM frees the sequence), its idle timer runs on the injected clock, and its
transport can be registered as the producer behind the client's response so a slow reader
pauses the upstream instead of growing a buffer in the gateway; while it is paused that way the
idle timer stops, since the silence is the gateway's own doing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hyperlink import EncodedURL
from treq.client import HTTPClient
from treq.cookies import IndexableCookieJar
from twisted.internet import error as neterror
from twisted.internet.defer import CancelledError, Deferred, succeed
from twisted.internet.endpoints import HostnameEndpoint, wrapClientTLS
from twisted.internet.interfaces import (
    IDelayedCall,
    IPushProducer,
    IReactorTime,
    IStreamClientEndpoint,
)
from twisted.internet.protocol import Protocol
from twisted.python.failure import Failure
from twisted.web import http
from twisted.web.client import (
    URI,
    BrowserLikePolicyForHTTPS,
    RequestNotSent,
    ResponseDone,
    ResponseFailed,
)
from twisted.web.error import SchemeNotSupported
from twisted.web.http import PotentialDataLoss
from twisted.web.http_headers import Headers
from twisted.web.iweb import IAgent, IAgentEndpointFactory, IBodyProducer, IRequest, IResponse
from zope.interface import implementer

from homelab_gateway.core.chunks import ChunkedBody
from homelab_gateway.core.errors import GatewayError
from homelab_gateway.sending import ONE_SEND, reactor_for_upstreams

ERROR_BODY_LIMIT = 64 * 1024
LINGER_AFTER_END = 1.0
"""Seconds a body may take to end after the answer is complete (`[DONE]`) before its connection
is closed. A server ends the body right after `[DONE]`, often in a later read; waiting that long
keeps the connection for reuse, while a body left open can never hold a slot."""


NOT_SENT = (neterror.ConnectError, neterror.DNSLookupError, RequestNotSent)
"""Failures before any byte of the request left: refused, unreachable, a TCP connect timeout,
a name that does not resolve. Sending again elsewhere cannot run anything twice."""


class UpstreamBroken(Exception):
    """The upstream's response body ended abnormally (reset, idle timeout, bad framing)."""


class AnswerComplete(Exception):
    """Raised by an `on_data` callback: the answer is whole, whatever the body still sends.

    `Upstream.stream` then fires at once; the body gets `LINGER_AFTER_END` to end cleanly (its
    connection goes back to the pool) and is closed after that.
    """


class _Enough(Exception):
    """An error body reached its limit: stop reading it."""


@implementer(IBodyProducer)
class BytesProducer:
    """A request body already in memory, written at once.

    Twisted's FileBodyProducer writes on a later cooperator tick, a delay every upstream request
    would pay before the upstream even sees its body. Once written it is let go: a finished
    request's objects wait in reference cycles for the collector, and a long conversation's
    body is megabytes.
    """

    def __init__(self, data: bytes) -> None:
        self._data = data
        self.length = len(data)

    def startProducing(self, consumer: Any) -> Deferred[None]:
        data, self._data = self._data, b""
        consumer.write(data)
        return succeed(None)

    def pauseProducing(self) -> None:
        """Nothing is left to pause: the body went out in one write."""

    def resumeProducing(self) -> None:
        """Nothing is left to resume."""

    def stopProducing(self) -> None:
        """Nothing is left to stop."""


class RawHTTP:
    """The treq `request` call shape over a bare Agent, for the transparent proxy.

    treq always decodes gzip (rewriting Content-Encoding and dropping Content-Length), keeps
    one cookie jar for every client and re-encodes the URL; a reverse proxy must pass all of
    that through untouched.
    """

    def __init__(self, agent: IAgent) -> None:
        self._agent = agent

    def request(
        self,
        method: str,
        url: str,
        *,
        headers: dict[bytes, list[bytes]],
        data: bytes | None,
        unbuffered: bool = True,
        allow_redirects: bool = False,
    ) -> Deferred[IResponse]:
        """Send as given; `unbuffered` and `allow_redirects` are accepted for treq's call shape
        and are what a bare Agent does anyway."""
        producer = BytesProducer(data) if data is not None else None
        return self._agent.request(method.encode(), url.encode(), Headers(headers), producer)


@implementer(IAgentEndpointFactory)
class EndpointPerHost:
    """Where an Agent connects: TCP for http, TLS over TCP for https, as Twisted's own Agent,
    but one endpoint per (scheme, host, port) kept for every request. Twisted builds a new one
    for each request, IDNA-encoding the host (and for https making the TLS options) every
    time, although an upstream is always the same host. Endpoints connect as often as asked."""

    def __init__(self, reactor: Any, connect_timeout: float) -> None:
        self._reactor = reactor
        # Plain HTTP connections send a pooled request's headers and body at once, in one
        # send (`sending.UpstreamTransport`); TLS ones keep Twisted's transport.
        self._plain_reactor = reactor_for_upstreams(reactor)
        self._timeout = connect_timeout
        self._tls = BrowserLikePolicyForHTTPS()
        self._endpoints: dict[tuple[bytes, bytes, int], IStreamClientEndpoint] = {}

    def endpointForURI(self, uri: URI) -> IStreamClientEndpoint:
        key = (uri.scheme, uri.host, uri.port)
        endpoint = self._endpoints.get(key)
        if endpoint is None:
            if uri.scheme not in (b"http", b"https"):
                raise SchemeNotSupported(f"Unsupported scheme: {uri.scheme!r}")
            tls = uri.scheme == b"https"
            endpoint = HostnameEndpoint(
                self._reactor if tls else self._plain_reactor,
                uri.host.decode("ascii"),
                uri.port,
                timeout=self._timeout,
            )
            if tls:
                endpoint = wrapClientTLS(self._tls.creatorForNetloc(uri.host, uri.port), endpoint)
            self._endpoints[key] = endpoint
        return endpoint


class _NoCookies(IndexableCookieJar):
    """A cookie jar that never holds a cookie: a jar shared by every client of the gateway
    must never carry one client's state. treq's `CookieAgent` still asks it on every request
    and response; with nothing ever to find, it does not look (a refusing policy made the
    stdlib jar take its lock, sweep for expired cookies and parse `Set-Cookie` headers only to
    keep none)."""

    def set_cookie(self, cookie: Any) -> None:
        """Kept by no request."""

    def add_cookie_header(self, request: Any) -> None:
        """There is never a cookie to send."""

    def extract_cookies(self, response: Any, request: Any) -> None:
        """An upstream's `Set-Cookie` is never kept."""


NO_COOKIES = _NoCookies()
"""The jar of every /llm request's own cookies (none): given a dict or nothing, treq builds a
fresh stdlib jar per request (a policy object and a lock) to merge into the client's."""


def llm_http(agent: IAgent) -> HTTPClient:
    """treq for the /llm surface, with redirects off and a cookie jar that takes no cookies."""
    return _EncodedOnceClient(agent, cookiejar=_NoCookies(), data_to_body_producer=BytesProducer)


class _EncodedURL(EncodedURL):
    """A URL whose URI form treq has already been given once. treq encodes every URL it is
    handed (`to_uri()`: percent-encoding and IDNA for the host, ~0.2 ms a request), and the
    few an upstream is asked at (its base URL and a fixed path) always come out the same."""

    text: str

    def to_uri(self) -> _EncodedURL:
        return self

    def to_text(self, with_password: bool = False) -> str:
        return self.text


class _EncodedOnceClient(HTTPClient):
    """treq's client, with each URL string encoded the first time it is asked for (the
    bytes on the wire are treq's own encoding of that string) and no cookie jar of its own
    built for each request."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._encoded: dict[str, _EncodedURL] = {}

    def request(self, method: str, url: Any, **kwargs: Any) -> Deferred[Any]:
        if isinstance(url, str):
            encoded = self._encoded.get(url)
            if encoded is None:
                text = EncodedURL.from_text(url).to_uri().to_text()
                encoded = _EncodedURL.from_text(text)
                encoded.text = text
                self._encoded[url] = encoded
            url = encoded
        kwargs.setdefault("cookies", NO_COOKIES)
        return super().request(method, url, **kwargs)


class Upstream:
    """One upstream server: its base URL, timeouts and HTTP client."""

    def __init__(
        self,
        *,
        name: str,
        url: str,
        http: Any,
        clock: IReactorTime,
        connect_timeout: float,
        idle_timeout: float,
        api_key: str | None = None,
    ) -> None:
        self.name = name
        self.url = url
        self.http = http  # a treq HTTPClient (or treq.testing.StubTreq)
        self.clock = clock
        self.connect_timeout = connect_timeout
        self.idle_timeout = idle_timeout
        self.api_key = api_key

    async def open(
        self,
        method: str,
        url: str,
        headers: dict[bytes, list[bytes]],
        body: bytes | None,
        headers_within: float | None = None,
    ) -> IResponse:
        """Send the request; return the response once its headers are in, within
        `headers_within` seconds (by default `connect_timeout`).

        Sent once more only when it provably never left (RequestNotSent): a connection that
        closed or reset after the request was written may have been read by the upstream, so
        a retry could run a generation or a passthrough POST twice. Stale pooled connections
        are weeded out before the request is written instead (`UpstreamPool`). Cancelling the
        caller's Deferred while this waits aborts the connection.
        """
        if self.api_key is not None:
            headers[b"authorization"] = [b"Bearer " + self.api_key.encode()]
        timed_out = False
        pending: Deferred[IResponse] | None = None

        def give_up() -> None:
            nonlocal timed_out
            timed_out = True
            if pending is not None:
                pending.cancel()

        within = self.connect_timeout if headers_within is None else headers_within
        timer = self.clock.callLater(within, give_up)
        try:
            for attempt in (1, 2):
                # On a pooled connection the request is written before `request` returns: its
                # headers and body go out then, in one send (`sending.ONE_SEND`), rather than
                # in the reactor's next iteration.
                with ONE_SEND:
                    pending = self.http.request(
                        method,
                        url,
                        headers=headers,
                        data=body,
                        unbuffered=True,
                        allow_redirects=False,
                    )
                try:
                    return await pending
                except Exception as e:
                    # Agent reports a cancel as ResponseNeverReceived([CancelledError]): ours
                    # (the timer) becomes a 504, the caller's (the client left) CancelledError.
                    if timed_out:
                        raise GatewayError(
                            504,
                            f"upstream {self.name} sent no response headers within {within:g}s",
                            fault="timeout",
                        ) from None
                    if isinstance(e, CancelledError | neterror.ConnectingCancelledError) or _wraps(
                        e, CancelledError
                    ):
                        raise CancelledError() from None
                    if attempt == 1 and isinstance(e, RequestNotSent):
                        continue  # provably never written: it cannot run twice
                    unsent = isinstance(e, NOT_SENT)
                    raise GatewayError(
                        502,
                        f"upstream {self.name} unreachable: {_reason(e)}",
                        fault="connect" if unsent else None,
                        retry=unsent,
                    ) from None
            raise AssertionError("unreachable")
        finally:
            if timer.active():
                timer.cancel()

    def stream(
        self,
        response: IResponse,
        on_data: Callable[[bytes], None],
        on_producer: Callable[[IPushProducer], None] | None = None,
    ) -> Deferred[None]:
        """Feed the body to `on_data` as it arrives; fire when it ends cleanly.

        Fails with UpstreamBroken on a reset or after `idle_timeout` of silence, and with
        whatever `on_data` raised. Cancelling stops the upstream transport.
        """
        protocol = _BodyStream(on_data, self.clock, self.idle_timeout, self.name, on_producer)
        response.deliverBody(protocol)
        return protocol.done

    async def read_limited(self, response: IResponse, limit: int = ERROR_BODY_LIMIT) -> bytes:
        """A body up to `limit` bytes, read within `connect_timeout`: enough to quote an error,
        never a memory risk, and never a wait on a body that does not end. Past either bound
        reading stops and the connection is closed; what did arrive is returned."""
        parts: list[bytes] = []
        size = 0
        timed_out = False

        def take(data: bytes) -> None:
            nonlocal size
            parts.append(data[: limit - size])
            size += len(data)
            if size >= limit:
                raise _Enough()

        def give_up() -> None:
            nonlocal timed_out
            timed_out = True
            reading.cancel()

        reading = self.stream(response, take)
        timer = self.clock.callLater(self.connect_timeout, give_up)
        try:
            await reading
        except (_Enough, UpstreamBroken):
            pass  # what did arrive is still worth quoting
        except CancelledError:
            if not timed_out:
                raise
        finally:
            if timer.active():
                timer.cancel()
        return b"".join(parts)


@implementer(IPushProducer)
class Backpressure:
    """Stands between an upstream body's transport and the client's response as its producer.

    The client's send buffer filling pauses the upstream socket and draining resumes it, so a
    slow reader costs the gateway no memory. A reader that stays paused for `stall_timeout`
    would pin its slot forever: it is cut off, which cancels the upstream like a disconnect.
    The producer it pauses is the body's `_BodyStream`, which stops its idle timer while paused:
    a slow client is not an upstream fault. After a client disconnect twisted.web has detached
    the request's channel: there is then nothing to register with or unregister from.
    """

    def __init__(self, request: IRequest, clock: IReactorTime, stall_timeout: float) -> None:
        self._request = request
        self._clock = clock
        self._stall_timeout = stall_timeout
        self._producer: IPushProducer | None = None
        self._stall: IDelayedCall | None = None

    def __call__(self, producer: IPushProducer) -> None:
        if self._request.channel is not None:
            self._producer = producer
            self._request.registerProducer(self, True)

    def pauseProducing(self) -> None:
        if self._producer is not None:
            self._producer.pauseProducing()
        if self._stall is None:
            self._stall = self._clock.callLater(self._stall_timeout, self._stalled)

    def resumeProducing(self) -> None:
        self._cancel_stall()
        if self._producer is not None:
            self._producer.resumeProducing()

    def stopProducing(self) -> None:
        self._cancel_stall()
        if self._producer is not None:
            self._producer.stopProducing()

    def _stalled(self) -> None:
        self._stall = None
        if self._request.channel is not None:
            self._request.channel.transport.abortConnection()

    def _cancel_stall(self) -> None:
        if self._stall is not None and self._stall.active():
            self._stall.cancel()
        self._stall = None

    def release(self) -> None:
        self._cancel_stall()
        if self._producer is not None and self._request.channel is not None:
            self._request.unregisterProducer()
        self._producer = None


def _wraps(e: BaseException, *kinds: type[BaseException]) -> bool:
    reasons = getattr(e, "reasons", None) or []
    return any(isinstance(r, Failure) and r.check(*kinds) for r in reasons)


def _reason(e: BaseException) -> str:
    if isinstance(e, ResponseFailed):
        reasons = [r.value for r in e.reasons if isinstance(r, Failure)]
        return "; ".join(_reason(r) for r in reasons) or "response failed"
    if isinstance(e, neterror.ConnectionRefusedError):
        return "connection refused"
    if isinstance(e, neterror.DNSLookupError):
        return "DNS lookup failed"
    return str(e) or type(e).__name__


class WholeReads:
    """Stands in for Twisted's chunked decoder of one response body, so that each socket read
    reaches the body protocol as one piece (see `chunks`). Twisted's decoder stays behind it:
    it decodes whatever was under way when this took over, and everything from the last chunk
    on (trailers, the end of the body, errors), so the connection goes back to the pool as
    Twisted would send it."""

    def __init__(self, twisted_decoder: Any) -> None:
        self._twisted = twisted_decoder
        self._chunks = ChunkedBody()
        self._caught_up = False

    @classmethod
    def install(cls, body_transport: Any) -> bool:
        """Take over the chunked decoding of the body under `body_transport` (the transport
        Twisted gives a response's body protocol, a proxy of the connection's). False where the
        body is not chunked or the parser is not found (a test's in-memory transport): Twisted
        then decodes alone and hands the body on chunk by chunk, as always."""
        socket = getattr(body_transport, "_producer", None)
        # Over TLS the transport is TLS's protocol, which wraps the HTTP client's; over TCP the
        # socket's protocol is the endpoint's wrapper of the HTTP client's.
        protocol = getattr(socket, "wrappedProtocol", None) or getattr(socket, "protocol", None)
        protocol = getattr(protocol, "_wrappedProtocol", protocol)
        parser = getattr(protocol, "_parser", None)
        decoder = getattr(parser, "bodyDecoder", None)
        if type(decoder) is not getattr(http, "_ChunkedTransferDecoder", None):
            return False
        parser.bodyDecoder = cls(decoder)
        return True

    def dataReceived(self, data: bytes) -> None:
        if not self._caught_up:
            data = self._catch_up(data)
            if not data:
                return
        payload, rest = self._chunks.feed(data)
        if payload:
            self._twisted.dataCallback(payload)
        if rest is not None:
            self._twisted.dataReceived(rest)

    def noMoreData(self) -> None:
        """The connection ended: Twisted's decoder says whether the body was whole (it is
        still at a chunk boundary unless the last chunk was handed to it)."""
        self._twisted.noMoreData()

    def _catch_up(self, data: bytes) -> bytes:
        """Feed Twisted's decoder just enough to end the chunk it was in when this took over;
        what is left starts at a size line, this decoder's to read."""
        twisted = self._twisted
        while data:
            state = twisted.state
            if state == "CHUNK_LENGTH" and not twisted._buffer:
                self._caught_up = True
                return data
            if state == "BODY":
                needed = twisted.length
            elif state == "CRLF":
                needed = 2 - len(twisted._buffer)
            elif state == "CHUNK_LENGTH":
                needed = data.find(b"\n") + 1 or len(data)
            else:  # the last chunk's trailers, or past the end: Twisted's alone
                self._chunks.hand_over()
                self._caught_up = True
                return data
            twisted.dataReceived(data[:needed])
            data = data[needed:]
        return data


@implementer(IPushProducer)
class _BodyStream(Protocol):
    """Receives one response body; the producer `Backpressure` pauses (see `Upstream.stream`)."""

    def __init__(
        self,
        on_data: Callable[[bytes], None],
        clock: IReactorTime,
        idle_timeout: float,
        name: str,
        on_producer: Callable[[IPushProducer], None] | None,
    ) -> None:
        self._on_data = on_data
        self._clock = clock
        self._idle_timeout = idle_timeout
        self._name = name
        self._on_producer = on_producer
        self._failure: BaseException | None = None
        self._paused = False
        self._lingering = False
        self._timer: IDelayedCall | None = None
        self._arm(idle_timeout)
        self.done: Deferred[None] = Deferred(lambda _: self._stop())

    def connectionMade(self) -> None:
        WholeReads.install(self.transport)
        if self._on_producer is not None:
            self._on_producer(self)

    def dataReceived(self, data: bytes) -> None:
        """A piece of the body: with `WholeReads` in place, everything one socket read brought
        (one timer reset and one `on_data` call per read, not per token)."""
        if self.done.called:
            return
        self._arm(self._idle_timeout)
        try:
            self._on_data(data)
        except AnswerComplete:
            self._linger()
        except Exception as e:
            self._failure = e
            self._stop()

    def connectionLost(self, reason: Failure) -> None:  # type: ignore[override]
        self._disarm()
        if self.done.called:
            return
        if self._failure is not None:
            self.done.errback(self._failure)
        elif reason.check(ResponseDone, PotentialDataLoss):
            self.done.callback(None)
        else:
            self.done.errback(
                UpstreamBroken(f"upstream {self._name} broke off: {_reason(reason.value)}")
            )

    # IPushProducer, for Backpressure: the idle timer only runs while the upstream may send.
    def pauseProducing(self) -> None:
        self._paused = True
        self._disarm()
        if self.transport is not None:
            self.transport.pauseProducing()

    def resumeProducing(self) -> None:
        self._paused = False
        if not self._lingering:
            self._arm(self._idle_timeout)
        if self.transport is not None:
            self.transport.resumeProducing()

    def stopProducing(self) -> None:
        self._stop()

    def _linger(self) -> None:
        """The answer is complete: the caller goes on now; the rest of the body is read and
        dropped for `LINGER_AFTER_END`, then the connection is closed if it has not ended."""
        self._lingering = True
        self._disarm()  # a new timer: `reset` to a sooner time searches the reactor's timer heap
        self._arm(LINGER_AFTER_END)
        self.done.callback(None)
        if self._paused:
            self.resumeProducing()  # nobody pauses it any more; let the body's end arrive

    def _arm(self, seconds: float) -> None:
        """(Re)start the timer `seconds` from now. Only ever later than it stood: Twisted's
        `DelayedCall.reset` to a later time is a field update, but to a sooner one the reactor
        finds the call by a linear search of every pending timer (`_moveCallLaterSooner`):
        about 3 ms per answer's end with 5,000 waiters, each with its deadlines, in the heap."""
        if self._timer is not None and self._timer.active():
            self._timer.reset(seconds)
        else:
            self._timer = self._clock.callLater(seconds, self._idle)

    def _disarm(self) -> None:
        if self._timer is not None and self._timer.active():
            self._timer.cancel()
        self._timer = None

    def _idle(self) -> None:
        self._timer = None
        if not self._lingering:
            self._failure = UpstreamBroken(
                f"upstream {self._name} was silent for {self._idle_timeout:g}s"
            )
        self._stop()

    def _stop(self) -> None:
        self._disarm()
        if self.transport is not None:
            self.transport.stopProducing()
