"""Real servers on loopback for the integration tests, and a curl-like raw HTTP client.

Everything here runs on the real reactor under trial, on ephemeral ports, and is torn down so
trial's dirty-reactor check passes: every server-side connection is tracked and waited for.
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Callable
from typing import Any

from twisted.internet import reactor
from twisted.internet.defer import Deferred, succeed
from twisted.internet.interfaces import IDelayedCall
from twisted.internet.protocol import ClientFactory, Protocol
from twisted.internet.task import Clock, deferLater
from twisted.logger import globalLogPublisher
from twisted.protocols.policies import WrappingFactory
from twisted.trial.unittest import TestCase

from homelab_gateway.config import Config, parse_config
from homelab_gateway.dev.stub import StubLog, StubResource, StubSettings, stub_site
from homelab_gateway.service import Gateway
from homelab_gateway.web.channel import send_at_once


class SoonerResetClock(Clock):
    """A Clock that counts the resets moving a call sooner. A reactor serves those by a linear
    search of every pending timer (`ReactorBase._moveCallLaterSooner`), thousands of them with
    a long line, which `Clock` hides: code that must stay cheap there can be held to none."""

    def __init__(self) -> None:
        super().__init__()
        self.moved_sooner = 0

    def callLater(
        self, delay: float, callable: Callable[..., object], *args: object, **kw: object
    ) -> IDelayedCall:
        call = super().callLater(delay, callable, *args, **kw)
        call.resetter = self._moved  # type: ignore[attr-defined]
        return call

    def _moved(self, call: IDelayedCall) -> None:
        self.moved_sooner += 1


class RecordingLog(StubLog):
    """The stub's log, kept in memory with the monotonic time of each line."""

    def __init__(self) -> None:
        super().__init__(None)
        self.lines: list[tuple[float, str, str]] = []

    def write(self, event: str, request_id: str, **fields: Any) -> None:
        self.lines.append((time.monotonic(), event, request_id))

    def events(self, name: str) -> list[tuple[float, str, str]]:
        return [line for line in self.lines if line[1] == name]


PATIENCE = 20.0
"""How long a test waits for a state (a slot held, a line logged) before it fails. A passing
wait ends as soon as the state holds, so the bound only has to be long enough for a loaded
2-core machine, and short next to every timer that could produce the same state by accident
(idle_timeout 300 s, queue_timeout 600 s)."""

PROMPTLY = 3.0
"""What "at once" means in an assertion on a loaded machine (a cancel reaching the upstream, a
queue frame, a refusal): hundreds of times the figures bench/ measures (a few ms)."""


