"""Server-sent events, both directions, with no I/O.

`SSEParser` follows the WHATWG event-stream grammar: bytes go in as they come off the socket
(split anywhere, `\\r\\n`, `\\n` or `\\r` line ends, comment lines) and complete events come out.
A line, and an event's data, are bounded by `MAX_EVENT_BYTES`: an upstream that never ends its
line would otherwise grow the buffer without limit. The partial line is kept as a list of reads
and joined once, when its line end arrives, so buffering stays linear in the bytes received.

`encode_event` writes the one frame shape this gateway ever sends: an `event:` line and a single
`data:` line of compact JSON whose `type` names the event, because real Anthropic SDKs drop bare
`data:` frames and die on non-JSON data.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

MAX_EVENT_BYTES = 4 * 1024 * 1024
"""The longest line, and the most data one event may gather. Real chunks are a few hundred
bytes; the largest legitimate ones (a whole tool call at once from llama.cpp, a long answer in
one non-incremental chunk) are far below this."""


@dataclass(frozen=True, slots=True)
class ServerSentEvent:
    data: str
    event: str = "message"
    id: str | None = None


class EventTooLarge(ValueError):
    """A line or an event's data passed `MAX_EVENT_BYTES`: the stream cannot be parsed on.

    `events` holds what the same `feed` completed before the overflow, in order.
    """

    def __init__(self, limit: int, events: list[ServerSentEvent]) -> None:
        super().__init__(f"an event-stream line or event exceeded {limit} bytes")
        self.events = events


class SSEParser:
    """Incremental event-stream parser: `feed(bytes)` returns the events completed by them.

    Lines are split on bytes, which is safe for UTF-8 (no multi-byte sequence contains CR or LF),
    and decoded one at a time with replacement, as the spec asks.
    """

    def __init__(self, limit: int = MAX_EVENT_BYTES) -> None:
        self.limit = limit  # bytes of one line, or of one event's data
        self._partial: list[bytes] = []  # the reads holding the line not yet ended
        self._partial_size = 0
        self._after_cr = False
        self._started = False
        self._data: list[str] = []
        self._data_size = 0
        self._event = ""
        self._id: str | None = None

    @property
    def idle(self) -> bool:
        """Between events: no line or event begun, so the next bytes start a fresh line of a
        fresh event (and the byte-order mark has had its chance). Whoever reads a whole
        `data: ...\n\n` event past the parser while it is idle leaves it exactly as feeding
        those bytes would, apart from the `id`, which such an event does not touch."""
        return (
            self._started
            and not self._partial
            and not self._after_cr
            and not self._data
            and not self._event
        )

    def feed(self, chunk: bytes) -> list[ServerSentEvent]:
        """The events `chunk` completes; raises EventTooLarge past the limit."""
        if self._after_cr:
            self._after_cr = False
            if chunk[:1] == b"\n":
                chunk = chunk[1:]  # the LF of a CRLF that was split across two reads
        if not chunk:
            return []
        if not self._partial and chunk[-1:] == b"\n" and b"\r" not in chunk:
            # The common read: whole LF-terminated lines (vLLM, Ollama, llama.cpp send these),
            # mostly `data: ` lines and blank ones, which `_lines` takes without a call per line.
            lines = chunk.split(b"\n")
            lines.pop()
            return self._lines(lines)
        if b"\n" not in chunk and b"\r" not in chunk:
            self._partial_size += len(chunk)
            if self._partial_size > self.limit:
                raise EventTooLarge(self.limit, [])
            self._partial.append(chunk)
            return []
        self._after_cr = chunk.endswith(b"\r")
        if self._partial:
            self._partial.append(chunk)
            chunk = b"".join(self._partial)
        lines = chunk.splitlines()
        if chunk.endswith((b"\n", b"\r")):
            self._partial, self._partial_size = [], 0
        else:
            rest = lines.pop()
            self._partial, self._partial_size = [rest], len(rest)
        events = self._lines(lines)
        if self._partial_size > self.limit:
            raise EventTooLarge(self.limit, events)
        return events

    def _lines(self, lines: list[bytes]) -> list[ServerSentEvent]:
        events: list[ServerSentEvent] = []
        for raw in lines:
            if raw[:6] == b"data: " and self._started:
                # Once per token: `_line` inlined for its most common case.
                self._data_size += len(raw) - 5
                if len(raw) > self.limit or self._data_size > self.limit:
                    raise EventTooLarge(self.limit, events)
                self._data.append(raw[6:].decode("utf-8", "replace"))
                continue
            try:
                event = self._line(raw)
            except EventTooLarge as e:
                e.events = events
                raise
            if event is not None:
                events.append(event)
        return events

    def _line(self, raw: bytes) -> ServerSentEvent | None:
        if not self._started:
            self._started = True
            if raw.startswith(b"\xef\xbb\xbf"):
                raw = raw[3:]
        if not raw:
            return self._dispatch()
        if raw[:1] == b":":
            return None
        name, sep, value = raw.partition(b":")
        if sep and value[:1] == b" ":
            value = value[1:]
        field = name.decode("utf-8", "replace")
        if field == "data":
            self._data_size += len(value) + 1
            if len(raw) > self.limit or self._data_size > self.limit:
                raise EventTooLarge(self.limit, [])
            self._data.append(value.decode("utf-8", "replace"))
        elif field == "event":
            self._event = value.decode("utf-8", "replace")
        elif field == "id" and b"\0" not in value:
            self._id = value.decode("utf-8", "replace")
        return None

    def _dispatch(self) -> ServerSentEvent | None:
        data, event = self._data, self._event
        self._data, self._event, self._data_size = [], "", 0
        if not data:
            return None
        return ServerSentEvent(data="\n".join(data), event=event or "message", id=self._id)


def encode_event(data: dict[str, Any]) -> bytes:
    """One SSE frame named after `data["type"]`, so the name and the JSON can never disagree.

    orjson writes the same compact UTF-8 JSON as `json.dumps(..., ensure_ascii=False,
    separators=(",", ":"))`, about twenty times faster: this runs once per token.
    """
    return b"event: " + data["type"].encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"
