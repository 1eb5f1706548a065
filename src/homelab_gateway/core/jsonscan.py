"""One top-level key's object in a JSON document that arrives read by read (sans-IO).

A whole answer's `usage` may stand anywhere in its body (vLLM writes it before
`prompt_logprobs`, which can be megabytes), and the answer passes on as it arrives, so it is
never kept whole. `TopLevelObject` follows the document's strings and depth across reads and
keeps only the bytes of the key's value. Regular expressions skip what does not matter (a
string's text, the numbers of an embedding) in C: Python sees only brackets and quotes.
"""

from __future__ import annotations

import re
from typing import Any

import orjson

_NEXT = re.compile(rb'["{}\[\]]')
"""Outside a string, what changes the state: a string's start, or a bracket."""
_STRING = re.compile(rb'[^"\\]*+(?:\\.[^"\\]*+)*+', re.DOTALL)
"""A string's text up to its closing quote, or up to a backslash that ends the read."""
_NESTED = re.compile(rb'(?:[^"{}\[\]]++|"[^"\\]*+(?:\\.[^"\\]*+)*+")*+', re.DOTALL)
"""Below the top level, what is neither a bracket nor a string the read does not finish:
nothing in it matters, strings whole included."""
_SPACE = re.compile(rb"[ \t\r\n]*")
_OPEN = frozenset(b"{[")
COLON, VALUE = 1, 2  # what is awaited after the key
LIMIT = 1024 * 1024  # bytes of the value kept at most: a usage object is a few hundred


class TopLevelObject:
    """The object value of `key` among the outermost object's keys (the last one, if written
    twice, as JSON parsers read it); None if there is none, or it is no object."""

    def __init__(self, key: str, limit: int = LIMIT) -> None:
        self._key = key.encode()
        self._limit = limit
        self._depth = 0
        self._in_string = False
        self._escaped = False  # a backslash ended the last read, inside a string
        self._text: bytes | None = None  # a top-level string's text, while it may be the key
        self._after = 0  # COLON or VALUE: where the key was just read
        self._kept: bytearray | None = None  # the value's bytes, while it is being read
        self._value: bytes | None = None

    def feed(self, data: bytes) -> None:
        pos, end = 0, len(data)
        start = 0  # where the value's bytes in this read begin, while one is kept
        while pos < end:
            if self._in_string:
                pos = self._string(data, pos)
                continue
            if self._after:
                pos = _SPACE.match(data, pos).end()  # type: ignore[union-attr]
                if pos == end:
                    break
                after, self._after = self._after, 0
                if after == COLON and data[pos] == ord(":"):
                    self._after = VALUE
                    pos += 1
                    continue
                if after == VALUE and data[pos] == ord("{"):
                    self._kept, start = bytearray(), pos
            if self._depth > 1:
                pos = _NESTED.match(data, pos).end()  # type: ignore[union-attr]
                if pos == end:
                    break
            else:
                bracket = _NEXT.search(data, pos)
                if bracket is None:
                    break
                pos = bracket.start()
            found = data[pos]
            pos += 1
            if found == ord('"'):
                self._in_string = True
                if self._depth == 1:
                    self._text = b""
            elif found in _OPEN:
                self._depth += 1
            else:
                self._depth -= 1
                if self._kept is not None and self._depth == 1:
                    self._kept += data[start:pos]
                    self._value, self._kept = bytes(self._kept), None
        if self._kept is not None:
            self._kept += data[start:]
            if len(self._kept) > self._limit:
                self._kept = None

    def _string(self, data: bytes, pos: int) -> int:
        """Read on in a string from `pos`; where reading goes on."""
        if self._escaped:
            self._escaped, self._text = False, None  # the key is written plainly
            return pos + 1
        stop = _STRING.match(data, pos).end()  # type: ignore[union-attr]
        if self._text is not None:
            self._text += data[pos:stop]
            if len(self._text) > len(self._key):
                self._text = None
        if stop == len(data):
            return stop
        if data[stop] == ord("\\"):  # the read ends in the middle of an escape
            self._escaped = True
            return stop + 1
        self._in_string = False
        if self._text == self._key:
            self._after = COLON
        self._text = None
        return stop + 1

    @property
    def value(self) -> dict[str, Any] | None:
        if self._value is None:
            return None
        try:
            value = orjson.loads(self._value)
        except ValueError:
            return None
        return value if isinstance(value, dict) else None
