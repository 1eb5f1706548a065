"""HTTP connection limits that must act before twisted.web hands a request to a resource.

twisted.web reads a request's whole body before any resource runs, and its idle timeout is
reset by every byte, so a client can make it spool a huge body or trickle one forever. This
channel answers 413 from the Content-Length header (or as soon as a chunked body passes the
limit) and gives each request one deadline, from its first byte to its last, to arrive. A
connection that says nothing is closed too: a new one after `request_timeout`, an idle
keep-alive one after `keepalive_timeout` (Twisted's own idle timeout, a fixed 60 s, is off:
each silent connection holds a descriptor, and these deadlines are the ones documented).

Whatever the channel refuses (malformed, oversized, too slow) gets an answer in the gateway's
JSON error shape with a `request-id`, as every other answer does; twisted.web's own refusals
are a bare status line or none at all.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote_to_bytes

from twisted.internet import tcp
from twisted.internet.defer import Deferred, succeed
from twisted.internet.interfaces import IDelayedCall
from twisted.web.http import RESPONSES, HTTPChannel
from twisted.web.server import Request, Site

from homelab_gateway.core.errors import GatewayError
from homelab_gateway.sending import ONE_SEND, SendsAtOnce
from homelab_gateway.web.respond import error_body, new_request_id, send_error, shape_of

# Reason phrases twisted.web lacks ("Unknown Status") or has from an older RFC. 529 is not
# registered with IANA; "Site Overloaded" is the phrase it is known by.
REASONS = {
    408: b"Request Timeout",
    413: b"Content Too Large",
    431: b"Request Header Fields Too Large",
    529: b"Site Overloaded",
}


@dataclass(frozen=True)
class WireLimits:
    max_body_bytes: int
    max_header_bytes: int
    request_timeout: float
    # An idle keep-alive connection is closed after min(this, request_timeout): long enough
    # for a client's next request (httpx and Node keep idle connections 5 s), short enough
    # that thousands of idle clients do not pin descriptors for a minute.
    keepalive_timeout: float = 15.0


class ClientTransport(SendsAtOnce, tcp.Server):
    """A client connection that sends a write at once when nothing is waiting to be sent
    (`sending.SendsAtOnce`): a gateway writes once per upstream read and once per queue frame,
    nearly always to an empty buffer into a socket with room, and Twisted's buffered write
    would cost each frame a reactor iteration and two `epoll_ctl` calls."""


def send_at_once(port: Any) -> None:
    """New connections on `port` (a TCP listening port: plain, TLS wrapped around its
    connections, or adopted from systemd) send their writes at once (`ClientTransport`). Another
    kind of port (a UNIX socket) keeps Twisted's transport."""
    if type(port) is tcp.Port and port.transport is tcp.Server:
        port.transport = ClientTransport


