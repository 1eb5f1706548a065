"""Who may call what, and who is calling: API keys and their names, the client's address
behind trusted proxies, CORS for the browser frontend, refusing work while draining.

Keys are compared as SHA-256 digests with `hmac.compare_digest`, against every configured key
without stopping at a match, so neither a key's length nor its position in the list shows in
the timing. Decisions come back as GatewayErrors for each surface to render in its own shape.

A request's client is the name of its key when keys are configured, else its address: the peer,
or, when the peer is a configured trusted proxy, the first address in `X-Forwarded-For` (read
from the right) that is not itself a trusted proxy. The same trust decides whether forwarding
headers from the client may reach a route's upstream (`proxy.forward_headers`).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from twisted.web.iweb import IRequest

from homelab_gateway.config import ClientConfig, auth_key_name
from homelab_gateway.core.errors import GatewayError
from homelab_gateway.core.line import CLASS_RANK, CLASSES, DEFAULT_CLASS

PREFLIGHT_MAX_AGE = b"600"
EXPOSED_HEADERS = b"request-id, retry-after"
Network = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(frozen=True)
class Caller:
    client: str  # a key's name, or an address when no keys are configured
    priority: str  # the class the request asks for


class AccessPolicy:
    def __init__(
        self,
        api_keys: Iterable[str] | None,
        *,
        protect_metrics: bool,
        cors_origins: Iterable[str],
        clients: Mapping[str, ClientConfig] | None = None,
        trusted_proxies: Iterable[str] = (),
    ) -> None:
        keys: dict[bytes, str] = {}
        for key in api_keys or ():
            keys[hashlib.sha256(key.encode()).digest()] = auth_key_name(key)
        self.clients = dict(clients or {})
        for client in self.clients.values():
            keys[client.key_sha256] = client.name  # a client's own entry wins over [auth]'s
        self._keys = None if api_keys is None and not self.clients else list(keys.items())
        self.protect_metrics = protect_metrics
        self.cors_origins = frozenset(origin.encode() for origin in cors_origins)
        self.trusted_proxies: tuple[Network, ...] = tuple(
            ipaddress.ip_network(network, strict=False) for network in trusted_proxies
        )

    @property
    def keys_required(self) -> bool:
        return self._keys is not None

    def _presented(self, request: IRequest) -> list[tuple[bytes, bytes]]:
        """(header, key) for each header that may carry a gateway key."""
        found = []
        for name, prefix in ((b"x-api-key", b""), (b"authorization", b"bearer ")):
            value = request.getHeader(name)
            if value is None:
                continue
            if prefix:
                if value[: len(prefix)].lower() != prefix:
                    continue
                value = value[len(prefix) :]
            found.append((name, value.strip()))
        return found

    def key_name(self, request: IRequest) -> str | None:
        """The name of the valid gateway key the request carries, if any."""
        if self._keys is None:
            return None
        for _, key in self._presented(request):
            name = self._known(key)
            if name is not None:
                return name
        return None

    def client_key(self, request: IRequest) -> str | None:
        """The `[clients]` name of the key the request carries; None for an operator's key
        (`api_keys_env`, `api_keys_file`) or none."""
        name = self.key_name(request)
        return name if name in self.clients else None

    def credential_headers(self, request: IRequest) -> frozenset[bytes]:
        """Headers no upstream may see: with keys configured, `x-api-key` always, and
        `Authorization` when it carries any gateway key (not only the one that matched)."""
        if self._keys is None:
            return frozenset()
        drop = {b"x-api-key"}
        for name, key in self._presented(request):
            if self._known(key) is not None:
                drop.add(name)
        return frozenset(drop)

    def _known(self, key: bytes) -> str | None:
        digest = hashlib.sha256(key).digest()
        assert self._keys is not None
        found = None
        for known, name in self._keys:
            if hmac.compare_digest(digest, known):
                found = name
        return found

    def peer_trusted(self, request: IRequest) -> bool:
        """Whether the connection comes from a configured trusted proxy."""
        return self._trusted(getattr(request.getClientAddress(), "host", ""))

    def _trusted(self, address: str) -> bool:
        if not self.trusted_proxies:
            return False
        try:
            ip = ipaddress.ip_address(address)
        except ValueError:
            return False
        return any(ip in network for network in self.trusted_proxies)

    def client_address(self, request: IRequest) -> str:
        """The peer, or behind trusted proxies the first untrusted hop of X-Forwarded-For."""
        peer = getattr(request.getClientAddress(), "host", "unknown")
        if not self._trusted(peer):
            return peer
        hops = [
            hop.strip().decode("latin-1")
            for value in request.requestHeaders.getRawHeaders(b"x-forwarded-for", [])
            for hop in value.split(b",")
            if hop.strip()
        ]
        for hop in reversed(hops):
            if not self._trusted(hop):
                try:
                    return str(ipaddress.ip_address(hop))
                except ValueError:
                    return peer  # a hop that is no address: the chain is not to be believed
        return hops[0] if hops else peer

    def caller(self, request: IRequest) -> Caller:
        """Who asks, and at which class: the client's configured class, lowered (never raised)
        by an `x-priority` header naming a class."""
        name = self.key_name(request)
        client = self.clients.get(name) if name is not None else None
        priority = client.priority if client is not None else DEFAULT_CLASS
        asked = (request.getHeader(b"x-priority") or b"").strip().lower().decode("latin-1")
        if asked in CLASS_RANK and CLASS_RANK[asked] > CLASS_RANK[priority]:
            priority = CLASSES[CLASS_RANK[asked]]
        if name is None:
            return Caller(self.client_address(request), priority)
        return Caller(name, priority)

    def refusal(self, request: IRequest, *, protected: bool, draining: bool) -> GatewayError | None:
        """Why this request may not proceed, or None."""
        if draining:
            return GatewayError(503, "the gateway is shutting down", outcome="shutdown")
        if protected and self._keys is not None and self.key_name(request) is None:
            return GatewayError(
                401,
                "a valid API key is required (x-api-key or Authorization: Bearer)",
                outcome="unauthorized",
            )
        return None

    def add_cors_headers(self, request: IRequest) -> bool:
        """Echo an allowed Origin; True if the request's origin is allowed."""
        origin = request.getHeader(b"origin")
        if origin is None or origin not in self.cors_origins:
            return False
        request.setHeader(b"access-control-allow-origin", origin)
        request.setHeader(b"access-control-expose-headers", EXPOSED_HEADERS)
        request.responseHeaders.addRawHeader(b"vary", b"Origin")
        return True

    def is_preflight(self, request: IRequest) -> bool:
        return (
            request.method == b"OPTIONS"
            and request.getHeader(b"origin") is not None
            and request.getHeader(b"access-control-request-method") is not None
        )

    def preflight(self, request: IRequest) -> bytes:
        """Answer a CORS preflight here: it carries no credentials and must not need any."""
        request.setResponseCode(204)
        if self.add_cors_headers(request):
            request.setHeader(
                b"access-control-allow-methods", b"GET, POST, PUT, PATCH, DELETE, OPTIONS"
            )
            asked = request.getHeader(b"access-control-request-headers")
            if asked:
                request.setHeader(b"access-control-allow-headers", asked)
            request.setHeader(b"access-control-max-age", PREFLIGHT_MAX_AGE)
        return b""
