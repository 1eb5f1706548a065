"""The scenarios of `python -m bench` (bench/__main__.py runs them), and what the other
benches build on: the stub and gateway configs, the request bodies, the streaming clients and
the gateway process's CPU and RSS."""

from __future__ import annotations

import asyncio
import os
import pstats
import random
import re
import statistics
import sys
import time
import urllib.request
from datetime import datetime, timedelta
from io import StringIO
from pathlib import Path
from typing import Any

from testsupport.client import Frame, Result, get_json, percentile, request
from testsupport.processes import Process, start_gateway, start_stub

RESULTS = Path(__file__).resolve().parent / "results"
TICKS = os.sysconf("SC_CLK_TCK")
STREAM_TOKENS = 10_000  # per stream in scenario 1: short streams are too noisy on 2 cores


def config(fast: str, big: str, paced: str) -> str:
    return f"""
[upstreams.fast]
url = "{fast}"
slots = 8

[upstreams.queue]
url = "{fast}"
slots = 2
queue_limit = 10000

[upstreams.big]
url = "{big}"
slots = 1

[upstreams.bulk]
url = "{big}"
slots = 8

[upstreams.paced]
url = "{paced}"
slots = 200

[models.fast]
upstream = "fast"

[models.queue]
upstream = "queue"

[models.big]
upstream = "big"

[models.bulk]
upstream = "bulk"

[models.paced]
upstream = "paced"
"""


class ProcessStats:
    """RSS and CPU time of a process, from /proc."""

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def rss_kb(self) -> int:
        return self._status("VmRSS")

    def _status(self, key: str) -> int:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
        raise KeyError(key)

    def wakeups(self) -> int:
        """Voluntary context switches: how often it blocked (a reactor waiting in epoll) and
        was woken again. Per token, a count of the reads and sends its CPU goes to."""
        return self._status("voluntary_ctxt_switches")

    def cpu_seconds(self) -> float:
        fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / TICKS  # utime + stime


def anthropic_body(model: str, prompt: str, max_tokens: int = 4000, **extra: Any) -> dict[str, Any]:
    return {
        "model": model,
        "max_tokens": max_tokens,
        "stream": True,
        "messages": [{"role": "user", "content": prompt}],
        **extra,
    }


def openai_body(prompt: str, max_tokens: int = 4000) -> dict[str, Any]:
    return {
        "model": "stub",
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content": prompt}],
    }


def upstream_body(prompt: str, max_tokens: int, model: str = "fast") -> dict[str, Any]:
    """The chat-completions body the gateway sends upstream for a streamed message (mapping.py,
    `continuous_usage_stats` on, the default): what `bench.inproc --direct` and `bench.floor`'s
    relay and minimal proxy ask, so they are measured on the upstream's own request."""
    return {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }


def is_openai_token(frame: Frame) -> bool:
    data = frame.data
    if not isinstance(data, dict) or not data.get("choices"):
        return False
    delta = data["choices"][0].get("delta") or {}
    return bool(delta.get("content") or delta.get("reasoning") or delta.get("tool_calls"))


def is_anthropic_token(frame: Frame) -> bool:
    return frame.event == "content_block_delta"


# -- 1. throughput ------------------------------------------------------------------------------


async def streams_rate(
    url: str, body: dict[str, Any], count: int, is_token: Any
) -> tuple[float, int]:
    started = time.monotonic()
    results = await asyncio.gather(*(request(url, body) for _ in range(count)))
    elapsed = time.monotonic() - started
    errors = [r.error or r.status for r in results if r.error or r.status != 200]
    assert not errors, errors
    tokens = sum(sum(1 for f in r.frames if is_token(f)) for r in results)
    return tokens / elapsed, tokens