class GatewayChannel(HTTPChannel):
    # Slots keep these names out of the instance dict: Twisted's classes give a channel more
    # than 30 attribute names over its life, and CPython 3.11 then gives up sharing the
    # class's key table and allocates each connection a 1.6 KB dict of its own. The names
    # are ones always set when the object is made, so no class default is shadowed.
    __slots__ = (
        "_dataBuffer",
        "_deadline",
        "_handlingRequest",
        "_refused",
        "_silent",
        "_transferDecoder",
        "limits",
        "requests",
    )
    limits: WireLimits
    requests: list[GatewayRequest]
    _deadline: IDelayedCall | None

    def __init__(self) -> None:
        self._deadline = None
        self._silent = False  # the deadline running is for a first byte, not a whole request
        self._refused = False
        super().__init__()

    def connectionMade(self) -> None:
        super().connectionMade()
        self.site.connection_made(self)
        # SSE is many small writes: with Nagle, each could wait for the ACK of the one before
        # (up to 40 ms with delayed ACKs on a real network). Loopback benchmarks cannot show it.
        set_no_delay = getattr(self.transport, "setTcpNoDelay", None)
        if set_no_delay is not None:
            set_no_delay(True)
        self._await_first_byte(self.limits.request_timeout)

    def dataReceived(self, data: bytes) -> None:
        if self._refused:
            return
        if self._silent:
            # The first byte: from now on the same timer bounds the whole request (a reset,
            # not a second timer, which the reactor would keep cancelled among its live ones).
            self._silent = False
            assert self._deadline is not None
            self._deadline.reset(self.limits.request_timeout)
        elif self._deadline is None and not self._handlingRequest:
            self._deadline = self.callLater(self.limits.request_timeout, self._expired)
        super().dataReceived(data)

    def requestDone(self, request: Any) -> None:
        """Between requests the connection waits for the next one's first byte, or, if the
        client already sent (part of) it, for the rest of it."""
        if self.persistent and not self._refused:
            if self._dataBuffer:
                self._cancel_deadline()
                self._deadline = self.callLater(self.limits.request_timeout, self._expired)
            else:
                self._await_first_byte(
                    min(self.limits.request_timeout, self.limits.keepalive_timeout)
                )
        super().requestDone(request)

    def _await_first_byte(self, timeout: float) -> None:
        self._cancel_deadline()
        self._silent = True
        self._deadline = self.callLater(timeout, self._expired)

    def _expired(self) -> None:
        self._deadline = None
        if self._silent:
            self._said_nothing()
        else:
            self._too_slow()

    def _said_nothing(self) -> None:
        """Closed without an answer: nothing was asked, and an unsolicited 408 on a keep-alive
        connection can be read by a client as the answer to the request it sends next."""
        self._silent = False
        self.loseConnection()

    def lineLengthExceeded(self, line: bytes) -> None:
        """One line longer than all headers may be: LineReceiver would hang up without a word."""
        limit = self.limits.max_header_bytes
        if getattr(self, "_command", None) is None:
            self._refuse(414, "invalid_request_error", f"request line exceeds {limit} bytes")
        else:
            self._refuse(431, "invalid_request_error", f"request headers exceed {limit} bytes")

    def _respondToBadRequestAndDisconnect(self) -> None:
        """twisted.web's one answer to a request it cannot parse is a bare `400` status line
        (an internal hook, the only one there is); the gateway's has a body and a request-id,
        and says 431 when the headers were merely too large."""
        if self._receivedHeaderSize > self.totalHeadersSize:
            limit = self.limits.max_header_bytes
            self._refuse(431, "invalid_request_error", f"request headers exceed {limit} bytes")
        else:
            self._refuse(400, "invalid_request_error", "malformed HTTP request")

    def allHeadersReceived(self) -> None:
        if self.length is not None and self.length > self.limits.max_body_bytes:
            self.refuse_body()
            return
        super().allHeadersReceived()

    def refuse_body(self) -> None:
        limit = self.limits.max_body_bytes
        self._refuse(413, "request_too_large", f"request body exceeds {limit} bytes")

    def allContentReceived(self) -> None:
        self._cancel_deadline()
        super().allContentReceived()

    def connectionLost(self, reason: Any) -> None:
        self._cancel_deadline()
        super().connectionLost(reason)
        self.site.connection_lost(self)

    def _too_slow(self) -> None:
        self._refuse(
            408, "timeout_error", f"request not received within {self.limits.request_timeout:g}s"
        )

    def _cancel_deadline(self) -> None:
        if self._deadline is not None and self._deadline.active():
            self._deadline.cancel()
        self._deadline = None
        self._silent = False

    def _refuse(self, status: int, error_type: str, message: str) -> None:
        """Answer and hang up at once, the way HTTPChannel answers a malformed request: the
        request never reaches a resource, so there is no Request to respond through."""
        if self._refused:
            return
        self._refused = True
        self._cancel_deadline()
        path = getattr(self, "_path", b"") or b""
        error = GatewayError(status, message, error_type=error_type)
        status, document = error_body(error, shape_of(path))
        body = json.dumps(document).encode()
        reason = REASONS.get(status) or RESPONSES[status]
        request_id = self.requests[-1].request_id if self.requests else new_request_id()
        head = (
            b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
            b"request-id: %s\r\nconnection: close\r\n\r\n"
        ) % (status, reason, len(body), request_id.encode())
        self.transport.write(head + body)
        self.loseConnection()


