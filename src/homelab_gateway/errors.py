"""Errors the gateway answers with, and how upstream failures map onto them.

One exception type carries status, Anthropic error type, message and an optional retry-after,
so every layer can raise it and the route decides how to show it: an HTTP error body before any
byte is sent, an `event: error` frame after.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
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


@dataclass(frozen=True)
class ContextOverflow:
    """An upstream's "the request does not fit the model's window", with the numbers it gave.

    `completion` is set when the prompt fits and only prompt + `max_tokens` does not; None when
    the prompt alone is too long. `at_least` means `prompt_tokens` is a lower bound (vLLM stops
    counting one token past the window).
    """

    prompt_tokens: int | None
    limit: int | None
    completion: int | None = None
    at_least: bool = False

    def error(self) -> GatewayError:
        """Anthropic's own wording, which Claude Code parses to size its recovery."""
        if self.completion is not None and self.prompt_tokens is not None and self.limit:
            return GatewayError(
                400,
                f"input length and `max_tokens` exceed context limit: {self.prompt_tokens} + "
                f"{self.completion} > {self.limit}, decrease input length or `max_tokens` "
                "and try again",
            )
        if self.prompt_tokens is not None and self.limit:
            return GatewayError(
                400, f"prompt is too long: {self.prompt_tokens} tokens > {self.limit} maximum"
            )
        return GatewayError(400, "prompt is too long: the upstream did not say by how much")


_N = r"(\d+)"
# vLLM, newest first: the renderer's messages (0.1x to 0.32: "contains at least N" once the
# prompt is cut off at the window), then the serving layer's older "you requested" ones.
_VLLM_PROMPT = re.compile(
    rf"maximum context length is {_N} tokens\. However, your (?:prompt contains|request has) "
    rf"(at least )?{_N} input tokens"
)
_VLLM_MAX_TOKENS = re.compile(
    rf"'max_tokens' (?:or 'max_completion_tokens' )?is too large: {_N}\. This model's maximum "
    rf"context length is {_N} tokens and your request has {_N} input tokens"
)
_VLLM_REQUESTED = re.compile(
    rf"maximum context length is {_N} tokens\. However, you requested {_N} tokens "
    rf"\({_N} in the messages, {_N} in the completion\)"
)
_VLLM_REQUESTED_PROMPT = re.compile(
    rf"maximum context length is {_N} tokens\. However, you requested {_N} tokens in the messages"
)
# llama.cpp's server (exceed_context_size_error, also carrying n_prompt_tokens and n_ctx).
_LLAMA_CPP = re.compile(
    rf"request \({_N} tokens\) exceeds the available context size \({_N} tokens\)"
)
# Ollama's runner says no number at all.
_OLLAMA = "the input length exceeds the context length"


def context_overflow(body: bytes) -> ContextOverflow | None:
    """The context overflow an upstream's error body reports, or None for any other error."""
    message = upstream_message(body)
    error = _error_object(body)
    if error.get("type") == "exceed_context_size_error":
        prompt, limit = error.get("n_prompt_tokens"), error.get("n_ctx")
        if isinstance(prompt, int) and isinstance(limit, int):
            return ContextOverflow(prompt_tokens=prompt, limit=limit)
    if match := _VLLM_MAX_TOKENS.search(message):
        completion, limit, prompt = map(int, match.groups())
        return ContextOverflow(prompt_tokens=prompt, limit=limit, completion=completion)
    if match := _VLLM_PROMPT.search(message):
        return ContextOverflow(
            prompt_tokens=int(match[3]), limit=int(match[1]), at_least=bool(match[2])
        )
    if match := _VLLM_REQUESTED.search(message):
        limit, _, prompt, completion = map(int, match.groups())
        if prompt >= limit:
            return ContextOverflow(prompt_tokens=prompt, limit=limit)
        return ContextOverflow(prompt_tokens=prompt, limit=limit, completion=completion)
    if match := _VLLM_REQUESTED_PROMPT.search(message):
        return ContextOverflow(prompt_tokens=int(match[2]), limit=int(match[1]))
    if match := _LLAMA_CPP.search(message):
        return ContextOverflow(prompt_tokens=int(match[1]), limit=int(match[2]))
    if _OLLAMA in message:
        return ContextOverflow(prompt_tokens=None, limit=None)
    return None


def _error_object(body: bytes) -> dict[str, Any]:
    try:
        document = json.loads(body)
    except ValueError:
        return {}
    error = document.get("error") if isinstance(document, dict) else None
    return error if isinstance(error, dict) else {}
