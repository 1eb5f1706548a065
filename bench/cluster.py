"""The cost of the shared line (issue 14): gateways whose slots and line live in Redis.

`python -m bench.cluster` starts a redis-server (Debian's, as the tests do, on a free loopback
port, no persistence), the stubs and the gateways as real twistd processes, and prints in one
run, side by side:

1 latency       200 short streaming requests (scenario 2), each asked in turn of the stub
                directly, of a gateway with everything in process and of one with [cluster] on
                the Redis: time to first token p50 / p95, what each gateway adds, the gateway's
                CPU per request (/proc of the gateway process alone, over the whole pass), and
                Redis's CPU and round trips per request.
2 shared burst  two fresh gateways with [cluster] on that Redis, one stub with 2 slots behind
                both: two blockers take both slots, then 2,500 clients connect at once to each
                gateway; once all 5,000 are in the shared line the blockers leave and it drains.
                The stub's peak concurrency (its own `max_in_flight`), completions, global
                positions and dispatch order, Redis round trips per slot (`INFO commandstats`
                before and after: commands Lua runs inside a script are not round trips),
                queue frames per waiter and per second of waiting, KB per waiter and CPU per
                request of both gateways and of Redis.
3 in process    the same burst on one gateway with no [cluster] (scenario 6, `bench.burst`), to
                compare (`--no-baseline` skips it).

Measurements, not tests: nothing fails on a figure. The gateways' logs are kept in the results
directory when anything in the shared burst went wrong (an error, a peak above 2, a request that
did not complete).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from bench import burst
from bench.scenarios import (
    RESULTS,
    ProcessStats,
    anthropic_body,
    first_token,
    is_anthropic_token,
    is_openai_token,
    machine,
    openai_body,
    table,
)
from testsupport.client import Result, get_json, percentile, request
from testsupport.processes import Process, linked, load_average, start_gateway, start_stub
from testsupport.redis_server import RedisServer

SLOTS = 2

LATENCY_CONFIG = """
[upstreams.fast]
url = "{stub}"
slots = 8

[models.fast]
upstream = "fast"
"""

CLUSTER = """
[cluster]
redis_url = "{redis}"
instance = "{instance}"
lease = 10
"""

# Commands that Redis counts in commandstats but that only the Lua scripts (scripts.py) run:
# they cost no round trip. Everything else a gateway sends is one.
IN_SCRIPTS = frozenset(
    {"time", "incr", "xadd", "hset", "hdel", "hget", "hlen", "hexists", "hkeys", "hgetall"}
    | {"exists", "xrevrange", "get"}
)


class Redis:
    """The bench's view of the Redis: its command counters and its process's CPU."""

    def __init__(self, server: RedisServer) -> None:
        self.server = server
        assert server.popen is not None
        self.stats = ProcessStats(server.popen.pid)

    def info(self, section: str) -> list[str]:
        """The lines of one `INFO` section, over a raw connection of its own."""
        with socket.create_connection(("127.0.0.1", self.server.port), timeout=10) as s:
            s.sendall(f"INFO {section}\r\n".encode())
            reply = s.makefile("rb")
            size = int(reply.readline()[1:])
            return reply.read(size).decode().splitlines()

    def commands(self) -> dict[str, tuple[int, int]]:
        """`INFO commandstats`: calls and microseconds per command (these queries excluded)."""
        counts = {}
        for line in self.info("commandstats"):
            if line.startswith("cmdstat_"):
                name, _, fields = line.removeprefix("cmdstat_").partition(":")
                values = dict(f.split("=") for f in fields.split(","))
                counts[name] = (int(values["calls"]), int(values["usec"]))
        counts.pop("info", None)
        return counts

    def used_kb(self) -> float:
        """The memory Redis's data takes (`used_memory`), in KB."""
        line = next(x for x in self.info("memory") if x.startswith("used_memory:"))
        return int(line.split(":")[1]) / 1024


