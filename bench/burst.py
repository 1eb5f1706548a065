"""Burst connect: thousands of streaming clients connecting in the same moment, behind 2 slots.

`python -m bench.burst` (also scenario 6 of `python -m bench`) starts its own stub and a fresh
gateway with default listen settings (so nothing earlier inflates its memory), lets two
blockers take both slots, then opens every client's connection at once, unpaced. Once the
gateway reports them all waiting the blockers leave and the line drains. Figures, from the
gateway process alone where they are costs:

- refused / reset / other errors, and how many completed with `message_stop`;
- in order: the initial queue positions are exactly 1..n, and with 2 slots the client at
  position k + 2 never reaches the upstream before the one at k (the stub's log of starts);
  each client's positions only fall (one client, one FIFO), down to 1;
- gateway CPU per request, from the first connect to the line drained;
- KB of gateway RSS per waiting stream, all of them waiting;
- queue frames per second of waiting, per client (median, p95, max).

With `--distinct`, each of them is a client of its own for the line's fair share (its own
`X-Forwarded-For` address, the gateway trusting loopback as its proxy), as behind a reverse
proxy with that many users; by default they are all one client (one loopback address).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.scenarios import ProcessStats
from testsupport.client import Result, get_json, percentile, request
from testsupport.processes import start_gateway, start_stub

CONFIG = """
[server]
trusted_proxies = {trusted}

[upstreams.queue]
url = "{stub}"
slots = 2
queue_limit = 20000

[models.queue]
upstream = "queue"
"""


def body(prompt: str, max_tokens: int = 16, tag: str = "blocker") -> dict[str, Any]:
    return {
        "model": "queue",
        "max_tokens": max_tokens,
        "stream": True,
        "messages": [{"role": "user", "content": prompt}],
        "metadata": {"user_id": tag},
    }


def stub_start_order(log: Path) -> list[str]:
    """The tags in the order the stub saw the requests start: the gateway's own dispatch
    order, free of the load client's scheduling (which can deliver two starts swapped)."""
    order = []
    for line in log.read_text().splitlines():
        _, event, rest = line.split(" ", 2)
        fields = dict(part.split("=", 1) for part in rest.split() if "=" in part)
        if event == "start" and fields.get("user", "").startswith("c-"):
            order.append(fields["user"])
    return order


async def wait_queue(gateway: str, condition: Any, timeout: float = 120.0) -> dict[str, int]:
    deadline = time.monotonic() + timeout
    while True:
        status = get_json(gateway + "/llm/v1/status")["upstreams"]["queue"]
        if condition(status):
            return status
        if time.monotonic() > deadline:
            raise TimeoutError(f"queue status never matched: {status}")
        await asyncio.sleep(0.05)


def forwarded_for(i: int) -> dict[str, str]:
    """Client `i`'s own address, as a reverse proxy would say it."""
    return {"X-Forwarded-For": f"10.{i >> 16 & 255}.{i >> 8 & 255}.{i & 255}"}


async def burst(
    gateway: str, stats: Any, n: int, stub_log: Path, distinct: bool = False
) -> dict[str, Any]:
    url = gateway + "/llm/v1/messages"
    release = asyncio.Event()
    blockers = [
        asyncio.create_task(request(url, body("stall", 4000), cut=lambda r: release.is_set()))
        for _ in range(2)
    ]
    await wait_queue(gateway, lambda s: s["in_use"] == 2)
    rss_before, cpu_before = stats.rss_kb(), stats.cpu_seconds()
    started = time.monotonic()
    clients = [
        asyncio.create_task(
            request(
                url,
                body("content-only", tag=f"c-{i}"),
                headers=forwarded_for(i) if distinct else None,
            )
        )
        for i in range(n)
    ]
    await wait_queue(gateway, lambda s: s["waiting"] + sum(c.done() for c in clients) >= n)
    all_queued = time.monotonic() - started
    rss_waiting = stats.rss_kb()
    released_at = time.monotonic()
    release.set()
    for blocker in blockers:  # stalled streams send nothing more: close them
        blocker.cancel()
    await asyncio.gather(*blockers, return_exceptions=True)
    results: list[Result] = await asyncio.gather(*clients)
    drained = time.monotonic() - released_at
    await wait_queue(gateway, lambda s: s["in_use"] == 0 and s["waiting"] == 0)
    cpu = stats.cpu_seconds() - cpu_before

    return {
        "clients": n,
        "distinct_clients": distinct,
        "slots": 2,
        **outcome(results, [f"c-{i}" for i in range(n)], stub_log),
        "seconds_until_all_queued": round(all_queued, 2),
        "drain_seconds": round(drained, 1),
        "gateway_cpu_ms_per_request": round(1000 * cpu / n, 3),
        "rss_kb_idle": rss_before,
        "rss_kb_all_waiting": rss_waiting,
        "kb_per_waiter": round((rss_waiting - rss_before) / n, 2),
    }


