"""Small helpers every route uses to answer: JSON bodies, errors in each surface's shape."""

from __future__ import annotations

import json
import secrets
from typing import Any

from twisted.web.iweb import IRequest

from homelab_gateway.core.errors import GatewayError
from homelab_gateway.core.surfaces import SHAPES, Shape


def shape_of(path: bytes) -> Shape:
    """The error shape of a path, for answers given before any route is chosen (the channel's
    413, 431, 408): its surface's (`core.surfaces`), Anthropic's elsewhere under /llm/, else
    the plain one."""
    shape = SHAPES.get(path.partition(b"?")[0].rstrip(b"/"))
    if shape is not None:
        return shape
    return "anthropic" if path.startswith(b"/llm/") else "plain"


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


def error_body(error: GatewayError, shape: Shape) -> tuple[int, dict[str, Any]]:
    """The status and body of `error` in `shape`."""
    if shape == "openai":
        return error.openai_status, error.openai_body()
    if shape == "anthropic":
        return error.status, error.anthropic_body()
    return error.status, error.plain_body()


def send_error(request: IRequest, error: GatewayError, *, shape: Shape = "anthropic") -> bytes:
    """The error as an HTTP answer in the surface's `shape`. On OpenAI's surfaces an upstream's
    own refusal passes on with its status and body, as the upstream wrote it."""
    if error.retry_after is not None:
        request.setHeader(b"retry-after", str(error.retry_after).encode())
    if shape == "openai" and error.upstream_body is not None and error.upstream_status is not None:
        request.setResponseCode(error.upstream_status)
        try:
            json.loads(error.upstream_body)
            content_type = b"application/json"
        except ValueError:
            content_type = b"text/plain; charset=utf-8"
        request.setHeader(b"content-type", content_type)
        return error.upstream_body
    return send_json(request, *error_body(error, shape))