async def throughput(
    direct: str | None,
    gateway: str,
    model: str,
    rounds: int,
    stats: ProcessStats | None = None,
    tokens: int = STREAM_TOKENS,
) -> dict[str, Any]:
    """Paired rounds: the stub directly, then through the gateway, `rounds` times; the ratio is
    the median of the rounds' own ratios, so a noisy moment hits both sides of one pair."""
    direct_rates, gateway_rates, cpu_ms = [], [], []
    counted = 0
    for _ in range(rounds):
        if direct is not None:
            rate, _ = await streams_rate(
                direct + "/chat/completions",
                openai_body("content-only", tokens),
                8,
                is_openai_token,
            )
            direct_rates.append(rate)
        cpu = stats.cpu_seconds() if stats else 0.0
        rate, counted = await streams_rate(
            gateway + "/v1/messages",
            anthropic_body(model, "content-only", tokens),
            8,
            is_anthropic_token,
        )
        if stats:
            cpu_ms.append(1e6 * (stats.cpu_seconds() - cpu) / counted)
        gateway_rates.append(rate)
    out: dict[str, Any] = {
        "streams": 8,
        "tokens_per_round": counted,
        "rounds": rounds,
        "gateway_tokens_per_s": round(statistics.median(gateway_rates)),
        "gateway_all": [round(r) for r in gateway_rates],
    }
    if cpu_ms:
        out["gateway_cpu_ms_per_1000_tokens"] = round(statistics.median(cpu_ms), 2)
        out["gateway_cpu_ms_per_1000_tokens_all"] = [round(c, 2) for c in cpu_ms]
    if direct_rates:
        ratios = [g / d for g, d in zip(gateway_rates, direct_rates, strict=True)]
        out["direct_tokens_per_s"] = round(statistics.median(direct_rates))
        out["direct_all"] = [round(r) for r in direct_rates]
        out["ratio"] = round(statistics.median(ratios), 2)
        out["ratio_all"] = [round(r, 2) for r in ratios]
    return out


# -- 2. latency ---------------------------------------------------------------------------------


async def first_token(url: str, body: dict[str, Any], is_token: Any) -> float:
    """Seconds to the first token of a short answer read to its end, as a client would (so
    the gateway keeps its upstream connection for the next request)."""
    result = await request(url, body)
    frame = result.first(is_token)
    assert frame is not None and result.error is None, (
        result.status,
        result.error,
        result.events[:5],
    )
    return frame.at - result.sent


async def latency(
    direct: str | None, gateway: str, model: str, n: int, stats: ProcessStats | None = None
) -> dict[str, Any]:
    direct_ms, gateway_ms = [], []
    cpu_seconds = 0.0
    for _ in range(n):
        if direct is not None:
            direct_ms.append(
                1000
                * await first_token(
                    direct + "/chat/completions", openai_body("content-only", 8), is_openai_token
                )
            )
        cpu = stats.cpu_seconds() if stats else 0.0
        gateway_ms.append(
            1000
            * await first_token(
                gateway + "/v1/messages",
                anthropic_body(model, "content-only", 8),
                is_anthropic_token,
            )
        )
        cpu_seconds += stats.cpu_seconds() - cpu if stats else 0.0
    out: dict[str, Any] = {
        "requests": n,
        **({"gateway_cpu_ms_per_request": round(1000 * cpu_seconds / n, 3)} if stats else {}),
        "gateway_p50_ms": round(percentile(gateway_ms, 50), 2),
        "gateway_p95_ms": round(percentile(gateway_ms, 95), 2),
    }
    if direct_ms:
        out["direct_p50_ms"] = round(percentile(direct_ms, 50), 2)
        out["direct_p95_ms"] = round(percentile(direct_ms, 95), 2)
        out["added_p50_ms"] = round(out["gateway_p50_ms"] - out["direct_p50_ms"], 2)
        out["added_p95_ms"] = round(out["gateway_p95_ms"] - out["direct_p95_ms"], 2)
    return out


# -- 3. queue scale -----------------------------------------------------------------------------