def outcome(results: list[Result], tags: list[str], stub_log: Path) -> dict[str, Any]:
    """What the clients saw (`tags`: each result's metadata.user_id) and the order the stub saw
    them start: errors, completions, positions 1..n exact, dispatch order, queue frames."""
    errors = [r.error or "" for r in results if r.error]
    complete = [
        r for r in results if not r.error and r.status == 200 and r.events[-1:] == ["message_stop"]
    ]
    queued = [r for r in complete if r.first(lambda f: f.event == "queue") is not None]
    first_position = {id(r): r.first(lambda f: f.event == "queue").data["position"] for r in queued}  # type: ignore[union-attr]
    by_position = sorted(queued, key=lambda r: first_position[id(r)])
    positions_exact = [first_position[id(r)] for r in by_position] == list(
        range(1, len(queued) + 1)
    )
    tag_of = {id(r): tag for r, tag in zip(results, tags, strict=True)}
    dispatched = stub_start_order(stub_log)
    rank = {tag: k for k, tag in enumerate(dispatched)}
    # With 2 slots, the client at position k + 2 must not reach the upstream before the one at k.
    order = [rank.get(tag_of[id(r)], -1) for r in by_position]
    out_of_order = sum(1 for i in range(len(order) - 2) if order[i] > order[i + 2])
    rates, frames_total, rising, not_one = [], 0, 0, 0
    for r in queued:
        frames = [f for f in r.frames if f.event == "queue"]
        frames_total += len(frames)
        positions = [f.data["position"] for f in frames]
        rising += positions != sorted(positions, reverse=True)  # one client, one FIFO: only falls
        not_one += positions[-1] != 1
        waited = r.first(lambda f: f.event == "message_start").at - r.sent  # type: ignore[union-attr]
        rates.append(len(frames) / waited if waited > 0 else 0.0)
    return {
        "refused": sum("Refused" in e for e in errors),
        "reset": sum("Reset" in e or "Broken" in e for e in errors),
        "other_errors": sorted(set(errors) - {e for e in errors if "Refused" in e or "Reset" in e})[
            :5
        ],
        "non_200": sum(1 for r in results if not r.error and r.status != 200),
        "completed": len(complete),
        "queued_positions_exact": positions_exact,
        "dispatched_out_of_queue_order": out_of_order,
        "waiters_whose_position_rose": rising,
        "waiters_never_told_1": not_one,
        "queue_frames_per_waiter": round(frames_total / len(queued), 2) if queued else None,
        "queue_frames_per_s_waiting_p50": round(statistics.median(rates), 2) if rates else None,
        "queue_frames_per_s_waiting_p95": round(percentile(rates, 95), 2) if rates else None,
        "queue_frames_per_s_waiting_max": round(max(rates), 2) if rates else None,
    }


def run(workdir: Path, n: int, distinct: bool = False) -> dict[str, Any]:
    log = workdir / "burst-stub.log"
    stub, stub_url = start_stub(
        workdir, "--reasoning-tokens", "0", "--content-tokens", "8", "--log", str(log)
    )
    try:
        trusted = '["127.0.0.1/32"]' if distinct else "[]"
        gateway, url = start_gateway(workdir, CONFIG.format(stub=stub_url, trusted=trusted))
        try:
            return asyncio.run(burst(url, ProcessStats(gateway.popen.pid), n, log, distinct))
        finally:
            gateway.stop()
    finally:
        stub.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=5000)
    parser.add_argument(
        "--distinct", action="store_true", help="every client its own address (fair share)"
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as workdir:
        report = run(Path(workdir), args.clients, args.distinct)
    json.dump(report, sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    main()
