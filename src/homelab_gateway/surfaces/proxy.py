"""Plain reverse-proxy routes: `[[routes]]` prefixes forwarded to a named upstream or a URL.

Bodies are relayed as they arrive with the upstream transport registered as the producer behind
the client's response, so a slow reader pauses the upstream rather than filling the gateway's
memory. The target is always the configured base URL plus the remainder of the path: a client
can never choose the host, and a `..` segment (literal or percent-encoded) is refused.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote_to_bytes

from twisted.internet.defer import CancelledError
from twisted.internet.interfaces import IReactorTime
from twisted.web.iweb import IRequest

from homelab_gateway.core.errors import GatewayError, shutdown_error
from homelab_gateway.core.record import RequestRecord
from homelab_gateway.line.pool import Pool
from homelab_gateway.upstream.client import Backpressure, Upstream, UpstreamBroken
from homelab_gateway.web.respond import send_error

HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"transfer-encoding",
        b"te",
        b"trailer",
        b"upgrade",
        b"proxy-authorization",
        b"proxy-authenticate",
        b"proxy-connection",
    }
)
NOT_FORWARDED = HOP_BY_HOP | {b"host", b"content-length"}
# What a proxy says about the original request. Believed only from a configured trusted proxy:
# from anyone else they are lies a route's service might act on (its idea of the client's
# address, scheme or path prefix), so they are dropped and the gateway says its own.
FORWARDING = frozenset(
    {
        b"forwarded",
        b"x-forwarded-for",
        b"x-forwarded-proto",
        b"x-forwarded-host",
        b"x-forwarded-port",
        b"x-forwarded-prefix",
        b"x-real-ip",
    }
)


def _named_by_connection(headers: list[tuple[bytes, list[bytes]]]) -> set[bytes]:
    """Headers the Connection header declares hop-by-hop for this one connection."""
    return {
        token.strip().lower()
        for name, values in headers
        if name.lower() == b"connection"
        for value in values
        for token in value.split(b",")
    }


def forward_headers(
    headers: Iterable[tuple[bytes, list[bytes]]],
    *,
    client_ip: str,
    proto: str,
    host: bytes | None,
    keep_authorization: bool,
    drop: frozenset[bytes] = frozenset(),
    trusted: bool = False,
) -> dict[bytes, list[bytes]]:
    """The request headers to send upstream: end-to-end ones, plus X-Forwarded-*.

    `drop` names the headers that carry the gateway's own API keys, which no upstream sees.
    `client_ip` is the peer; only when it is a `trusted` proxy are the forwarding headers it
    sent kept (its X-Forwarded-For chain extended with the peer, its proto and host believed).
    """
    lowered = [(name.lower(), values) for name, values in headers]
    skip = set(NOT_FORWARDED) | _named_by_connection(lowered) | drop
    if not keep_authorization:
        skip.add(b"authorization")
    if not trusted:
        skip |= FORWARDING
    out: dict[bytes, list[bytes]] = {}
    for name, values in lowered:
        if name not in skip:
            out.setdefault(name, []).extend(values)
    prior = b", ".join(out.pop(b"x-forwarded-for", []))
    out[b"x-forwarded-for"] = [prior + b", " + client_ip.encode() if prior else client_ip.encode()]
    out.setdefault(b"x-forwarded-proto", [proto.encode()])
    if host is not None:
        out.setdefault(b"x-forwarded-host", [host])
    return out


def response_headers(
    headers: Iterable[tuple[bytes, list[bytes]]],
) -> list[tuple[bytes, list[bytes]]]:
    """The upstream's response headers minus the hop-by-hop ones (and those Connection names)."""
    headers = list(headers)
    skip = HOP_BY_HOP | _named_by_connection(headers)
    return [(name, values) for name, values in headers if name.lower() not in skip]