async def queue_scale(gateway: str, stats: ProcessStats, n: int) -> dict[str, Any]:
    """Two blockers hold both slots; n waiters join one at a time (so arrival order is known),
    all wait at once; the blockers leave and the line drains."""
    url = gateway + "/llm/v1/messages"
    release = asyncio.Event()
    blockers = [
        asyncio.create_task(
            request(url, anthropic_body("queue", "stall"), cut=lambda r: release.is_set())
        )
        for _ in range(2)
    ]
    await wait_status(gateway, "queue", lambda s: s["in_use"] == 2)
    rss_before, cpu_before = stats.rss_kb(), stats.cpu_seconds()
    admitted = [asyncio.Event() for _ in range(n)]
    results: list[Result | None] = [None] * n

    def on_frame(i: int) -> Any:
        return lambda result, frame: admitted[i].set()

    async def waiter(i: int) -> None:
        results[i] = await request(
            url, anthropic_body("queue", "content-only", 16), on_frame=on_frame(i)
        )
        admitted[i].set()

    tasks = []
    for i in range(n):
        tasks.append(asyncio.create_task(waiter(i)))
        await admitted[i].wait()
    rss_waiting = stats.rss_kb()
    released_at = time.monotonic()
    release.set()
    for blocker in blockers:  # the blockers' stalled streams send nothing more: close them
        blocker.cancel()
    await asyncio.gather(*blockers, return_exceptions=True)
    await asyncio.gather(*tasks)
    drained = time.monotonic() - released_at
    await wait_status(gateway, "queue", lambda s: s["in_use"] == 0 and s["waiting"] == 0)
    cpu = stats.cpu_seconds() - cpu_before

    done = [r for r in results if r is not None]
    failures = [
        r.error or r.status
        for r in done
        if r.error or r.status != 200 or r.events[-1:] != ["message_stop"]
    ]
    starts = [r.first(lambda f: f.event == "message_start").at for r in done]
    queue_frames = [[f for f in r.frames if f.event == "queue"] for r in done]
    positions = [[f.data["position"] for f in frames] for frames in queue_frames]
    initial_ok = all(p and p[0] == i + 1 for i, p in enumerate(positions))
    monotonic = all(p == sorted(p, reverse=True) for p in positions)
    reach_one = all(p and p[-1] == 1 for p in positions)
    # With 2 slots, k + 2 must not start before k. Starts are seen at the client, so two
    # upstream answers racing by a hair can look swapped: report how much, not just whether.
    inversions = [starts[i] - starts[i + 2] for i in range(n - 2) if starts[i] > starts[i + 2]]
    return {
        "waiters": n,
        "slots": 2,
        "completed": len(done) - len(failures),
        "failures": failures[:5],
        "fifo_initial_positions_exact": initial_ok,
        "positions_only_go_down": monotonic,
        "positions_reach_1": reach_one,
        "start_order_inversions": len(inversions),
        "worst_inversion_ms": round(1000 * max(inversions), 2) if inversions else 0,
        "drain_seconds": round(drained, 1),
        "rss_kb_idle": rss_before,
        "rss_kb_all_waiting": rss_waiting,
        "rss_per_waiting_stream_kb": round((rss_waiting - rss_before) / n, 2),
        "gateway_cpu_ms_per_request": round(1000 * cpu / n, 3),
        "queue_frames_per_waiter": round(sum(len(f) for f in queue_frames) / n, 2),
        "worst_position_staleness_s": round(worst_staleness(queue_frames, starts, released_at), 3),
    }


def worst_staleness(
    queue_frames: list[list[Frame]], starts: list[float], released_at: float
) -> float:
    """How long a reported position went on being higher than the truth, at worst.

    Waiter k's true position at time t is 1 + (waiters ahead of it not started by t). Its
    report p became stale when the (k + 1 - p)-th start ahead happened; it stayed stale until
    the next report (or its own start). Start times are when each message_start arrived.
    """
    ahead_sorted = sorted(starts)
    worst = 0.0
    order = sorted(range(len(starts)), key=lambda i: starts[i])
    rank = {i: r for r, i in enumerate(order)}
    for k, frames in enumerate(queue_frames):
        reports = [(max(f.at, released_at), f.data["position"]) for f in frames]
        ends = [t for t, _ in reports[1:]] + [starts[k]]
        mine = rank[k]
        for (at, position), until in zip(reports, ends, strict=True):
            needed = mine + 1 - position  # starts before this report is stale
            if needed < 0 or needed >= len(ahead_sorted):
                continue
            stale_from = max(ahead_sorted[needed], at)
            worst = max(worst, until - stale_from)
    return worst


