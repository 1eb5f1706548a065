"""Errors the gateway answers with, and how upstream failures map onto them.

One exception type carries status, Anthropic error type, message and an optional retry-after,
so every layer can raise it and the route decides how to show it: an HTTP error body before any
byte is sent, an `event: error` frame after.
"""

from __future__ import annotations

import json
from typing import Any

from homelab_gateway.translator import error_event

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    502: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
    529: "overloaded_error",
}


class GatewayError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        error_type: str | None = None,
        retry_after: int | None = None,
        outcome: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.error_type = error_type or ERROR_TYPES.get(status, "api_error")
        self.retry_after = retry_after
        # For the request log and metrics: a client's mistake or the upstream's failure,
        # unless the raiser knows better (queue full, queue timeout, shutdown).
        self.outcome = outcome or ("bad_request" if status < 500 else "upstream_error")

    def anthropic_body(self) -> dict[str, Any]:
        return error_event(self.error_type, self.message)

    def openai_body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.error_type, "code": self.status}}


def shutdown_error() -> GatewayError:
    """For a request that shutdown cut off before its answer was finished."""
    return GatewayError(
        503, "the gateway shut down before the answer was finished", outcome="shutdown"
    )


def upstream_http_error(status: int, body: bytes, headers_retry_after: str | None) -> GatewayError:
    """What an Anthropic client should see when the upstream refused the request with `status`."""
    message = f"upstream answered {status}: {upstream_message(body)}"
    retry_after = _seconds(headers_retry_after)
    if status in (429, 503):
        return GatewayError(529, message, retry_after=retry_after)
    if status in (400, 413, 422):
        return GatewayError(400 if status != 413 else 413, message)
    return GatewayError(502, message)


def upstream_message(body: bytes) -> str:
    """The human part of an upstream error body, in any of the shapes servers use."""
    text = body.decode("utf-8", "replace").strip()
    try:
        document = json.loads(text)
    except ValueError:
        return text[:500] or "(empty body)"
    if isinstance(document, dict):
        error = document.get("error", document)
        if isinstance(error, dict):
            message = error.get("message") or error.get("detail")
            if isinstance(message, str):
                return message[:2000]
        elif isinstance(error, str):
            return error[:2000]  # Ollama: {"error": "..."}
    return text[:500]


def _seconds(value: str | None) -> int | None:
    if value is None:
        return None
    try:
        seconds = int(float(value))
    except ValueError:
        return None
    return seconds if 0 < seconds <= 3600 else None
