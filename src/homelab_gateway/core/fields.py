"""The checks every request mapping shares, one rule each: strings, image parts, the output
cap, usage in the upstream's stream, `n`. A refusal is an `InvalidRequest` naming the field."""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping
from typing import Any

OUTPUT_LIMITS = ("max_tokens", "max_completion_tokens")
"""The fields that bound an answer's length in an upstream (chat or completions) request."""


class InvalidRequest(Exception):
    """A client mistake, answered as 400 invalid_request_error with this text; `param` names
    the field for the surfaces whose errors carry it apart (OpenAI's)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value == value


def kind_of(value: Any) -> str:
    """A value as an error names it: short, and never the whole of a client's string."""
    if value is None:
        return "nothing"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, str):
        return repr(value[:40])
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, list):
        return "an array"
    if isinstance(value, Mapping):
        return "an object"
    return type(value).__name__


def string(item: Mapping[str, Any], key: str, where: str, *, nonempty: bool = False) -> str:
    """`item[key]`, a string (a non-empty one where `nonempty`)."""
    value = item.get(key)
    if not isinstance(value, str) or (nonempty and not value):
        wanted = "a non-empty string" if nonempty else "a string"
        raise InvalidRequest(
            f"{where}.{key}: must be {wanted}, got {kind_of(value)}", f"{where}.{key}"
        )
    return value


def typed(part: Any, where: str) -> str:
    """The `type` of a content part or block, which must be an object."""
    if not isinstance(part, Mapping):
        raise InvalidRequest(f"{where}: must be an object, got {kind_of(part)}", where)
    kind = part.get("type")
    if not isinstance(kind, str):
        raise InvalidRequest(
            f"{where}.type: must be a string, got {kind_of(kind)}", f"{where}.type"
        )
    return kind


def check_base64(data: str, where: str) -> None:
    """Image data the upstream would fail to decode is the client's mistake, said before it
    waits in the line."""
    try:
        base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequest(f"{where}: is not valid base64", where) from None


def image_part(url: str, detail: Any = None) -> dict[str, Any]:
    """An image as the upstream's chat request takes it: an `image_url` part."""
    image: dict[str, Any] = {"url": url}
    if detail in ("low", "high", "auto"):
        image["detail"] = detail
    return {"type": "image_url", "image_url": image}


def cap_output(body: dict[str, Any], cap: int | None, *, absent_is_unbounded: bool) -> None:
    """Put the model's output cap (`max_tokens` of its config) on the upstream `body`: each
    limit set is lowered to it, and an answer no limit bounds gets it as `max_tokens`. A null
    limit is unbounded (the upstream writes to the end of the window); so is an absent one
    where `absent_is_unbounded` (chat, Responses; completions' absent limit is 16 tokens)."""
    if cap is None:
        return
    for name in OUTPUT_LIMITS:
        if is_int(body.get(name)):
            body[name] = min(body[name], cap)
    if any(is_int(body.get(name)) for name in OUTPUT_LIMITS):
        return
    if absent_is_unbounded or any(name in body for name in OUTPUT_LIMITS):
        body["max_tokens"] = cap


def usage_options(continuous_usage_stats: bool) -> dict[str, bool]:
    """The `stream_options` of an upstream stream the gateway translates: usage always, for
    its own counts, and in every chunk where the upstream can (vLLM's extension)."""
    options = {"include_usage": True}
    if continuous_usage_stats:
        options["continuous_usage_stats"] = True
    return options


def check_one_choice(body: Mapping[str, Any]) -> None:
    """`n` above 1 asks for n sequences at once, which would run in the one slot the request
    holds: refused, so no request takes more of an upstream than a slot."""
    n = body.get("n")
    if n is None or n == 1:
        return
    if not is_int(n) or n < 1:
        raise InvalidRequest(f"n: must be an integer >= 1, got {kind_of(n)}", "n")
    raise InvalidRequest(
        f"n: this gateway generates one choice per request, got {n}; send {n} requests", "n"
    )
