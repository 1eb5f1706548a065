"""Who may call what: API keys, CORS for the browser frontend, and refusing work while draining.

Keys are compared as SHA-256 digests with `hmac.compare_digest`, against every configured key
without stopping at a match, so neither a key's length nor its position in the list shows in
the timing. Decisions come back as GatewayErrors for each surface to render in its own shape.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable

from twisted.web.iweb import IRequest

from homelab_gateway.errors import GatewayError

PREFLIGHT_MAX_AGE = b"600"
EXPOSED_HEADERS = b"request-id, retry-after"


class AccessPolicy:
    def __init__(
        self, api_keys: Iterable[str] | None, *, protect_metrics: bool, cors_origins: Iterable[str]
    ) -> None:
        self._digests = (
            None if api_keys is None else [hashlib.sha256(k.encode()).digest() for k in api_keys]
        )
        self.protect_metrics = protect_metrics
        self.cors_origins = frozenset(origin.encode() for origin in cors_origins)

    def credential_header(self, request: IRequest) -> bytes | None:
        """The header that carries a valid gateway key, if any (it is not passed upstream)."""
        if self._digests is None:
            return None
        for name, prefix in ((b"x-api-key", b""), (b"authorization", b"bearer ")):
            value = request.getHeader(name)
            if value is None:
                continue
            if prefix:
                if value[: len(prefix)].lower() != prefix:
                    continue
                value = value[len(prefix) :]
            if self._known(value.strip()):
                return name
        return None

    def _known(self, key: bytes) -> bool:
        digest = hashlib.sha256(key).digest()
        assert self._digests is not None
        found = False
        for known in self._digests:
            found |= hmac.compare_digest(digest, known)
        return found

    def refusal(self, request: IRequest, *, protected: bool, draining: bool) -> GatewayError | None:
        """Why this request may not proceed, or None."""
        if draining:
            return GatewayError(503, "the gateway is shutting down", outcome="shutdown")
        if protected and self._digests is not None and self.credential_header(request) is None:
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
