"""An asyncio load client: one process, many connections, SSE read as it arrives.

Raw HTTP/1.1 over asyncio streams, so the client's own cost stays small and predictable next
to what it measures, and it can be pointed at any URL: the gateway, the stub directly, or
another Anthropic-compatible endpoint. Every response records when its bytes arrived.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from homelab_gateway.core.sse import SSEParser


@dataclass
class Frame:
    at: float
    event: str
    data: Any  # parsed JSON, or the raw text where it is not JSON ([DONE])


@dataclass
class Result:
    sent: float = 0.0
    status: int | None = None
    headers: dict[str, str] = field(default_factory=dict)
    frames: list[Frame] = field(default_factory=list)
    body: bytes = b""
    error: str | None = None
    cut: bool = False  # the client closed the connection on purpose
    bytes_read: int = 0

    def first(self, predicate: Callable[[Frame], bool]) -> Frame | None:
        return next((f for f in self.frames if predicate(f)), None)

    @property
    def events(self) -> list[str]:
        return [f.event for f in self.frames]


# Decides, after each frame, whether to hang up now: the chaos and cancellation scenarios.
CutPolicy = Callable[[Result], bool]


async def request(
    url: str,
    body: Any,
    *,
    headers: dict[str, str] | None = None,
    cut: CutPolicy | None = None,
    method: str = "POST",
    read_delay: float = 0.0,
    read_size: int = 65536,
    on_frame: Callable[[Result, Frame], None] | None = None,
    timeout: float = 300.0,
) -> Result:
    """Send one request and read its answer; SSE bodies are parsed frame by frame.

    `read_delay` sleeps between reads of `read_size` bytes: a slow reader.
    """
    parts = urlsplit(url)
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    payload = body if isinstance(body, bytes) else json.dumps(body).encode()
    head = [
        f"{method} {path} HTTP/1.1",
        f"Host: {parts.netloc}",
        "Connection: close",
        "Content-Type: application/json",
        f"Content-Length: {len(payload)}",
    ]
    head += [f"{k}: {v}" for k, v in (headers or {}).items()]
    result = Result()
    writer = None
    try:
        reader, writer = await asyncio.open_connection(
            parts.hostname, parts.port or 80, limit=2**20
        )
        result.sent = time.monotonic()
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + payload)
        await asyncio.wait_for(_read(reader, result, cut, read_delay, read_size, on_frame), timeout)
    except (TimeoutError, OSError, asyncio.IncompleteReadError, ValueError) as e:
        if not result.cut:
            result.error = f"{type(e).__name__}: {e}"
    finally:
        if writer is not None:
            writer.transport.abort() if result.cut else writer.close()
    return result


class _Cut(Exception):
    pass


async def _read(
    reader: asyncio.StreamReader,
    result: Result,
    cut: CutPolicy | None,
    read_delay: float,
    read_size: int,
    on_frame: Callable[[Result, Frame], None] | None,
) -> None:
    status_line = await reader.readline()
    if not status_line:
        raise ValueError("connection closed before a status line")
    result.status = int(status_line.split()[1])
    while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
        name, _, value = line.decode("latin-1").partition(":")
        result.headers[name.strip().lower()] = value.strip()
    parser = SSEParser()
    sse = result.headers.get("content-type", "").startswith("text/event-stream")
    body: list[bytes] = []

    def take(data: bytes) -> None:
        result.bytes_read += len(data)
        if not sse:
            body.append(data)
            return
        now = time.monotonic()
        for event in parser.feed(data):
            try:
                data_value: Any = json.loads(event.data)
            except ValueError:
                data_value = event.data
            frame = Frame(now, event.event, data_value)
            result.frames.append(frame)
            if on_frame is not None:
                on_frame(result, frame)
            if cut is not None and cut(result):
                result.cut = True
                raise _Cut()

    try:
        if cut is not None and cut(result):  # e.g. cut right after the headers
            result.cut = True
            raise _Cut()
        if result.headers.get("transfer-encoding", "").lower() == "chunked":
            while True:
                size = int((await reader.readline()).split(b";")[0], 16)
                if size == 0:
                    break
                remaining = size
                while remaining:
                    data = await reader.read(min(remaining, read_size))
                    if not data:
                        raise asyncio.IncompleteReadError(b"", remaining)
                    remaining -= len(data)
                    take(data)
                    if read_delay:
                        await asyncio.sleep(read_delay)
                await reader.readexactly(2)
        else:
            while data := await reader.read(read_size):
                take(data)
                if read_delay:
                    await asyncio.sleep(read_delay)
    except _Cut:
        pass
    result.body = b"".join(body)


def get_json(url: str) -> Any:
    """A plain blocking GET of a small JSON document (status endpoints, between scenarios)."""
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.load(response)


def percentile(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(p / 100 * (len(ordered) - 1))))
    return ordered[index]
