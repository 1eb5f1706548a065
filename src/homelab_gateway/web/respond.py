"""Small helpers every route uses to answer: JSON bodies, errors in each surface's shape."""

from __future__ import annotations

import json
import secrets
from typing import Any

from twisted.web.iweb import IRequest

from homelab_gateway.core.errors import GatewayError


def new_request_id() -> str:
    return "req_" + secrets.token_hex(12)


def send_json(request: IRequest, status: int, document: Any) -> bytes:
    """`document` as UTF-8 JSON; one holding a lone surrogate (a model's tool arguments can
    spell one with a `\\u` escape) as ASCII JSON, which writes it as that same escape."""
    request.setResponseCode(status)
    request.setHeader(b"content-type", b"application/json")
    try:
        return json.dumps(document, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        return json.dumps(document).encode()


def send_error(request: IRequest, error: GatewayError, *, anthropic: bool = True) -> bytes:
    """The error as an HTTP answer: Anthropic's shape on /llm, OpenAI's on passthrough routes."""
    if error.retry_after is not None:
        request.setHeader(b"retry-after", str(error.retry_after).encode())
    return send_json(
        request, error.status, error.anthropic_body() if anthropic else error.openai_body()
    )