def escapes_prefix(remainder: bytes) -> bool:
    """True if the path remainder has a `.` or `..` segment, however it is encoded."""
    decoded = unquote_to_bytes(remainder)
    return any(segment in (b".", b"..") for segment in decoded.replace(b"\\", b"/").split(b"/"))


@dataclass(frozen=True)
class ProxyRoute:
    prefix: bytes
    upstream: Upstream
    pool: Pool | None  # None for a plain URL route: no slots


class ReverseProxy:
    def __init__(
        self, routes: Iterable[ProxyRoute], clock: IReactorTime, write_stall_timeout: float
    ) -> None:
        # Longest prefix first, so /a/b/ wins over /a/.
        self.routes = sorted(routes, key=lambda r: len(r.prefix), reverse=True)
        self.clock = clock
        self.write_stall_timeout = write_stall_timeout

    def match(self, path: bytes) -> tuple[ProxyRoute, bytes] | None:
        for route in self.routes:
            if path.startswith(route.prefix):
                return route, path[len(route.prefix) :]
        return None

    def redirect_target(self, path: bytes) -> bytes | None:
        """`/nas` for a route `/nas/`: where a browser should go instead."""
        for route in self.routes:
            if path + b"/" == route.prefix:
                return route.prefix
        return None

    async def forward(
        self,
        request: IRequest,
        record: RequestRecord,
        route: ProxyRoute,
        remainder: bytes,
        credential_headers: frozenset[bytes],
        trusted_peer: bool,
    ) -> bytes | None:
        record.upstream = route.upstream.name
        query = request.uri.partition(b"?")[2]
        url = route.upstream.url.encode() + b"/" + remainder + (b"?" + query if query else b"")
        peer: Any = request.getClientAddress()
        headers = forward_headers(
            request.requestHeaders.getAllRawHeaders(),
            client_ip=getattr(peer, "host", "unknown"),
            proto="https" if request.isSecure() else "http",
            host=request.getHeader(b"host"),
            keep_authorization=route.upstream.api_key is None,
            drop=credential_headers,
            trusted=trusted_peer,
        )
        body = request.content.read()
        try:
            if escapes_prefix(remainder):
                raise GatewayError(400, "path escapes the route prefix")
            slot = (
                await route.pool.hold_slot(self.clock, record) if route.pool is not None else None
            )
            try:
                return await self._relay(request, record, route.upstream, url, headers, body)
            finally:
                if slot is not None:
                    slot.release()
        except GatewayError as e:
            record.outcome = record.outcome or e.outcome
            return send_error(request, e, shape="plain")
        except CancelledError:
            if record.outcome != "shutdown":
                raise
            if request.startedWriting:
                request.channel.transport.abortConnection()  # cut mid-body: visibly incomplete
                return None
            return send_error(request, shutdown_error(), shape="plain")

    async def _relay(
        self,
        request: IRequest,
        record: RequestRecord,
        upstream: Upstream,
        url: bytes,
        headers: dict[bytes, list[bytes]],
        body: bytes,
    ) -> bytes | None:
        try:
            response = await upstream.open(
                request.method.decode(), url.decode(), headers, body or None
            )
        except CancelledError:
            record.upstream_cancelled = True
            raise
        request.setResponseCode(response.code, response.phrase)
        for name, values in response_headers(response.headers.getAllRawHeaders()):
            request.responseHeaders.setRawHeaders(name, values)
        if isinstance(response.length, int):  # Agent moves Content-Length out of .headers
            request.setHeader(b"content-length", str(response.length).encode())
        backpressure = Backpressure(request, self.clock, self.write_stall_timeout)
        try:
            await upstream.stream(response, request.write, backpressure)
        except UpstreamBroken:
            # Status and part of the body are out: only a broken connection tells the client
            # that the body is incomplete (a clean end would look like success).
            record.outcome = "upstream_error"
            request.channel.transport.abortConnection()
        except CancelledError:
            record.upstream_cancelled = True
            raise
        finally:
            backpressure.release()
        return None
