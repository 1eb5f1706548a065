"""What one waiting stream costs the gateway: bytes per waiter by tracemalloc and by RSS.

`python -m bench.waiters [--waiters N] [--top K]` runs a gateway and a stub in this process
(`slots = 2`) and a load client in a child process (so its sockets and buffers are not
counted), has two stalled streams take both slots, then queues N streaming `/llm/v1/messages`
requests, then N more, each waiting until it got its first `event: queue` frame: truly waiting
streams. The cost of one is the difference between N and 2N waiters divided by N, which
cancels start-up and whatever the first waiters warmed:

- RSS (from /proc/self/statm), in a first round without tracing;
- tracemalloc, in a second round on the same gateway: bytes per waiter as the daemon holds
  them (uncollected garbage included) and live (after a full collection), the live bytes
  grouped by allocating line and by their 8 most recent frames, and the objects per waiter
  by type (gc-tracked containers only).

The gateway's heap is settled as the daemon's is (`collector.tune_collector`), and each client sends
what bench's burst scenario sends (a short streamed prompt, a user id of its own).

Both rounds then let the line drain and check every waiter got its answer. tracemalloc's
figure does not depend on the machine's load; RSS adds the allocator's overhead and is
rounded to pages.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import gc
import json
import linecache
import os
import sys
import tracemalloc
from typing import Any

STATM = "/proc/self/statm"
STUB_TOKENS = 8
FRAMES = 12  # of each allocation's traceback


def request_bytes(prompt: str, tag: str, port: int, messages: int = 0) -> bytes:
    """What bench's burst scenario sends: a streamed prompt, a user id per client; with
    `messages`, that many one-character messages before it (the costliest body per byte)."""
    history = [{"role": ("user", "assistant")[i % 2], "content": "a"} for i in range(messages)]
    if messages % 2:
        history.append({"role": "assistant", "content": "a"})
    body = json.dumps(
        {
            "model": "queue",
            "max_tokens": 16,
            "stream": True,
            "messages": [*history, {"role": "user", "content": prompt}],
            "metadata": {"user_id": tag},
        },
        separators=(",", ":"),
    ).encode()
    return (
        f"POST /llm/v1/messages HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        "Content-Type: application/json\r\nAccept: text/event-stream\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode() + body


# The client: a child process driven by one command a line on stdin, answering one line each.


async def _client(port: int, padding: int, messages: int) -> None:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    blockers: list[asyncio.StreamWriter] = []
    stalled: list[asyncio.Task[bool]] = []
    waiters: list[asyncio.Task[bool]] = []

    async def stream(prompt: str, tag: str, seen: asyncio.Future[asyncio.StreamWriter]) -> bool:
        """One request: `seen` once its first frame arrived; True if it ended with
        message_stop."""
        r, w = await asyncio.open_connection("127.0.0.1", port)
        text = prompt + " " + "x" * padding if padding else prompt
        w.write(request_bytes(text, tag, port, messages if prompt != "stall" else 0))
        received = b""
        while True:
            data = await r.read(65536)
            if not data:
                break
            received += data
            if not seen.done() and b"\n\n" in received:
                seen.set_result(w)
        w.close()
        if not seen.done():
            seen.set_exception(ConnectionError(received[:200].decode("latin-1")))
        return b"event: message_stop" in received

    def answer(text: str) -> None:
        sys.stdout.write(text + "\n")
        sys.stdout.flush()

    while line := (await reader.readline()).decode().split():
        command, count = line[0], int(line[1]) if len(line) > 1 else 0
        if command == "block":
            seen = [loop.create_future() for _ in range(count)]
            stalled = [asyncio.ensure_future(stream("stall", "blocker", s)) for s in seen]
            blockers = list(await asyncio.gather(*seen))
            answer("blocked")
        elif command == "open":
            seen = [loop.create_future() for _ in range(count)]
            waiters += [
                asyncio.ensure_future(stream("content-only", f"c-{len(waiters) + i}", s))
                for i, s in enumerate(seen)
            ]
            await asyncio.gather(*seen)
            answer(f"opened {count}")
        elif command == "finish":
            for w in blockers:
                w.close()
            await asyncio.gather(*stalled)
            done = await asyncio.gather(*waiters)
            waiters = []
            answer(f"finished {sum(done)} of {len(done)}")


# The measured process: gateway and stub.


def rss_bytes() -> int:
    with open(STATM) as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


Frames = tuple[tuple[str, int], ...]  # most recent first, as tracemalloc keeps them


def sizes(snapshot: tracemalloc.Snapshot, depth: int) -> dict[Frames, list[int]]:
    """Bytes and blocks by the `depth` most recent frames of their allocation, leaving out this
    module's own (the snapshots, the counts, the client protocol) and tracemalloc's."""
    own = {__file__, tracemalloc.__file__}
    grouped: dict[Frames, list[int]] = collections.defaultdict(lambda: [0, 0])
    for _, size, frames, _ in snapshot.traces._traces:  # type: ignore[attr-defined]
        if not own.isdisjoint(name for name, _ in frames[:4]):
            continue
        entry = grouped[frames[:depth]]
        entry[0] += size
        entry[1] += 1
    return grouped


def diff(
    before: tracemalloc.Snapshot, after: tracemalloc.Snapshot, depth: int
) -> list[tuple[Frames, int, int]]:
    """(frames, bytes, blocks) that `after` holds more than `before`, largest first."""
    old, new = sizes(before, depth), sizes(after, depth)
    rows = [
        (key, size - old.get(key, [0, 0])[0], n - old.get(key, [0, 0])[1])
        for key, (size, n) in new.items()
    ]
    rows += [(key, -size, -n) for key, (size, n) in old.items() if key not in new]
    return sorted(rows, key=lambda row: -row[1])


def short(filename: str) -> str:
    """A source file as a reader would name it: package/module.py."""
    for marker in ("site-packages/", "/src/"):
        if marker in filename:
            return filename.split(marker, 1)[1]
    if "/lib/python" in filename:  # the standard library: drop lib/python3.x/
        return filename.split("/lib/python", 1)[1].split("/", 1)[-1]
    return filename


def show(frame: tuple[str, int], code: bool = False) -> str:
    text = f"{short(frame[0])}:{frame[1]}"
    line = linecache.getline(frame[0], frame[1]).strip() if code else ""
    return f"{text}  `{line[:80]}`" if line else text


def object_types() -> collections.Counter[str]:
    gc.collect()
    return collections.Counter(type(o).__qualname__ for o in gc.get_objects())


def report(n: int, before: tracemalloc.Snapshot, after: tracemalloc.Snapshot, top: int) -> None:
    by_site = diff(before, after, 1)
    total = sum(size for _, size, _ in by_site)
    blocks = sum(count for _, _, count in by_site)
    print(f"tracemalloc, live: {total / n:,.0f} B in {blocks / n:.1f} blocks per waiter")
    print(f"\nby allocating line, top {top} (B and blocks per waiter):")
    for frames, size, count in by_site[:top]:
        print(f"  {size / n:7.0f} {count / n:5.1f}  {show(frames[0], code=True)}")
    print(f"\nby the 8 most recent frames, top {top} (B and blocks per waiter):")
    for frames, size, count in diff(before, after, 8)[:top]:
        chain = " < ".join(show(f) for f in frames[1:])
        print(f"  {size / n:7.0f} {count / n:5.1f}  {show(frames[0], code=True)}\n      < {chain}")


def measure(n: int, top: int, padding: int, messages: int) -> None:
    from twisted.internet import protocol, reactor
    from twisted.internet.defer import Deferred, ensureDeferred

    from homelab_gateway.collector import tune_collector
    from homelab_gateway.config import parse_config
    from homelab_gateway.dev.stub import StubLog, StubSettings, stub_site
    from homelab_gateway.service import Gateway

    settings = StubSettings(reasoning_tokens=0, content_tokens=STUB_TOKENS)
    stub = reactor.listenTCP(0, stub_site(settings, reactor, StubLog(None)), interface="127.0.0.1")
    document = {
        "upstreams": {
            "queue": {
                "url": f"http://127.0.0.1:{stub.getHost().port}/v1",
                "slots": 2,
                "queue_limit": 4 * n + 10,
            }
        },
        "models": {"queue": {"upstream": "queue"}},
        "server": {"max_body_bytes": 64 * 1024 * 1024, "request_timeout": 3600},
        "usage": {"database": ":memory:"},  # no file in the checkout
    }
    gateway = Gateway(parse_config(document, source="<bench>", environ={}), reactor)
    listening = reactor.listenTCP(0, gateway.site, interface="127.0.0.1", backlog=4096)
    port = listening.getHost().port
    line = gateway.pools["queue"].line
    tune_collector()  # as the daemon does once it started

    class Client(protocol.ProcessProtocol):
        def __init__(self) -> None:
            self.buffer = b""
            self.replies: list[Deferred[str]] = []

        def outReceived(self, data: bytes) -> None:
            self.buffer += data
            while b"\n" in self.buffer:
                reply, self.buffer = self.buffer.split(b"\n", 1)
                self.replies.pop(0).callback(reply.decode())

        def errReceived(self, data: bytes) -> None:
            sys.stderr.write(data.decode(errors="replace"))

        def ask(self, command: str) -> Deferred[str]:
            d: Deferred[str] = Deferred()
            self.replies.append(d)
            self.transport.write(command.encode() + b"\n")
            return d

    client = Client()
    reactor.spawnProcess(
        client,
        sys.executable,
        [
            sys.executable,
            "-m",
            "bench.waiters",
            "--client",
            str(port),
            "--prompt-bytes",
            str(padding),
            "--messages",
            str(messages),
        ],
        env=os.environ,
    )

    async def round_(traced: bool) -> None:
        await client.ask("block 2")
        if traced:
            tracemalloc.start(FRAMES)
        await client.ask(f"open {n}")
        assert len(line.waiting) == n, len(line.waiting)
        rss_before = rss_bytes()
        if traced:
            gc.collect()
            types_before = object_types()
            live_before = tracemalloc.take_snapshot()
        await client.ask(f"open {n}")
        assert len(line.waiting) == 2 * n, len(line.waiting)
        rss_after = rss_bytes()
        if traced:
            held_after = tracemalloc.take_snapshot()
            gc.collect()
            live_after = tracemalloc.take_snapshot()
            tracemalloc.stop()
            types_after = object_types()
            held = sum(size for _, size, _ in diff(live_before, held_after, 1))
            print(f"\ntracemalloc, as the daemon holds it: {held / n:,.0f} B per waiter")
            report(n, live_before, live_after, top)
            del live_before, held_after, live_after
            print("\nobjects per waiter (gc-tracked), by type:")
            counts = types_after - types_before
            for name, count in counts.most_common(top):
                print(f"  {count / n:5.1f}  {name}")
            print(f"  {sum(counts.values()) / n:5.1f}  in all")
        else:
            print(f"RSS: {(rss_after - rss_before) / n:,.0f} B per waiter (untraced round)")
        finished = await client.ask("finish")
        assert finished == f"finished {2 * n} of {2 * n}", finished
        assert not line.waiting and line.in_use == 0

    async def run() -> None:
        try:
            await round_(traced=False)
            await round_(traced=True)
        finally:
            client.transport.closeStdin()
            await gateway.close()
            await listening.stopListening()
            await stub.stopListening()

    def stop(result: Any) -> Any:
        reactor.stop()
        return result

    body = len(request_bytes("content-only", "c-0", port, messages).partition(b"\r\n\r\n")[2])
    print(f"each waiter's request body: {body:,} B")

    reactor.callWhenRunning(lambda: ensureDeferred(run()).addBoth(stop))
    reactor.run()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--waiters", type=int, default=1000)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument(
        "--prompt-bytes",
        type=int,
        default=0,
        help="pad each prompt by this many bytes (a coding agent's request is 100 KB or more)",
    )
    parser.add_argument(
        "--messages",
        type=int,
        default=0,
        help="this many one-character messages before each prompt (the costliest body per byte)",
    )
    parser.add_argument("--client", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.client is not None:
        asyncio.run(_client(args.client, args.prompt_bytes, args.messages))
    else:
        measure(args.waiters, args.top, args.prompt_bytes, args.messages)


if __name__ == "__main__":
    main()
