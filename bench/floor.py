"""The floor under issue 16's targets: what Twisted itself costs for an extra HTTP hop.

`python -m bench.floor` starts bench's stubs and gateway (twistd processes, as `python -m bench`
does) and, beside them, three minimal forwarders, each a process of its own on Twisted's epoll
reactor, started the same way (`python -m bench.floor --serve KIND`):

  relay   a TCP byte relay: Twisted's own port forwarder (`twisted.protocols.portforward`),
          a `Protocol` pair writing each read to the other side, with flow control. It cannot
          keep an upstream connection between requests (it does not see them), so every
          request costs it an upstream connect the gateway does not pay
  proxy   a `twisted.web` resource that sends the request on with treq over a persistent
          `HTTPConnectionPool` and writes the response body back with `request.write` per
          piece treq hands over (one per upstream chunk: the stub writes one per token)
  klein   the same behind a Klein route
  answer  (scenario 2 only) a `twisted.web` resource that answers every POST with a canned
          8-token chat-completions stream in one write, asking no upstream: the gateway's
          server half alone (accept, parse, answer), to set beside the relay's per-request
          figure, which carries an upstream connect per request the gateway does not pay

The relay and the proxies are asked the chat-completions request the gateway itself would send
upstream (`upstream_body`), so the stub answers them: their figures are the floor of the extra
hop on the upstream's own protocol, with no translation, no line and no record. In the same
run, with the same load client (testsupport.client) and the same stubs, paired round by round:

  1 throughput   8 concurrent 10,000-token streams (scenario 1's shape): tokens/s and the ratio
                 to the stub asked directly in the same round, and each process's CPU per 1,000
                 tokens (utime + stime of that process alone, from /proc, as bench does)
  2 latency      200 sequential short requests (scenario 2's shape), every target asked in
                 turn in a rotating order: time to first token p50 / p95, what each adds to the
                 direct stub's, and each process's CPU per request over the whole pass

`--callgrind` instead runs each forwarder and the gateway (twistd) under valgrind's callgrind,
one process at a time, for 100 and then 200 short requests: user-space instructions per request
of that process alone, (I(200) - I(100)) / 100, which the machine's load does not move.

The gateway is paired with the direct stub asked bench's own body (`openai_body`), exactly as
`python -m bench` measures it; the forwarders with the stub asked the gateway's upstream body
(`continuous_usage_stats` makes every chunk carry usage: a little more per token for the stub).
Measurements, not tests: nothing fails on a figure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import treq
from klein import Klein
from treq.client import HTTPClient
from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.logger import globalLogBeginner, textFileLogObserver
from twisted.protocols import portforward
from twisted.python.failure import Failure
from twisted.web.client import Agent, HTTPConnectionPool
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET, Request, Site

from bench.scenarios import (
    RESULTS,
    STREAM_TOKENS,
    ProcessStats,
    anthropic_body,
    first_token,
    is_anthropic_token,
    is_openai_token,
    machine,
    openai_body,
    upstream_body,
)
from testsupport.client import percentile, request
from testsupport.processes import (
    TWISTD,
    Process,
    clean_env,
    load_average,
    start_gateway,
    start_stub,
)

REPO = Path(__file__).resolve().parent.parent
KINDS = ("relay", "proxy", "klein", "answer")
FORWARDING = ("relay", "proxy", "klein")  # scenario 1 streams through these only
STREAMS = 8  # scenario 1's concurrent streams

CONFIG = """
[upstreams.fast]
url = "{fast}"
slots = 8

[upstreams.bulk]
url = "{big}"
slots = 8

[models.fast]
upstream = "fast"