async def wait_for(
    predicate: Callable[[], bool], timeout: float = PATIENCE, what: str = ""
) -> None:
    """Poll a condition on real sockets, bounded: where no Clock can stand in."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or predicate}")
        await deferLater(reactor, 0.005, lambda: None)


class Servers:
    """A stub upstream (or several) and a gateway in front, all in this process."""

    def __init__(self, test: TestCase) -> None:
        self.test = test
        self.factories: list[WrappingFactory] = []
        self.ports: list[Any] = []
        self.gateway: Gateway | None = None
        self.gateway_url = ""
        test.addCleanup(self.close)

    def listen(self, site: Any) -> int:
        factory = WrappingFactory(site)
        port = reactor.listenTCP(0, factory, interface="127.0.0.1")
        self.factories.append(factory)
        self.ports.append(port)
        return port.getHost().port

    def stub(self, **settings: Any) -> tuple[str, StubResource, RecordingLog]:
        log = RecordingLog()
        site = stub_site(StubSettings(**settings), reactor, log)
        port = self.listen(site)
        return f"http://127.0.0.1:{port}/v1", site.resource, log

    def start_gateway(self, document: dict[str, Any], environ: dict[str, str] | None = None) -> str:
        environ = {"TEST_KEY": "sekrit", **(environ or {})}
        # The usage ledger in memory: a test writes no file into the checkout.
        document = {"usage": {"database": ":memory:"}, **document}
        config: Config = parse_config(document, source="<test>", environ=environ)
        self.gateway = Gateway(config, reactor)
        port = self.listen(self.gateway.site)
        send_at_once(self.ports[-1])  # as the daemon's own listening port does
        self.gateway_url = f"http://127.0.0.1:{port}"
        self.gateway_port = port
        return self.gateway_url

    async def close(self) -> None:
        if self.gateway is not None:
            await self.gateway.close()
        for port in self.ports:
            await port.stopListening()
        for factory in self.factories:
            for protocol in list(factory.protocols):
                protocol.transport.abortConnection()
        await wait_for(
            lambda: not any(f.protocols for f in self.factories), 5, "connections to close"
        )


def gateway_document(
    stub_url: str,
    *,
    slots: int = 2,
    server: dict[str, Any] | None = None,
    upstream: dict[str, Any] | None = None,
    model: dict[str, Any] | None = None,
    routes: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    return {
        "server": {"ping_interval": 10, **(server or {})},
        "upstreams": {"vllm": {"url": stub_url, "slots": slots, **(upstream or {})}},
        "models": {"reasoning": {"upstream": "vllm", **(model or {})}},
        "routes": routes if routes is not None else [{"prefix": "/openai/", "upstream": "vllm"}],
        "usage": {"database": ":memory:"},  # as `Servers.start_gateway` gives any other document
    }


class RawResponse(Protocol):
    """A client that sends exact request bytes and records what comes back, with timestamps,
    like curl -N; `body_text()` undoes chunked transfer coding."""

    def __init__(self) -> None:
        self.raw = b""
        self.received: list[tuple[float, bytes]] = []
        self.closed: Deferred[None] = Deferred()
        self._waiters: list[tuple[Callable[[], bool], Deferred[None]]] = []

    def dataReceived(self, data: bytes) -> None:
        self.raw += data
        self.received.append((time.monotonic(), data))
        for entry in list(self._waiters):
            if entry[0]():
                self._waiters.remove(entry)
                entry[1].callback(None)

    def connectionLost(self, reason: Any) -> None:
        self.closed.callback(None)
        for _, d in self._waiters:
            d.errback(AssertionError(f"connection closed; got {self.raw[-400:]!r}"))
        self._waiters.clear()

    def until(self, predicate: Callable[[], bool], timeout: float = PATIENCE) -> Deferred[None]:
        if predicate():
            return succeed(None)
        d: Deferred[None] = Deferred()
        self._waiters.append((predicate, d))
        return d.addTimeout(timeout, reactor)

    def until_text(self, text: str, timeout: float = PATIENCE) -> Deferred[None]:
        return self.until(lambda: text in self.body_text(), timeout)

    def disconnect(self) -> None:
        self.transport.abortConnection()

    @property
    def head(self) -> str:
        return self.raw.partition(b"\r\n\r\n")[0].decode("latin-1")

    @property
    def status(self) -> int:
        return int(self.head.split(" ", 2)[1])

    def header(self, name: str) -> str | None:
        for line in self.head.split("\r\n")[1:]:
            key, _, value = line.partition(":")
            if key.strip().lower() == name.lower():
                return value.strip()
        return None

    def body_bytes(self) -> bytes:
        body = self.raw.partition(b"\r\n\r\n")[2]
        if (self.header("transfer-encoding") or "").lower() != "chunked":
            return body
        out = b""
        while body:
            size_line, sep, rest = body.partition(b"\r\n")
            if not sep:
                break
            size = int(size_line.split(b";")[0], 16)
            if size == 0 or len(rest) < size:
                out += rest[:size] if size else b""
                break
            out += rest[:size]
            body = rest[size + 2 :]
        return out

    def body_text(self) -> str:
        return self.body_bytes().decode("utf-8", "replace")

    def frames(self) -> list[tuple[str, dict[str, Any]]]:
        """The SSE frames so far, each (event name, parsed data), asserting the wire shape."""
        out = []
        for block in self.body_text().split("\n\n"):
            if not block.strip():
                continue
            lines = block.split("\n")
            assert (
                len(lines) == 2 and lines[0].startswith("event: ") and lines[1].startswith("data: ")
            ), block
            data = json.loads(lines[1][len("data: ") :])
            assert data["type"] == lines[0][len("event: ") :], block
            out.append((data["type"], data))
        return out

    def events(self) -> list[str]:
        return [name for name, _ in self.frames()]


def raw_request(
    port: int,
    method: str,
    path: str,
    body: Any = None,
    headers: dict[str, str] | None = None,
    *,
    length: bool = True,
) -> RawResponse:
    """Open a connection and send one request, as curl would; returns the live response.

    `length=False` sends the body as given with no Content-Length of ours (chunked, or a
    header in `headers` that the body does not live up to)."""
    payload = (
        b"" if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
    )
    lines = [
        f"{method} {path} HTTP/1.1",
        f"Host: 127.0.0.1:{port}",
        "User-Agent: curl/8.5.0",
        "Accept: */*",
        "Connection: close",
    ]
    if body is not None:
        lines.append("Content-Type: application/json")
        if length:
            lines.append(f"Content-Length: {len(payload)}")
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    request = ("\r\n".join(lines) + "\r\n\r\n").encode() + payload
    return send_raw(port, request)


def send_raw(port: int, data: bytes = b"") -> RawResponse:
    """A connection that sends exactly `data` (maybe nothing) and keeps listening."""
    protocol = RawResponse()

    class Factory(ClientFactory):
        def buildProtocol(self, addr: Any) -> Protocol:
            return protocol

    protocol.connectionMade = lambda: protocol.transport.write(data)  # type: ignore[method-assign]
    reactor.connectTCP("127.0.0.1", port, Factory())
    return protocol


def chat(
    model: str = "reasoning",
    content: str = "hi",
    *,
    stream: bool = True,
    max_tokens: int = 64,
    **extra: Any,
) -> dict[str, Any]:
    return {
        "model": model,
        "max_tokens": max_tokens,
        "stream": stream,
        "messages": [{"role": "user", "content": content}],
        **extra,
    }


def capture_log(test: Any) -> list[dict[str, Any]]:
    """Every log event emitted while `test` runs."""
    logged: list[dict[str, Any]] = []
    globalLogPublisher.addObserver(logged.append)
    test.addCleanup(globalLogPublisher.removeObserver, logged.append)
    return logged


def capture_request_log(test: Any) -> list[dict[str, Any]]:
    """The request log events (`homelab_gateway.requests`) emitted while `test` runs."""
    logged: list[dict[str, Any]] = []

    def observe(event: dict[str, Any]) -> None:
        if event.get("log_namespace") == "homelab_gateway.requests":
            logged.append(event)

    globalLogPublisher.addObserver(observe)
    test.addCleanup(globalLogPublisher.removeObserver, observe)
    return logged


class _ClusterConfig:
    fallback_share = 0.0


class FakeCluster:
    """What a shared line calls of `cluster.Cluster`, with no Redis: its claims (`grant`) are
    kept to be answered by the caller, every other script call succeeds at once."""

    def __init__(self) -> None:
        self.live = True
        self.config = _ClusterConfig()
        self.instance = "here/0"
        self.last_error = ""
        self.unsent: dict[Any, Any] = {}
        self.claims: list[tuple[str, bytes, Deferred[Any]]] = []
        self.dropped: list[str] = []  # why the link was dropped, each time
        self.in_grace = False
        self._ids = itertools.count(1)

    def drop(self, reason: str) -> None:
        self.dropped.append(reason)

    def add(self, line: Any) -> None:
        """A line registers with its cluster; nothing to keep here."""

    def new_id(self) -> str:
        return f"{self.instance}/{next(self._ids)}"

    def running(self, w: str) -> bool:
        return False

    def line_call(self, line: Any, script: str, *args: Any) -> Deferred[Any]:
        if script == "grant":
            d: Deferred[Any] = Deferred()
            self.claims.append((args[0], args[1], d))
            return d
        return succeed(None)