class GatewayRequest(Request):
    """Counts the body as it arrives: a chunked body has no Content-Length to refuse early,
    and its decoder hands data to the request, not the channel.

    Every answer carries a `request-id`, set here once rather than by each route, so the
    health checks, redirects and 404s have one too; a route that logs the request reads it.
    """

    # As for `GatewayChannel`: names Twisted (and this class) always set in `__init__`, kept
    # out of the instance dict so that it stays small and shares its class's keys.
    __slots__ = (
        "_adapterCache",
        "_body_bytes",
        "_parsePOSTFormSubmission",
        "client",
        "cookies",
        "host",
        "notifications",
        "queued",
        "received_cookies",
        "requestHeaders",
        "request_id",
        "responseHeaders",
    )
    channel: GatewayChannel

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._body_bytes = 0
        # No route reads a form from `request.args`, and Twisted would parse the Content-Type
        # of every POST with the email package to see whether it is one (~0.1 ms a request),
        # and parse a form body in memory where it is: a passthrough upload stays bytes.
        kwargs.setdefault("parsePOSTFormSubmission", False)
        super().__init__(*args, **kwargs)
        self.request_id = new_request_id()
        self.setHeader(b"request-id", self.request_id.encode())

    def write(self, data: bytes) -> None:
        """The first write: the status line and headers (a write of twisted.web's own) go out
        with the first bytes in one send, not two (one wake-up of the client, not two)."""
        if self.startedWriting:
            super().write(data)
            return
        with ONE_SEND:
            super().write(data)

    def setResponseCode(self, code: int, message: bytes | None = None) -> None:
        super().setResponseCode(code, message or REASONS.get(code))

    def process(self) -> None:
        """The router decodes the path and Host as UTF-8, and when that fails answers HTML and
        logs a traceback per request; refuse them here, in the gateway's shape."""
        try:
            unquote_to_bytes(self.path).decode("utf-8")
            self.getRequestHostname().decode("utf-8")
        except UnicodeDecodeError:
            self.site = self.channel.site
            error = GatewayError(400, "the request path or Host is not UTF-8 once percent-decoded")
            self.write(send_error(self, error, shape=shape_of(self.path)))
            self.finish()
            return
        super().process()

    def handleContentChunk(self, data: bytes) -> None:
        if self.channel is None or self.channel._refused:
            return
        self._body_bytes += len(data)
        if self._body_bytes > self.channel.limits.max_body_bytes:
            self.channel.refuse_body()
            return
        super().handleContentChunk(data)


class GatewaySite(Site):
    """A Site whose connections enforce `WireLimits` (and speak HTTP/1.1 only)."""

    protocol = GatewayChannel
    requestFactory = GatewayRequest

    def __init__(self, resource: Any, limits: WireLimits, **kwargs: Any) -> None:
        # No twisted.web idle timer: the channel's own deadlines (`WireLimits`) are the ones
        # documented, and Twisted's would be one more timer per connection, made, reset on
        # every read and cancelled for every request, and kept by the reactor until it compacts
        # its timers (thousands of waiting requests hold one each).
        kwargs.setdefault("timeout", None)
        super().__init__(resource, **kwargs)
        self.limits = limits
        # Open connections, so shutdown can close them and wait until each has written out
        # what it was given: the reactor drops whatever is still buffered when it stops.
        self.connections: set[GatewayChannel] = set()
        self._closed: list[Deferred[None]] = []

    def connection_made(self, channel: GatewayChannel) -> None:
        self.connections.add(channel)

    def connection_lost(self, channel: GatewayChannel) -> None:
        self.connections.discard(channel)
        if not self.connections:
            closed, self._closed = self._closed, []
            for waiter in closed:
                waiter.callback(None)

    def all_closed(self) -> Deferred[None]:
        """Fires once no connection is open (cancellable)."""
        if not self.connections:
            return succeed(None)
        d: Deferred[None] = Deferred(self._closed.remove)
        self._closed.append(d)
        return d

    def log(self, request: Any) -> None:
        """No combined-format access line: each request gets one structured event instead
        (homelab_gateway.telemetry), which says more and is the same in text and JSON."""

    def buildProtocol(self, addr: Any) -> Any:
        channel = super().buildProtocol(addr)
        channel.limits = self.limits
        channel.totalHeadersSize = self.limits.max_header_bytes
        # One line may be as long as all headers may be; LineReceiver's own 16 KiB would cut
        # a configured larger limit short and hang up without an answer.
        channel.MAX_LENGTH = self.limits.max_header_bytes
        return channel