async def wait_status(gateway: str, upstream: str, condition: Any, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition(get_json(gateway + "/llm/v1/status")["upstreams"][upstream]):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{upstream} status never matched")
        await asyncio.sleep(0.02)


# -- 6. fair share ------------------------------------------------------------------------------

FAIR_KEYS = {"BENCH_A": "a-key", "BENCH_B": "b-key", "BENCH_CHAT": "chat-key", "BENCH_FIFO": "f"}


def fair_config(paced: str) -> str:
    return f"""
[upstreams.fair]
url = "{paced}"
slots = 2
queue_limit = 1000

[models.fair]
upstream = "fair"

[clients.flood-a]
key_env = "BENCH_A"

[clients.flood-b]
key_env = "BENCH_B"

[clients.chat]
key_env = "BENCH_CHAT"
priority = "interactive"

[clients.fifo]
key_env = "BENCH_FIFO"
"""


def jain(values: list[float]) -> float:
    """Jain's fairness index: 1 when all get the same, 1/n when one gets everything."""
    total = sum(values)
    squares = sum(v * v for v in values)
    return total * total / (len(values) * squares) if squares else float("nan")


def slot_seconds(gateway: str) -> dict[str, float]:
    """The gateway's own measure, homelab_gateway_client_slot_seconds_total, per client."""
    with urllib.request.urlopen(gateway + "/metrics", timeout=10) as response:
        text = response.read().decode()
    found: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("homelab_gateway_client_slot_seconds_total{"):
            client = re.search(r'client="([^"]*)"', line)
            if client is not None:
                found[client.group(1)] = float(line.rsplit(" ", 1)[1])
    return found


def upstream_seconds(stub_log: Path, since: datetime, until: datetime) -> dict[str, float]:
    """Seconds the upstream spent on each tag's requests (metadata.user_id) between `since` and
    `until`, from the stub's log: the GPU time a client got while both were flooding (the
    backlog that drains after the window would otherwise favour the longer requests)."""
    started: dict[str, tuple[str, datetime]] = {}
    spent: dict[str, float] = {}
    for line in stub_log.read_text().splitlines():
        stamp, event, *fields = line.split()
        values = dict(field.split("=", 1) for field in fields if "=" in field)
        at = datetime.fromisoformat(stamp)
        if event == "start":
            started[values["id"]] = (values.get("user", ""), at)
        elif values.get("id") in started:
            user, began = started.pop(values["id"])
            inside = (min(at, until) - max(began, since)).total_seconds()
            spent[user] = spent.get(user, 0.0) + max(0.0, inside)
    return spent


async def fair_share(gateway: str, stub_log: Path, seconds: float) -> dict[str, Any]:
    """The same load twice: as three named clients (the fair line), then all under one key (one
    client, one class: FIFO). A client's share is the upstream time its requests took."""
    url = gateway + "/llm/v1/messages"

    async def phase(name: str, keys: dict[str, str]) -> dict[str, Any]:
        since = datetime.now()
        stop = time.monotonic() + seconds
        waits: list[float] = []
        held: dict[str, float] = {}

        async def sample_slot_time() -> None:
            before = await asyncio.to_thread(slot_seconds, gateway)
            await asyncio.sleep(seconds)
            after = await asyncio.to_thread(slot_seconds, gateway)
            held.update({k: v - before.get(k, 0.0) for k, v in after.items()})

        async def flood(client: str, max_tokens: int) -> None:
            while time.monotonic() < stop:
                body = anthropic_body(
                    "fair", "content-only", max_tokens, metadata={"user_id": f"{name}-{client}"}
                )
                await request(url, body, headers={"x-api-key": keys[client]})

        async def chat() -> None:
            while time.monotonic() < stop:
                body = anthropic_body("fair", "content-only", 8)
                result = await request(url, body, headers={"x-api-key": keys["chat"]})
                start = result.first(lambda f: f.event == "message_start")
                if start is not None:
                    waits.append(start.at - result.sent)
                await asyncio.sleep(0.5)

        await asyncio.gather(
            *(flood("a", 40) for _ in range(8)),
            *(flood("b", 10) for _ in range(8)),
            chat(),
            sample_slot_time(),
        )
        spent = upstream_seconds(stub_log, since, since + timedelta(seconds=seconds))
        a, b = spent.get(f"{name}-a", 0.0), spent.get(f"{name}-b", 0.0)
        slot_a, slot_b = held.get("flood-a", 0.0), held.get("flood-b", 0.0)
        gateway_view = (
            {
                "slot_s_a_b": f"{slot_a:.1f} / {slot_b:.1f}",
                "slot_share_a": round(slot_a / (slot_a + slot_b), 3),
                "slot_jain": round(jain([slot_a, slot_b]), 4),
            }
            if slot_a + slot_b
            else {}  # one key for everyone: the gateway cannot tell the floods apart
        )
        return {
            **gateway_view,
            "upstream_s_a_b": f"{a:.1f} / {b:.1f}",
            "upstream_share_a": round(a / (a + b), 3),
            "upstream_jain": round(jain([a, b]), 4),
            "interactive_wait_p50_s": round(percentile(waits, 50), 3),
            "interactive_wait_p95_s": round(percentile(waits, 95), 3),
            "interactive_requests": len(waits),
        }

    fair = await phase("fair", {"a": "a-key", "b": "b-key", "chat": "chat-key"})
    fifo = await phase("fifo", {"a": "f", "b": "f", "chat": "f"})
    return {"seconds_each": seconds, **{f"fair_{k}": v for k, v in fair.items()}} | {
        f"fifo_{k}": v for k, v in fifo.items()
    }


# -- 4. cancellation ----------------------------------------------------------------------------


async def cancellation(gateway: str, stub_log: Path, n: int, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    closed: dict[str, float] = {}
    semaphore = asyncio.Semaphore(10)

    async def one(i: int) -> None:
        tag = f"cut-{i}"
        after = rng.uniform(0.02, 0.5)

        def cut(result: Result) -> bool:
            if time.monotonic() - result.sent >= after:
                closed[tag] = time.time()
                return True
            return False

        async with semaphore:
            await request(
                gateway + "/llm/v1/messages",
                anthropic_body("paced", "long", metadata={"user_id": tag}),
                cut=cut,
            )

    await asyncio.gather(*(one(i) for i in range(n)))
    await wait_status(gateway, "paced", lambda s: s["in_use"] == 0)
    await asyncio.sleep(0.2)
    tags, cancelled = {}, {}
    for line in stub_log.read_text().splitlines():
        stamp, event, rest = line.split(" ", 2)
        fields = dict(part.split("=", 1) for part in rest.split())
        if event == "start" and "user" in fields:
            tags[fields["id"]] = fields["user"]
        elif event == "cancelled":
            cancelled[fields["id"]] = datetime.fromisoformat(stamp).timestamp()
    latencies = [
        1000 * (cancelled[i] - closed[tags[i]]) for i in cancelled if tags.get(i) in closed
    ]
    status = get_json(gateway + "/llm/v1/status")["upstreams"]["paced"]
    return {
        "streams": n,
        "cancelled_seen_by_stub": len(latencies),
        "p50_ms": round(percentile(latencies, 50), 1),
        "p95_ms": round(percentile(latencies, 95), 1),
        "max_ms": round(max(latencies), 1) if latencies else None,
        "slots_in_use_after": status["in_use"],
        "waiting_after": status["waiting"],
    }


# -- 5. slow reader -----------------------------------------------------------------------------


async def slow_reader(
    gateway: str, big_stub: str, stats: ProcessStats, seconds: float
) -> dict[str, Any]:
    samples: list[int] = []
    done = asyncio.Event()

    async def sample() -> None:
        while not done.is_set():
            samples.append(stats.rss_kb())
            await asyncio.sleep(1.0)

    sampler = asyncio.create_task(sample())
    result = await request(
        gateway + "/llm/v1/messages",
        anthropic_body("big", "content-only", 100_000),
        read_delay=1.0,
        read_size=1024,
        cut=lambda r: time.monotonic() - r.sent > seconds,
    )
    done.set()
    await sampler
    stub = get_json(big_stub.removesuffix("/v1") + "/stub/status")
    return {
        "seconds": seconds,
        "client_read_kb": round(result.bytes_read / 1024, 1),
        "stream_size_mb": "about 10 (40,000 tokens)",
        "rss_kb_first": samples[0],
        "rss_kb_max": max(samples),
        "rss_kb_growth": max(samples) - samples[0],
        "upstream_paused_by_backpressure": stub["paused"],
        "upstream_completed": stub["completed"],
        "kernel_tcp_buffers": kernel_buffers(),
    }


def kernel_buffers() -> str:
    """Loopback sockets' autotuned buffers hold several MB each way: a stream smaller than
    that can be produced in full while every user-space buffer stays small."""
    sizes = []
    for name in ("tcp_rmem", "tcp_wmem"):
        path = Path(f"/proc/sys/net/ipv4/{name}")
        if path.exists():
            sizes.append(f"{name} max {int(path.read_text().split()[2]) // 2**20} MiB")
    return ", ".join(sizes) or "unknown"


# -- running it all -----------------------------------------------------------------------------


def profile_pass(workdir: Path, gateway_config: str, big: str) -> str:
    """Scenario 1 once more with the gateway under cProfile; the top of the profile as text."""
    path = workdir / "gateway.prof"
    gateway, url = start_gateway(
        workdir, gateway_config, env={"HOMELAB_GATEWAY_PROFILE": str(path)}
    )
    try:
        asyncio.run(throughput(big, url + "/llm", "bulk", 2))
    finally:
        gateway.stop()
    out = StringIO()
    stats = pstats.Stats(str(path), stream=out)
    stats.sort_stats("tottime").print_stats(25)
    return out.getvalue()


def run_fair_share(workdir: Path, processes: list[Process], seconds: float) -> dict[str, Any]:
    """Scenario 6 on a gateway of its own: its named clients make keys required."""
    print("7 fair share ...", file=sys.stderr)
    log = workdir / "fair.log"
    stub, paced = start_stub(
        workdir,
        *("--reasoning-tokens", "0", "--content-tokens", "40", "--delay", "0.01"),
        *("--log", str(log)),
    )
    processes.append(stub)
    gateway, url = start_gateway(workdir, fair_config(paced), env=FAIR_KEYS)
    processes.append(gateway)
    return asyncio.run(fair_share(url, log, seconds))


# -- 8. replicas ----------------------------------------------------------------------------------

REPLICA_SLOTS = 4
REPLICA_TOKENS = 200  # per stream: 2 s at the paced stub's 100 tokens/s, like a GPU's stream


def replicas_config(first: str, second: str) -> str:
    """Model `one` on one replica, `two` on two (the first the same stub): the same slots per
    box, so the difference is the second box."""
    return f"""
[upstreams.solo]
url = "{first}"
slots = {REPLICA_SLOTS}

[upstreams.left]
url = "{first}"
slots = {REPLICA_SLOTS}

[upstreams.right]
url = "{second}"
slots = {REPLICA_SLOTS}

[models.one]
upstreams = ["solo"]

[models.two]
upstreams = ["left", "right"]
"""


async def replicas(gateway: str, stubs: list[str], streams: int, rounds: int) -> dict[str, Any]:
    """`streams` concurrent streams (more than one replica's slots) for model `one`, then for
    `two`, `rounds` times; the speed-up is the median of the rounds' own ratios. The stubs are
    paced (a token every 10 ms), so the figure is the line spreading over boxes, not the
    stub's CPU on a shared 2-core machine."""
    rates: dict[str, list[float]] = {"one": [], "two": []}
    per_s: dict[str, list[float]] = {"one": [], "two": []}
    split: list[int] = []
    for _ in range(rounds):
        for model in ("one", "two"):
            before = [get_json(stub + "/stub/status")["requests"] for stub in stubs]
            rate, tokens = await streams_rate(
                gateway + "/llm/v1/messages",
                anthropic_body(model, "content-only"),
                streams,
                is_anthropic_token,
            )
            after = [get_json(stub + "/stub/status")["requests"] for stub in stubs]
            rates[model].append(rate)
            per_s[model].append(streams * rate / tokens)
            if model == "two":
                split = [a - b for a, b in zip(after, before, strict=True)]
    ratios = [t / o for t, o in zip(rates["two"], rates["one"], strict=True)]
    return {
        "streams": streams,
        "slots_per_replica": REPLICA_SLOTS,
        "tokens_per_stream": REPLICA_TOKENS,
        "rounds": rounds,
        "one_replica_tokens_per_s": round(statistics.median(rates["one"])),
        "one_replica_requests_per_s": round(statistics.median(per_s["one"]), 2),
        "two_replicas_tokens_per_s": round(statistics.median(rates["two"])),
        "two_replicas_requests_per_s": round(statistics.median(per_s["two"]), 2),
        "speedup": round(statistics.median(ratios), 2),
        "speedup_all": [round(r, 2) for r in ratios],
        "two_replicas_split_last_round": split,
    }


def run_replicas(
    workdir: Path, processes: list[Process], streams: int, rounds: int
) -> dict[str, Any]:
    """Scenario 8 on a gateway and two paced stubs of its own."""
    print("8 replicas ...", file=sys.stderr)
    paced = ("--reasoning-tokens", "0", "--content-tokens", str(REPLICA_TOKENS), "--delay", "0.01")
    urls = []
    for _ in range(2):
        stub, stub_url = start_stub(workdir, *paced)
        processes.append(stub)
        urls.append(stub_url)
    (workdir / "replicas").mkdir(exist_ok=True)
    gateway, url = start_gateway(workdir / "replicas", replicas_config(*urls))
    processes.append(gateway)
    stubs = [u.removesuffix("/v1") for u in urls]
    return asyncio.run(replicas(url, stubs, streams, rounds))


def machine() -> dict[str, Any]:
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        "unknown",
    )
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": sys.version.split()[0],
        "date": datetime.now().isoformat(timespec="seconds"),
    }


def table(report: dict[str, Any]) -> str:
    lines = []
    for name, figures in report.items():
        if isinstance(figures, dict):
            lines.append(f"{name}")
            lines += [f"  {key:34} {value}" for key, value in figures.items()]
    return "\n".join(lines)