[models.bulk]
upstream = "bulk"
"""


# -- the forwarders (run in their own processes) ------------------------------------------------


class QuietClientFactory(portforward.ProxyClientFactory):
    """The relay's factory for each upstream connection, minus the log line Twisted's
    `noisy` factories write when each starts: a log event per request is not the floor."""

    noisy = False


class RelayServer(portforward.ProxyServer):
    clientProtocolFactory = QuietClientFactory


def relay_factory(host: str, port: int) -> portforward.ProxyFactory:
    factory = portforward.ProxyFactory(host, port)
    factory.protocol = RelayServer
    factory.noisy = False
    return factory


class QuietSite(Site):
    """No access log: `Site.log` writes a line per request to Twisted's log otherwise, which
    the floor should not pay (the gateway's record and log line are its own cost)."""

    def log(self, request: Request) -> None:
        pass


class Forwarder:
    """Sends a request on with treq and streams the answer back, piece by piece as treq hands
    them over; shared by the plain resource and the Klein route, so the two differ by Klein."""

    def __init__(self, upstream: str) -> None:
        pool = HTTPConnectionPool(reactor, persistent=True)
        pool.maxPersistentPerHost = 16  # as the gateway sets it: every stream keeps its own
        self.http = HTTPClient(Agent(reactor, pool=pool))
        self.upstream = upstream

    def forward(self, request: Request) -> Deferred[None]:
        """A Deferred that fires once the whole answer is written (not finished)."""

        def respond(response: Any) -> Any:
            request.setResponseCode(response.code)
            for value in response.headers.getRawHeaders(b"content-type", []):
                request.setHeader(b"content-type", value)
            return treq.collect(response, request.write)

        return self.http.post(
            self.upstream + request.uri.decode(),
            data=request.content.read(),  # type: ignore[union-attr]
            headers={b"content-type": [b"application/json"], b"accept": [b"text/event-stream"]},
            unbuffered=True,  # treq would otherwise keep a copy of the body to replay it
        ).addCallback(respond)


def _canned() -> bytes:
    """What a short answer from the stub looks like: 8 content tokens, then `[DONE]`."""
    frames = [
        {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": w}}]}
        for w in ["one ", "two ", "three ", "four ", "five ", "six ", "seven ", "eight"]
    ]
    return b"".join(b"data: " + json.dumps(f).encode() + b"\n\n" for f in frames) + (
        b"data: [DONE]\n\n"
    )


class Answer(Resource):
    isLeaf = True
    canned = _canned()

    def render_POST(self, request: Request) -> bytes:
        request.content.read()  # type: ignore[union-attr]
        request.setHeader(b"content-type", b"text/event-stream")
        return self.canned


class Forward(Resource):
    """The plain proxy: every POST goes on through the `Forwarder`; a client that leaves
    cancels it, and a failure after the first byte cuts the connection, so the load client
    sees it as an error and not as a short stream."""

    isLeaf = True

    def __init__(self, forwarder: Forwarder) -> None:
        super().__init__()
        self.forwarder = forwarder

    def render_POST(self, request: Request) -> Any:
        gone: list[Failure] = []
        answer = self.forwarder.forward(request)

        def left(reason: Failure) -> None:
            gone.append(reason)
            answer.cancel()

        def failed(reason: Failure) -> None:
            if gone:
                return
            if request.startedWriting:
                request.transport.abortConnection()  # type: ignore[union-attr]
                gone.append(reason)
            else:
                request.setResponseCode(502)

        request.notifyFinish().addErrback(left)
        answer.addErrback(failed)
        answer.addCallback(lambda _: None if gone else request.finish())
        return NOT_DONE_YET


def proxy_site(upstream: str, klein: bool) -> Site:
    """A `twisted.web` site forwarding every POST: a plain leaf resource, or a Klein route."""
    forwarder = Forwarder(upstream)
    if not klein:
        return QuietSite(Forward(forwarder))
    app = Klein()

    @app.route("/v1/chat/completions", methods=["POST"])
    def completions(request: Request) -> Any:
        return forwarder.forward(request)  # Klein finishes it, and cancels it on a close

    return QuietSite(app.resource())


def serve(kind: str, upstream_port: int) -> None:
    """Listen on a free loopback port, say which (and the reactor: Twisted's default, epoll on
    Linux, as twistd gives the gateway) on stdout, and forward to the upstream."""
    globalLogBeginner.beginLoggingTo([textFileLogObserver(sys.stdout)])  # errors, if any
    if kind == "relay":
        factory = relay_factory("127.0.0.1", upstream_port)
    elif kind == "answer":
        factory = QuietSite(Answer())
    else:
        factory = proxy_site(f"http://127.0.0.1:{upstream_port}", kind == "klein")
    port = reactor.listenTCP(0, factory, interface="127.0.0.1")  # type: ignore[attr-defined]
    print(f"floor {kind} listening on {port.getHost().port} ({type(reactor).__name__})", flush=True)
    reactor.run()  # type: ignore[attr-defined]


def start_forwarder(
    workdir: Path, kind: str, upstream: str, prefix: tuple[str, ...] = (), timeout: float = 20.0
) -> tuple[Process, str]:
    """`python -m bench.floor --serve KIND` with this checkout's bench on the path (the
    gateway's package from site-packages, as everywhere in bench); `prefix` runs it under
    another program (valgrind)."""
    port = upstream.removesuffix("/v1").rsplit(":", 1)[1]
    process = Process(
        [*prefix, sys.executable, "-m", "bench.floor", "--serve", kind, "--upstream-port", port],
        workdir,
        {**clean_env(), "PYTHONPATH": str(REPO), "PYTHONHASHSEED": "0"},
    )
    match = process.wait_for_line(r"listening on (\d+) \((\w+)\)", timeout)
    assert match.group(2) == "EPollReactor", match.group(0)
    return process, f"http://127.0.0.1:{match.group(1)}"


# -- the load -------------------------------------------------------------------------------------


@dataclass
class Target:
    """One way to the stub: a URL, the body to send it, how its tokens look, the process whose
    CPU is its own (none for the stub asked directly) and the direct target it is paired with."""

    name: str
    url: str
    body: dict[str, Any]
    is_token: Any
    stats: ProcessStats | None = None
    direct: str | None = None
    rates: list[float] = field(default_factory=list)
    cpu_ms: list[float] = field(default_factory=list)
    stub_cpu_ms: list[float] = field(default_factory=list)
    wakeups: list[float] = field(default_factory=list)
    stub_wakeups: list[float] = field(default_factory=list)
    client_cpu_ms: list[float] = field(default_factory=list)
    ttft_ms: list[float] = field(default_factory=list)


async def streams(target: Target, stub: ProcessStats) -> None:
    """One pass of scenario 1's shape; the rate, and CPU (and wake-ups) per 1,000 tokens of
    the target's process, the stub and this load client, each over the pass."""
    before = [target.stats.cpu_seconds() if target.stats else 0.0, stub.cpu_seconds()]
    woken = [target.stats.wakeups() if target.stats else 0, stub.wakeups()]
    client = time.process_time()
    started = time.monotonic()
    results = await asyncio.gather(*(request(target.url, target.body) for _ in range(STREAMS)))
    elapsed = time.monotonic() - started
    errors = [r.error or r.status for r in results if r.error or r.status != 200]
    assert not errors, (target.name, errors)
    tokens = sum(sum(1 for f in r.frames if target.is_token(f)) for r in results)
    target.rates.append(tokens / elapsed)
    if target.stats:
        target.cpu_ms.append(1e6 * (target.stats.cpu_seconds() - before[0]) / tokens)
        target.wakeups.append(1000 * (target.stats.wakeups() - woken[0]) / tokens)
    target.stub_cpu_ms.append(1e6 * (stub.cpu_seconds() - before[1]) / tokens)
    target.stub_wakeups.append(1000 * (stub.wakeups() - woken[1]) / tokens)
    target.client_cpu_ms.append(1e6 * (time.process_time() - client) / tokens)


async def throughput(targets: list[Target], stub: ProcessStats, rounds: int) -> dict[str, Any]:
    """`rounds` rounds, every target once per round, the order rotating so no target always
    follows the same one; each ratio is the median of the rounds' own ratios to the direct
    target of the same round, so a noisy moment hits both sides of a pair."""
    for r in range(rounds):
        for target in targets[r % len(targets) :] + targets[: r % len(targets)]:
            await streams(target, stub)
    by_name = {t.name: t for t in targets}
    out: dict[str, Any] = {"streams": STREAMS, "tokens_per_stream": STREAM_TOKENS, "rounds": rounds}
    for t in targets:
        row: dict[str, Any] = {"tokens_per_s": round(statistics.median(t.rates))}
        if t.direct:
            ratios = [a / b for a, b in zip(t.rates, by_name[t.direct].rates, strict=True)]
            row |= {
                "ratio": round(statistics.median(ratios), 3),
                "ratio_all": [round(x, 2) for x in ratios],
            }
        if t.cpu_ms:
            row |= {
                "cpu_ms_per_1000_tokens": round(statistics.median(t.cpu_ms), 2),
                "cpu_ms_per_1000_tokens_all": [round(x, 1) for x in t.cpu_ms],
                "wakeups_per_1000_tokens": round(statistics.median(t.wakeups)),
            }
        row["stub_cpu_ms_per_1000_tokens"] = round(statistics.median(t.stub_cpu_ms), 2)
        row["stub_wakeups_per_1000_tokens"] = round(statistics.median(t.stub_wakeups))
        row["client_cpu_ms_per_1000_tokens"] = round(statistics.median(t.client_cpu_ms), 2)
        out[t.name] = row
    return out


async def latency(targets: list[Target], n: int) -> dict[str, Any]:
    """`n` rounds of one short request to every target, the order rotating; each process's
    CPU over the whole pass, divided by its `n` requests (what it does after an answer's last
    byte, such as closing, counts too: only its own requests ever reach it)."""
    cpu_before = {t.name: t.stats.cpu_seconds() for t in targets if t.stats}
    woken = {t.name: t.stats.wakeups() for t in targets if t.stats}
    for i in range(n):
        for target in targets[i % len(targets) :] + targets[: i % len(targets)]:
            target.ttft_ms.append(
                1000 * await first_token(target.url, target.body, target.is_token)
            )
    by_name = {t.name: t for t in targets}
    out: dict[str, Any] = {"requests": n}
    for t in targets:
        p50, p95 = percentile(t.ttft_ms, 50), percentile(t.ttft_ms, 95)
        row: dict[str, Any] = {"p50_ms": round(p50, 3), "p95_ms": round(p95, 3)}
        if t.direct:
            direct = by_name[t.direct].ttft_ms
            row["added_p50_ms"] = round(p50 - percentile(direct, 50), 3)
            row["added_p95_ms"] = round(p95 - percentile(direct, 95), 3)
        if t.stats:
            cpu = t.stats.cpu_seconds() - cpu_before[t.name]
            row["cpu_ms_per_request"] = round(1000 * cpu / n, 3)
            row["wakeups_per_request"] = round((t.stats.wakeups() - woken[t.name]) / n, 1)
        out[t.name] = row
    return out


def targets_for(
    stub: str,
    gateway: tuple[str, ProcessStats],
    model: str,
    forwarders: dict[str, tuple[Process, str]],
    tokens: int,
) -> list[Target]:
    """The direct stub twice (bench's body, for the gateway; the gateway's upstream body, for
    the forwarders), the gateway, and every forwarder."""
    path = "/v1/chat/completions"
    stub_url = stub.removesuffix("/v1") + path
    theirs = upstream_body("content-only", tokens, model)
    targets = [
        Target("direct", stub_url, openai_body("content-only", tokens), is_openai_token),
        Target(
            "gateway",
            gateway[0] + "/llm/v1/messages",
            anthropic_body(model, "content-only", tokens),
            is_anthropic_token,
            gateway[1],
            "direct",
        ),
        Target("direct_upstream_body", stub_url, theirs, is_openai_token),
    ]
    for kind, (process, url) in forwarders.items():
        stats = ProcessStats(process.popen.pid)
        direct = None if kind == "answer" else "direct_upstream_body"  # it asks no upstream
        targets.append(Target(kind, url + path, theirs, is_openai_token, stats, direct))
    return targets


def run(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    processes: list[Process] = []
    try:
        fast_stub, fast = start_stub(workdir, "--reasoning-tokens", "0", "--content-tokens", "8")
        big_stub, big = start_stub(workdir, "--reasoning-tokens", "0", "--content-tokens", "40000")
        processes += [fast_stub, big_stub]
        gateway, url = start_gateway(workdir, CONFIG.format(fast=fast, big=big))
        processes.append(gateway)
        gateway_stats = ProcessStats(gateway.popen.pid)
        report: dict[str, Any] = {"machine": machine() | {"load_average_before": load_average()}}

        if args.rounds:
            print("1 throughput ...", file=sys.stderr)
            kinds = [kind for kind in args.kinds if kind in FORWARDING]
            forwarders = {kind: start_forwarder(workdir, kind, big) for kind in kinds}
            processes += [p for p, _ in forwarders.values()]
            targets = targets_for(big, (url, gateway_stats), "bulk", forwarders, STREAM_TOKENS)
            stub_stats = ProcessStats(big_stub.popen.pid)
            report["1_throughput"] = asyncio.run(throughput(targets, stub_stats, args.rounds))

        print("2 latency ...", file=sys.stderr)
        forwarders = {kind: start_forwarder(workdir, kind, fast) for kind in args.kinds}
        processes += [p for p, _ in forwarders.values()]
        targets = targets_for(fast, (url, gateway_stats), "fast", forwarders, 8)
        report["2_latency"] = asyncio.run(latency(targets, args.latency_requests))
        report["machine"]["load_average_after"] = load_average()
        return report
    finally:
        for process in processes:
            process.stop()


ONE = (  # scenario 1's columns: heading, key, width
    ("tokens/s", "tokens_per_s", 9),
    ("ratio", "ratio", 6),
    ("own CPU ms/1k", "cpu_ms_per_1000_tokens", 14),
    ("wakeups/1k", "wakeups_per_1000_tokens", 11),
    ("stub ms/1k", "stub_cpu_ms_per_1000_tokens", 11),
    ("stub wakeups/1k", "stub_wakeups_per_1000_tokens", 16),
    ("client ms/1k", "client_cpu_ms_per_1000_tokens", 13),
)
TWO = (
    ("p50", "p50_ms", 7),
    ("p95", "p95_ms", 7),
    ("added p50", "added_p50_ms", 10),
    ("added p95", "added_p95_ms", 10),
    ("own CPU ms/req", "cpu_ms_per_request", 15),
    ("wakeups/req", "wakeups_per_request", 12),
)


def rows(figures: dict[str, Any], columns: tuple[tuple[str, str, int], ...]) -> list[str]:
    """A heading and one line per target (the dict-valued entries), blank where a target has
    no such figure (the direct stub has no process of its own to measure)."""
    lines = ["  " + f"{'target':22}" + "".join(f" {h:>{w}}" for h, _, w in columns)]
    for name, row in figures.items():
        if isinstance(row, dict):
            cells = "".join(f" {row.get(key, ''):>{w}}" for _, key, w in columns)
            lines.append(f"  {name:22}{cells}")
    return lines


def table(report: dict[str, Any]) -> str:
    """One line per target and scenario: the figures issue 16's targets are measured by."""
    lines = [f"machine: {report['machine']}"]
    if one := report.get("1_throughput"):
        lines.append(
            f"1 throughput: {one['streams']} x {one['tokens_per_stream']:,} tokens, "
            f"{one['rounds']} rounds (medians; ratio: to the direct row it is paired with, "
            "the same round)"
        )
        lines += rows(one, ONE)
    two = report["2_latency"]
    lines.append(f"2 latency: {two['requests']} short requests each, time to first token in ms")
    return "\n".join(lines + rows(two, TWO))


# -- instructions per request (--callgrind) ------------------------------------------------------

WARM_UP = 10  # short requests before the counted ones: imports, the connection pool


def instructions(workdir: Path, kind: str, stub: str, n: int) -> int:
    """User-space instructions of one process (a forwarder, or the gateway under twistd) over
    `WARM_UP + n` short requests, start-up and shut-down included: callgrind's total."""
    out = workdir / f"callgrind.{kind}.{n}"
    prefix = ("valgrind", "--tool=callgrind", f"--callgrind-out-file={out}")
    if kind == "gateway":
        (workdir / "callgrind.toml").write_text(CONFIG.format(fast=stub, big=stub))
        args = [*prefix, sys.executable, TWISTD, "--nodaemon", "--pidfile=", "homelab-gateway"]
        args += ["--config", str(workdir / "callgrind.toml")]
        args += ["--listen", "tcp:0:interface=127.0.0.1"]
        process = Process(args, workdir, {**clean_env(), "PYTHONHASHSEED": "0"})
        line = process.wait_for_line(r"listening on .*?(http://127\.0\.0\.1:\d+)", 300)
        url = line.group(1) + "/llm/v1/messages"
        body, is_token = anthropic_body("fast", "content-only", 8), is_anthropic_token
    else:
        process, base = start_forwarder(workdir, kind, stub, prefix, 300)
        url = base + "/v1/chat/completions"
        body, is_token = upstream_body("content-only", 8), is_openai_token

    async def ask() -> None:
        for _ in range(WARM_UP + n):
            await first_token(url, body, is_token)

    try:
        asyncio.run(ask())
    finally:
        process.stop(300)
    for line in out.read_text().splitlines():
        if line.startswith(("totals:", "summary:")):
            return int(line.split()[1])
    raise ValueError(f"no totals in {out}")


def run_callgrind(kinds: list[str], workdir: Path) -> dict[str, Any]:
    """Instructions per short request of each process alone, free of the machine's load:
    (I(200) - I(100)) / 100, so start-up, warm-up and shut-down cancel (PYTHONHASHSEED=0).
    Kernel work (accept, connect, send, close) is not in it: callgrind counts user space."""
    stub_process, stub = start_stub(workdir, "--reasoning-tokens", "0", "--content-tokens", "8")
    out: dict[str, Any] = {}
    try:
        for kind in kinds:
            print(f"callgrind {kind} ...", file=sys.stderr)
            low, high = (instructions(workdir, kind, stub, n) for n in (100, 200))
            out[kind] = {"instructions_per_request_m": round((high - low) / 100 / 1e6, 3)}
    finally:
        stub_process.stop()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="scenario 1 rounds (0: skip it)")
    parser.add_argument("--latency-requests", type=int, default=200)
    parser.add_argument(
        "--kinds", nargs="+", choices=KINDS, default=list(KINDS), help="forwarders to run"
    )
    parser.add_argument(
        "--callgrind",
        action="store_true",
        help="instead: instructions per short request of each forwarder and the gateway",
    )
    parser.add_argument("--serve", choices=KINDS, help=argparse.SUPPRESS)
    parser.add_argument("--upstream-port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.upstream_port)
        return
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    RESULTS.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory() as workdir:
        if args.callgrind:
            counts = run_callgrind([*args.kinds, "gateway"], Path(workdir))
            print(json.dumps(counts, indent=2))
            (RESULTS / f"floor-callgrind-{stamp}.json").write_text(json.dumps(counts, indent=2))
            print(f"results: bench/results/floor-callgrind-{stamp}.json")
            return
        report = run(args, Path(workdir))
    print(table(report))
    (RESULTS / f"floor-{stamp}.json").write_text(json.dumps(report, indent=2))
    print(f"results: bench/results/floor-{stamp}.json")


if __name__ == "__main__":
    main()