def command_figures(
    before: dict[str, tuple[int, int]], after: dict[str, tuple[int, int]], per: int
) -> dict[str, Any]:
    """Round trips (commands the gateways sent) and the work inside scripts, per `per`."""
    calls = {
        name: after[name][0] - before.get(name, (0, 0))[0]
        for name in after
        if after[name][0] > before.get(name, (0, 0))[0]
    }
    sent = {name: n for name, n in calls.items() if name not in IN_SCRIPTS}
    usec = sum(after[name][1] - before.get(name, (0, 0))[1] for name in sent)  # scripts included
    return {
        "commands_with_those_in_scripts": round(sum(calls.values()) / per, 2),
        "round_trips": round(sum(sent.values()) / per, 2),
        "round_trips_by_command": {name: round(n / per, 2) for name, n in sorted(sent.items())},
        "script_runs": round(calls.get("time", 0) / per, 2),  # each script asks Redis's TIME once
        "events_appended": round(calls.get("xadd", 0) / per, 2),
        "command_usec": round(usec / per, 1),
    }


def cluster_gateway(
    workdir: Path, name: str, config: str, redis: RedisServer
) -> tuple[Process, str]:
    """A gateway with [cluster] as `name`, in a directory of its own, linked before it returns."""
    home = workdir / name
    home.mkdir()
    process, url = start_gateway(home, config + CLUSTER.format(redis=redis.url, instance=name))
    linked(url)
    return process, url


# -- 1. latency ---------------------------------------------------------------------------------


async def latency(
    direct: str, gateways: dict[str, tuple[str, ProcessStats]], redis: Redis, n: int
) -> dict[str, Any]:
    """Scenario 2 with three targets in each round, the gateways' order alternating; CPU is
    each process's over the whole pass (what a gateway does between requests, such as the
    cluster's lease, counts too)."""
    ms: dict[str, list[float]] = {"direct": [], **{name: [] for name in gateways}}
    cpu_before = {name: stats.cpu_seconds() for name, (_, stats) in gateways.items()}
    redis_cpu, commands = redis.stats.cpu_seconds(), redis.commands()
    names = list(gateways)
    for i in range(n):
        ms["direct"].append(
            1000
            * await first_token(
                direct + "/chat/completions", openai_body("content-only", 8), is_openai_token
            )
        )
        for name in names if i % 2 == 0 else names[::-1]:
            url = gateways[name][0] + "/llm/v1/messages"
            body = anthropic_body("fast", "content-only", 8)
            ms[name].append(1000 * await first_token(url, body, is_anthropic_token))
    out: dict[str, Any] = {"requests": n}
    for name, values in ms.items():
        out[f"{name}_p50_ms"] = round(percentile(values, 50), 2)
        out[f"{name}_p95_ms"] = round(percentile(values, 95), 2)
    for name, (_, stats) in gateways.items():
        out[f"{name}_added_p50_ms"] = round(out[f"{name}_p50_ms"] - out["direct_p50_ms"], 2)
        out[f"{name}_added_p95_ms"] = round(out[f"{name}_p95_ms"] - out["direct_p95_ms"], 2)
        out[f"{name}_cpu_ms_per_request"] = round(
            1000 * (stats.cpu_seconds() - cpu_before[name]) / n, 3
        )
    out["redis_cpu_ms_per_request"] = round(1000 * (redis.stats.cpu_seconds() - redis_cpu) / n, 3)
    out |= {
        f"redis_{k}_per_request": v
        for k, v in command_figures(commands, redis.commands(), n).items()
    }
    return out


def run_latency(workdir: Path, redis: Redis, n: int) -> dict[str, Any]:
    stub, stub_url = start_stub(workdir, "--reasoning-tokens", "0", "--content-tokens", "8")
    processes = [stub]
    try:
        config = LATENCY_CONFIG.format(stub=stub_url)
        (workdir / "in-process").mkdir()
        local, local_url = start_gateway(workdir / "in-process", config)
        processes.append(local)
        shared, shared_url = cluster_gateway(workdir, "gw-latency", config, redis.server)
        processes.append(shared)
        gateways = {
            "in_process": (local_url, ProcessStats(local.popen.pid)),
            "cluster": (shared_url, ProcessStats(shared.popen.pid)),
        }
        return asyncio.run(latency(stub_url, gateways, redis, n))
    finally:
        for process in processes:
            process.stop()


# -- 2. 5,000 waiters over two gateways -----------------------------------------------------------


