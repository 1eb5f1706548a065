"""Errors the gateway answers with, and how upstream failures map onto them.

One exception type carries status, Anthropic error type, message and an optional retry-after,
so every layer can raise it and the route decides how to show it: an HTTP error body before any
byte is sent, an `event: error` frame after.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from homelab_gateway.core.text import replace_lone_surrogates

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


RETRIED_STATUSES = frozenset({502, 503, 504})
OPENAI_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
}
"""OpenAI's error types by status; any other status is a `server_error`."""
WAIT_REFUSED = frozenset({"rejected_queue_full", "rejected_client_queue_full", "queue_timeout"})
"""The outcomes that mean "the line is too long for you now": a 529 on Anthropic's surface,
and OpenAI's 429, which its SDKs retry after `retry-after`."""


def error_event(error_type: str, message: str) -> dict[str, Any]:
    """An error in Anthropic's shape: an answer's body, and the event of a stream that failed."""
    return {"type": "error", "error": {"type": error_type, "message": message}}


class GatewayError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        error_type: str | None = None,
        retry_after: int | None = None,
        outcome: str | None = None,
        fault: str | None = None,
        retry: bool = False,
        param: str | None = None,
        code: str | None = None,
        upstream_body: bytes | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.error_type = error_type or ERROR_TYPES.get(status, "api_error")
        self.retry_after = retry_after
        # For the request log and metrics: a client's mistake or the upstream's failure,
        # unless the raiser knows better (queue full, queue timeout, shutdown).
        self.outcome = outcome or ("bad_request" if status < 500 else "upstream_error")
        # The replica's fault, counted against its health: "connect" (nothing was sent),
        # "timeout" (no response headers in time), "status" (a 502/503/504). `retry`: safe
        # to send again elsewhere (docs/configuration.md, "Replicas").
        self.fault = fault
        self.retry = retry
        # For OpenAI's shape: the field at fault and a machine-readable code, and the body of
        # the upstream refusal this passes on (its own status is `upstream_status`).
        self.param = param
        self.code = code
        self.upstream_body = upstream_body
        self.upstream_status: int | None = None

    def anthropic_body(self) -> dict[str, Any]:
        return error_event(self.error_type, self.message)

    def plain_body(self) -> dict[str, Any]:
        """The gateway's own answers off the LLM surfaces (proxy routes, the status page)."""
        return {"error": {"message": self.message, "type": self.error_type, "code": self.status}}

    @property
    def openai_status(self) -> int:
        """The status on an OpenAI surface: OpenAI has no 529."""
        if self.status == 529:
            return 429 if self.outcome in WAIT_REFUSED else 503
        return self.status

    def openai_body(self) -> dict[str, Any]:
        status = self.openai_status
        code = self.code
        if code is None and status == 429:
            code = "rate_limit_exceeded"
        elif code is None and status == 401:
            code = "invalid_api_key"
        return {
            "error": {
                "message": self.message,
                "type": OPENAI_TYPES.get(status, "server_error"),
                "param": self.param,
                "code": code,
            }
        }


def internal_error() -> GatewayError:
    """For a request whose handler met an exception nobody expected: the gateway's own fault,
    already logged with its traceback."""
    return GatewayError(
        500,
        "the gateway failed while answering this request; its log has the details",
        outcome="internal_error",
    )


def shutdown_error() -> GatewayError:
    """For a request that shutdown cut off before its answer was finished."""
    return GatewayError(
        503, "the gateway shut down before the answer was finished", outcome="shutdown"
    )


def upstream_http_error(status: int, body: bytes, headers_retry_after: str | None) -> GatewayError:
    """What an Anthropic client should see when the upstream refused the request with `status`."""
    error = _upstream_http_error(status, body, _seconds(headers_retry_after))
    error.upstream_body, error.upstream_status = body, status
    return error


def _upstream_http_error(status: int, body: bytes, retry_after: int | None) -> GatewayError:
    message = f"upstream answered {status}: {upstream_message(body)}"
    if status == 429:
        return GatewayError(529, message, retry_after=retry_after)
    if status in (400, 413, 422):
        return GatewayError(400 if status != 413 else 413, message)
    if status in RETRIED_STATUSES:
        # 502, 503 and 504 say the server (or the proxy before it) did not take the request on:
        # the replica is unwell, and another may serve it. Any other 5xx (vLLM's 500 for a
        # template or parser error) comes from running this request on a server that is up:
        # it does not count against the replica, and could fail the next one the same way.
        status_out = 529 if status == 503 else 502
        return GatewayError(
            status_out, message, retry_after=retry_after, fault="status", retry=True
        )
    return GatewayError(502, message)


def upstream_message(body: bytes) -> str:
    """The human part of an upstream error body, in any of the shapes servers use, with no lone
    surrogate (a JSON `\\u` escape can spell one): the answer must encode as UTF-8."""
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
                return replace_lone_surrogates(message[:2000])
        elif isinstance(error, str):
            return replace_lone_surrogates(error[:2000])  # Ollama: {"error": "..."}
    return text[:500]


def _seconds(value: str | None) -> int | None:
    if value is None:
        return None
    try:
        seconds = int(float(value))
    except ValueError:
        return None
    return seconds if 0 < seconds <= 3600 else None


@dataclass(frozen=True)
class ContextOverflow:
    """An upstream's "the request does not fit the model's window", with the numbers it gave.

    `completion` is the output the request asked for, where the upstream counted it against the
    window. `at_least` means `prompt_tokens` is a lower bound: vLLM stops tokenizing one token
    past the room left, so it never says how long the prompt really is.
    """

    prompt_tokens: int | None
    limit: int | None
    completion: int | None = None
    at_least: bool = False

    def error(self) -> GatewayError:
        """Anthropic's own wording, which Claude Code parses to size its recovery: the prompt
        alone too long (it compacts), or prompt plus `max_tokens` (it asks for fewer tokens)."""
        prompt, limit, completion = self.prompt_tokens, self.limit, self.completion
        if prompt is None or not limit:
            message = "prompt is too long: the upstream did not say by how much"
        elif completion is not None and prompt <= limit:
            message = (
                f"input length and `max_tokens` exceed context limit: {prompt} + {completion} "
                f"> {limit}, decrease input length or `max_tokens` and try again"
            )
        else:
            # The upstream refused the prompt itself, so it is longer than the window
            # (llama.cpp refuses one that exactly fills it: no room is left for one token).
            message = f"prompt is too long: {max(prompt, limit + 1)} tokens > {limit} maximum"
        return GatewayError(400, message, code="context_length_exceeded")
