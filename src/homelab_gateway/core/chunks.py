"""HTTP/1.1 chunked transfer coding, decoded a whole socket read at a time.

A streaming upstream (vLLM, the stub) sends one HTTP chunk per token, and one socket read carries
a few hundred of them. Twisted's decoder runs a Python state machine per chunk and hands each
chunk's data on by itself, so the gateway would translate, write and reset its timers once per
token. `ChunkedBody` takes every chunk one read holds in a few C-level calls each (a search for
CRLF, a hex match, a slice) and returns their data joined, so what one read brought is passed on
at once, once, and nothing waits for a later read (a chunk cut by the end of a read gives its
first part now).

It decodes only the common shape: a size line of hex digits, data, CRLF. The first line it does
not take as such (the last chunk, `0`, with its trailers; a chunk extension; anything malformed)
and everything after it are returned as `rest`, for Twisted's own decoder, which is then at a
chunk boundary and has the final word on the end of the body and on every error. So the body's
end, the trailers and the errors are Twisted's, as they were. Data that breaks the one rule this
decoder checks itself (a chunk's data not followed by CRLF) raises `MalformedChunks`, as
Twisted's decoder raises its own error there.
"""

from __future__ import annotations

import re
from enum import Enum

# A size line this decoder takes: hex digits only (no extension, no whitespace), at most 16 of
# them; what Twisted's `_hexint` accepts is a superset, and the rest goes to Twisted.
_SIZE_LINE = re.compile(rb"([0-9a-fA-F]{1,16})\r\n")
# A partial size line longer than this cannot become one `_SIZE_LINE` accepts.
_LONGEST_SIZE_LINE = 17


class MalformedChunks(ValueError):
    """A chunk's data was not followed by CRLF."""


class _State(Enum):
    SIZE = "size"  # at a size line (possibly a part of one, kept in `_line`)
    DATA = "data"  # inside a chunk's data, `_left` bytes to go
    CRLF = "crlf"  # after a chunk's data, `_crlf` the part of CRLF still due
    HANDED_OVER = "handed over"  # everything goes to Twisted's decoder now


class ChunkedBody:
    """The decoder's state between reads: a state machine fed bytes, returning data."""

    def __init__(self) -> None:
        self._state = _State.SIZE
        self._line = b""
        self._left = 0
        self._crlf = b""

    def hand_over(self) -> None:
        """From now on every byte is returned as `rest`: for a body its owner found past the
        point this decoder can start at (already in the last chunk's trailers)."""
        self._state = _State.HANDED_OVER

    def feed(self, data: bytes) -> tuple[bytes, bytes | None]:
        """Decode one read: (the data of every chunk in it, joined; `rest`). `rest` is None
        while this decoder keeps the body, else the bytes from the first size line it does not
        take on (once handed over, all of `data`)."""
        if self._state is _State.HANDED_OVER:
            return b"", data
        pieces: list[bytes] = []
        pos = 0
        end = len(data)
        state = self._state
        if state is _State.SIZE and self._line:
            data = self._line + data
            end = len(data)
            self._line = b""
        while pos < end:
            if state is _State.SIZE:
                size_line = _SIZE_LINE.match(data, pos)
                if size_line is None:
                    if data.find(b"\r\n", pos) == -1 and end - pos <= _LONGEST_SIZE_LINE:
                        self._line = data[pos:]  # a size line cut by the end of the read
                        break
                    return self._hand_over(pieces, data[pos:])
                size = int(size_line[1], 16)
                if size == 0:
                    return self._hand_over(pieces, data[pos:])
                start = size_line.end()
                stop = start + size
                if stop + 2 <= end:
                    if data[stop : stop + 2] != b"\r\n":
                        raise MalformedChunks("a chunk's data was not followed by CRLF")
                    pieces.append(data[start:stop])
                    pos = stop + 2
                    continue
                state = _State.DATA  # the read ends within this chunk: taken as it comes
                self._left = size
                pos = start
            elif state is _State.DATA:
                stop = pos + self._left
                if stop <= end:
                    pieces.append(data[pos:stop])
                    state = _State.CRLF
                    self._crlf = b"\r\n"
                    pos = stop
                else:
                    pieces.append(data[pos:])
                    self._left = stop - end
                    pos = end
            else:
                due = self._crlf
                seen = data[pos : pos + len(due)]
                if not due.startswith(seen):
                    raise MalformedChunks("a chunk's data was not followed by CRLF")
                pos += len(seen)
                self._crlf = due[len(seen) :]
                if not self._crlf:
                    state = _State.SIZE
        self._state = state
        return b"".join(pieces), None

    def _hand_over(self, pieces: list[bytes], rest: bytes) -> tuple[bytes, bytes]:
        self.hand_over()
        return b"".join(pieces), rest
