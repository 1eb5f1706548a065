"""Short requests through a gateway and a stub in this one process, for counting, not timing.

`python -m bench.inproc [--requests 200] [--profile FILE]` sends that many short `/llm`
requests one after the other (alternately streaming and not, 8 + 8 tokens, a new connection
each, as bench's scenario 2 does) and prints the wall-clock time per request. The gateway, the
stub and this client share the process, so what it is good for is comparing two versions of
the gateway by counts that do not depend on the machine's load: cProfile's function calls per
request (`--profile`), or callgrind's instructions (the difference between two `--requests`
values cancels start-up):

    valgrind --tool=callgrind --callgrind-out-file=/dev/null \\
        .venv/bin/python -m bench.inproc --requests 100

`--tokens N` makes every request a stream of N content tokens instead (no reasoning), for the
cost per token: the difference between two `--requests` values, divided by the tokens.

`--direct` sends the stub, on a new connection each, the chat-completions request the gateway
would send upstream for each of them, with no gateway: the same count for the stub and the
client alone, to subtract from the gateway's. The gateway keeps its upstream connection open,
so the difference leaves out the stub's work to accept one, and is a floor of the gateway's own.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import time
from typing import Any

from twisted.internet import reactor
from twisted.internet.defer import Deferred, ensureDeferred
from twisted.internet.protocol import ClientFactory, Protocol
from twisted.python.failure import Failure

from bench.scenarios import upstream_body
from homelab_gateway.config import parse_config
from homelab_gateway.dev.stub import StubLog, StubSettings, stub_site
from homelab_gateway.service import Gateway
from homelab_gateway.web.channel import send_at_once


class _Exchange(Protocol):
    """One request on its own connection (`Connection: close`); the answer when it closes."""

    def __init__(self, request: bytes) -> None:
        self.request = request
        self.received: list[bytes] = []
        self.done: Deferred[bytes] = Deferred()

    def connectionMade(self) -> None:
        self.transport.write(self.request)

    def dataReceived(self, data: bytes) -> None:
        self.received.append(data)

    def connectionLost(self, reason: Failure) -> None:
        self.done.callback(b"".join(self.received))


def exchange(port: int, request: bytes) -> Deferred[bytes]:
    protocol = _Exchange(request)
    factory = ClientFactory()
    factory.buildProtocol = lambda addr: protocol  # type: ignore[method-assign]
    reactor.connectTCP("127.0.0.1", port, factory)
    return protocol.done


def message(port: int, stream: bool, tokens: int = 16) -> bytes:
    body = json.dumps(
        {
            "model": "fast",
            "max_tokens": tokens,
            "stream": stream,
            "messages": [{"role": "user", "content": "Say hello."}],
        }
    ).encode()
    head = (
        f"POST /llm/v1/messages HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        "Content-Type: application/json\r\nConnection: close\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


def upstream_message(port: int, tokens: int = 16) -> bytes:
    """What the gateway sends the stub for `message` (streamed either way, as it always is)."""
    body = json.dumps(upstream_body("Say hello.", tokens)).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        "Content-Type: application/json\r\nAccept: text/event-stream\r\n"
        f"Connection: close\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


async def run(requests: int, profile: str | None, tokens: int | None, direct: bool) -> None:
    settings = StubSettings()
    if tokens is not None:
        settings = StubSettings(reasoning_tokens=0, content_tokens=tokens)
    stub = reactor.listenTCP(0, stub_site(settings, reactor, StubLog(None)), interface="127.0.0.1")

    def ask(i: int) -> bytes:
        if tokens is None:
            return upstream_message(port) if direct else message(port, i % 2 == 0)
        return upstream_message(port, tokens) if direct else message(port, True, tokens)

    document = {
        "upstreams": {"fast": {"url": f"http://127.0.0.1:{stub.getHost().port}/v1", "slots": 8}},
        "models": {"fast": {"upstream": "fast"}},
        "usage": {"database": ":memory:"},  # no file in the checkout
    }
    gateway = Gateway(parse_config(document, source="<bench>", environ={}), reactor)
    listening = reactor.listenTCP(0, gateway.site, interface="127.0.0.1")
    send_at_once(listening)  # as the daemon's own listening port does
    port = listening.getHost().port
    if direct:
        port = stub.getHost().port
    answers: list[bytes] = []
    for i in range(4):  # warm up: imports, the connection pool
        answers.append(await exchange(port, ask(i)))
    profiler = cProfile.Profile() if profile else None
    started = time.perf_counter()
    if profiler is not None:
        profiler.enable()
    for i in range(requests):
        answers.append(await exchange(port, ask(i)))
    if profiler is not None:
        profiler.disable()
    elapsed = time.perf_counter() - started
    bad = [a[:80] for a in answers if not a.startswith(b"HTTP/1.1 200")]
    assert not bad, bad
    print(f"{requests} requests: {elapsed * 1e3 / requests:.2f} ms per request (wall clock)")
    if profiler is not None:
        profiler.dump_stats(profile)
        calls = pstats.Stats(profiler).total_calls  # type: ignore[attr-defined]
        print(f"{calls / requests:.0f} function calls per request; profile in {profile}")
    await gateway.close()
    await listening.stopListening()
    await stub.stopListening()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--profile", default=None)
    parser.add_argument("--tokens", type=int, default=None, help="stream N tokens per request")
    parser.add_argument("--direct", action="store_true", help="the stub alone, no gateway")
    args = parser.parse_args()

    def stop(result: Any) -> Any:
        reactor.stop()
        return result

    def work() -> None:
        ensureDeferred(run(args.requests, args.profile, args.tokens, args.direct)).addBoth(stop)

    reactor.callWhenRunning(work)
    reactor.run()


if __name__ == "__main__":
    main()
