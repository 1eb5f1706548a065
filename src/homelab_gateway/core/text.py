"""Text as JSON can spell it and UTF-8 cannot carry it: lone surrogates, and numbers that are
no JSON; and JSON written whatever a client sent (`dumps`). Every surface reads requests and
answers through these, the translator included."""

from __future__ import annotations

import json
import math
import re
from typing import Any

import orjson

LONE_SURROGATE = re.compile(r"[\ud800-\udfff]")
"""A surrogate left in a decoded JSON string is a lone one (json joins an escaped pair): no
UTF-8 can carry it."""


def replace_lone_surrogates(text: str) -> str:
    """`text` with each lone UTF-16 surrogate as U+FFFD and each pair as its character: JSON's
    `\\u` escapes can spell either, and UTF-8 (every event, every answer body) has neither."""
    if LONE_SURROGATE.search(text) is None:
        return text
    return text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")


def refuse_constant(name: str) -> Any:
    """For `json.loads(parse_constant=...)`: NaN and Infinity are not JSON, though Python's
    json takes them (and would write them on, to an upstream or a client)."""
    raise ValueError(f"{name} is not a JSON number")


def finite_float(text: str) -> float:
    """`1e400` is valid JSON but overflows to infinity, which would go upstream as `Infinity`."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:40]} is out of range")
    return value


def dumps(document: Any) -> bytes:
    """Compact UTF-8 JSON, in a buffer of its own size: orjson's is sized for the worst case
    (several times the text), and a waiter keeps its body for minutes. orjson refuses what
    Python's json takes from a client (a lone surrogate escape, an integer past 64 bits):
    those are written by the standard library."""
    try:
        return bytes(memoryview(orjson.dumps(document)))
    except orjson.JSONEncodeError:
        return json.dumps(document, separators=(",", ":")).encode()
