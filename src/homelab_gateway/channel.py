"""HTTP connection limits that must act before twisted.web hands a request to a resource.

twisted.web reads a request's whole body before any resource runs, and its idle timeout is
reset by every byte, so a client can make it spool a huge body or trickle one forever. This
channel answers 413 from the Content-Length header (or as soon as a chunked body passes the
limit) and gives each request one deadline, from its first byte to its last, to arrive.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from twisted.internet.defer import Deferred, succeed
from twisted.internet.interfaces import IDelayedCall
from twisted.web.http import HTTPChannel
from twisted.web.server import Request, Site

from homelab_gateway.errors import GatewayError
from homelab_gateway.respond import new_request_id


@dataclass(frozen=True)
class WireLimits:
    max_body_bytes: int
    max_header_bytes: int
    request_timeout: float


class GatewayChannel(HTTPChannel):
    limits: WireLimits
    _deadline: IDelayedCall | None = None
    _refused = False

    def connectionMade(self) -> None:
        super().connectionMade()
        self.site.connection_made(self)
        # SSE is many small writes: with Nagle, each could wait for the ACK of the one before
        # (up to 40 ms with delayed ACKs on a real network). Loopback benchmarks cannot show it.
        set_no_delay = getattr(self.transport, "setTcpNoDelay", None)
        if set_no_delay is not None:
            set_no_delay(True)

    def dataReceived(self, data: bytes) -> None:
        if self._refused:
            return
        if self._deadline is None and not self._handlingRequest:
            self._deadline = self.callLater(self.limits.request_timeout, self._too_slow)
        super().dataReceived(data)

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
        self._deadline = None
        self._refuse(
            408, "timeout_error", f"request not received within {self.limits.request_timeout:g}s"
        )

    def _cancel_deadline(self) -> None:
        if self._deadline is not None and self._deadline.active():
            self._deadline.cancel()
        self._deadline = None

    def _refuse(self, status: int, error_type: str, message: str) -> None:
        """Answer and hang up at once, the way HTTPChannel answers a malformed request: the
        request never reaches a resource, so there is no Request to respond through."""
        if self._refused:
            return
        self._refused = True
        self._cancel_deadline()
        path = getattr(self, "_path", b"") or b""
        error = GatewayError(status, message, error_type=error_type)
        document = error.anthropic_body() if path.startswith(b"/llm/") else error.openai_body()
        body = json.dumps(document).encode()
        reason = {408: b"Request Timeout", 413: b"Content Too Large"}[status]
        head = (
            b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
            b"request-id: %s\r\nconnection: close\r\n\r\n"
        ) % (status, reason, len(body), new_request_id().encode())
        self.transport.write(head + body)
        self.loseConnection()


class GatewayRequest(Request):
    """Counts the body as it arrives: a chunked body has no Content-Length to refuse early,
    and its decoder hands data to the request, not the channel."""

    channel: GatewayChannel
    _body_bytes = 0

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
        return channel