async def shared_burst(
    gateways: list[tuple[str, ProcessStats]],
    redis: Redis,
    stub: str,
    stub_log: Path,
    each: int,
) -> dict[str, Any]:
    """Two blockers take both slots through the first gateway; `each` clients connect at once to
    every gateway (interleaved); all in the line, the blockers leave and the line drains."""
    urls = [url for url, _ in gateways]
    n = each * len(gateways)
    release = asyncio.Event()
    blockers = [
        asyncio.create_task(
            request(
                urls[0] + "/llm/v1/messages",
                burst.body("stall", 4000),
                cut=lambda r: release.is_set(),
            )
        )
        for _ in range(SLOTS)
    ]
    for url in urls:  # every copy of the line sees both slots taken
        await burst.wait_queue(url, lambda s: s["in_use"] == SLOTS)
    rss_before = [stats.rss_kb() for _, stats in gateways]
    redis_kb = redis.used_kb()
    cpu_before = [stats.cpu_seconds() for _, stats in gateways]
    redis_cpu, commands = redis.stats.cpu_seconds(), redis.commands()
    started = time.monotonic()
    tags = [f"c-{'ab'[g]}{i}" for i in range(each) for g in range(len(gateways))]
    clients = [
        asyncio.create_task(
            request(urls[k % len(urls)] + "/llm/v1/messages", burst.body("content-only", tag=tag))
        )
        for k, tag in enumerate(tags)
    ]
    for url in urls:
        await burst.wait_queue(
            url, lambda s: s["waiting"] + sum(c.done() for c in clients) >= n, timeout=300
        )
    all_queued = time.monotonic() - started
    rss_waiting = [stats.rss_kb() for _, stats in gateways]
    redis_kb_per_waiter = (redis.used_kb() - redis_kb) / n
    released_at = time.monotonic()
    release.set()
    for blocker in blockers:  # stalled streams send nothing more: close them
        blocker.cancel()
    await asyncio.gather(*blockers, return_exceptions=True)
    results: list[Result] = await asyncio.gather(*clients)
    drained = time.monotonic() - released_at
    for url in urls:
        await burst.wait_queue(url, lambda s: s["in_use"] == 0 and s["waiting"] == 0)
    cpu = [
        stats.cpu_seconds() - before
        for (_, stats), before in zip(gateways, cpu_before, strict=True)
    ]
    figures = command_figures(commands, redis.commands(), n + SLOTS)
    upstream = get_json(stub.removesuffix("/v1") + "/stub/status")
    return {
        "clients": n,
        "gateways": len(gateways),
        "slots": SLOTS,
        "stub_peak_in_flight": upstream["max_in_flight"],
        "stub_requests": upstream["requests"],
        "stub_completed_cancelled": f"{upstream['completed']} / {upstream['cancelled']}",
        **burst.outcome(results, tags, stub_log),
        "seconds_until_all_queued": round(all_queued, 2),
        "drain_seconds": round(drained, 1),
        "slots_per_s": round((n + SLOTS) / drained, 1),
        "gateway_cpu_ms_per_request": round(1000 * sum(cpu) / n, 3),
        "gateway_cpu_s_each": [round(c, 2) for c in cpu],
        "redis_cpu_ms_per_request": round(1000 * (redis.stats.cpu_seconds() - redis_cpu) / n, 3),
        **{f"redis_{k}_per_slot": v for k, v in figures.items()},
        "rss_kb_idle_each": rss_before,
        "rss_kb_all_waiting_each": rss_waiting,
        "kb_per_waiter": round((sum(rss_waiting) - sum(rss_before)) / n, 2),
        "redis_kb_per_waiter": round(redis_kb_per_waiter, 2),
    }


def misbehaved(figures: dict[str, Any]) -> bool:
    return bool(
        figures["stub_peak_in_flight"] > SLOTS
        or figures["completed"] != figures["clients"]
        or figures["refused"]
        or figures["reset"]
        or figures["other_errors"]
        or figures["non_200"]
        or figures.get("link_losses")
    )


def run_shared_burst(workdir: Path, redis: Redis, each: int) -> dict[str, Any]:
    log = workdir / "shared-stub.log"
    stub, stub_url = start_stub(
        workdir, "--reasoning-tokens", "0", "--content-tokens", "8", "--log", str(log)
    )
    processes = [stub]
    gateways: dict[str, Process] = {}
    urls: list[str] = []
    figures: dict[str, Any] | None = None
    try:
        config = burst.CONFIG.format(stub=stub_url, trusted="[]")
        for name in ("gw-a", "gw-b"):
            gateways[name], url = cluster_gateway(workdir, name, config, redis.server)
            processes.append(gateways[name])
            urls.append(url)
        pids = [g.popen.pid for g in gateways.values()]
        measured = [(url, ProcessStats(pid)) for url, pid in zip(urls, pids, strict=True)]
        figures = asyncio.run(shared_burst(measured, redis, stub_url, log, each))
    finally:
        for process in processes:
            process.stop()
        if figures is not None:  # a link judged lost while the reactors were saturated
            outputs = [g.all_output() for g in gateways.values()]
            figures["link_losses"] = sum(o.count("lost the shared line") for o in outputs)
        if figures is None or misbehaved(figures):
            keep_logs(gateways, log)
    return figures


def keep_logs(gateways: dict[str, Process], stub_log: Path) -> None:
    """The gateways' output and the stub's log, where the evidence of a misbehaviour is."""
    RESULTS.mkdir(exist_ok=True)
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    for name, process in gateways.items():
        path = RESULTS / f"cluster-{stamp}-{name}.log"
        path.write_text(process.all_output())
        print(f"gateway log: {path}", file=sys.stderr)
    if stub_log.exists():
        (RESULTS / f"cluster-{stamp}-stub.log").write_text(stub_log.read_text())


# -- running it all -------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--latency-requests", type=int, default=200)
    parser.add_argument("--clients", type=int, default=5000, help="waiters over both gateways")
    parser.add_argument("--no-baseline", dest="baseline", action="store_false")
    parser.add_argument(
        "--bursts",
        type=int,
        default=0,
        help="only the shared burst, this many times on fresh gateways and Redis: link losses",
    )
    args = parser.parse_args()
    if args.bursts:
        repeat_bursts(args.bursts, args.clients)
        return
    report: dict[str, Any] = {"machine": machine() | {"load_average_before": load_average()}}
    with tempfile.TemporaryDirectory() as directory:
        workdir = Path(directory)
        server = RedisServer()
        server.start()
        try:
            redis = Redis(server)
            print("1 latency ...", file=sys.stderr)
            report["1_latency"] = run_latency(workdir, redis, args.latency_requests)
            print("2 shared burst ...", file=sys.stderr)
            report["2_shared_burst"] = run_shared_burst(workdir, redis, args.clients // 2)
        finally:
            server.close()
        if args.baseline:
            print("3 in process (scenario 6) ...", file=sys.stderr)
            (workdir / "baseline").mkdir()
            report["3_in_process_burst"] = burst.run(workdir / "baseline", args.clients)
    report["machine"]["load_average_after"] = load_average()
    print(table(report))
    RESULTS.mkdir(exist_ok=True)
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    (RESULTS / f"cluster-{stamp}.json").write_text(json.dumps(report, indent=2))
    print(f"results: bench/results/cluster-{stamp}.json")


def repeat_bursts(runs: int, clients: int) -> None:
    """Scenario 2 again and again (issue 27: a saturated reactor must not lose the link)."""
    lost = failed = 0
    for run in range(1, runs + 1):
        with tempfile.TemporaryDirectory() as directory:
            server = RedisServer()
            server.start()
            try:
                figures = run_shared_burst(Path(directory), Redis(server), clients // 2)
            finally:
                server.close()
        lost += figures["link_losses"] > 0
        failed += figures["clients"] - figures["completed"]
        print(
            f"run {run}: load {load_average()}, link losses {figures['link_losses']}, "
            f"completed {figures['completed']}/{figures['clients']}, "
            f"peak {figures['stub_peak_in_flight']}, "
            f"queued in {figures['seconds_until_all_queued']}s",
            flush=True,
        )
    print(f"{runs} runs: {lost} with a link loss, {failed} requests not completed")


if __name__ == "__main__":
    main()
