"""The chaos run: random upstream failures and client behaviours, then prove nothing leaked.

`python -m bench.chaos` runs 2,000 requests (under two minutes) with `slots = 3` against a stub
whose scenario each request picks at random (fail mid-stream, a non-JSON line, 500 before the
stream, stall past the idle timeout, reset, truncate, abort, a body left open after [DONE], a
500 whose body never ends, a line that never ends, a request read and then dropped, or a clean
answer), while clients randomly hang up while queued, before the first token or mid-stream,
or send malformed requests. At the end: no slot in use, nobody waiting, nothing in flight or
held open at the stub, every finished answer grammatical or an error in Anthropic shape with
no frame after `message_stop`, no endless body read past the gateway's limits, no request
sent to the upstream twice, no unhandled error in the gateway's log, and /healthz still
answering. tests/test_chaos.py runs a smaller one.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

from bench.client import Result, get_json, request
from tests.grammar import check_stream
from tests.processes import Process, start_gateway, start_stub

GOOD = {"default": 4, "content-only": 2, "tool": 1, "open-after-done": 1}
BAD = {
    "fail": 1,
    "garbage": 1,
    "error500": 1,
    "stall": 1,
    "truncate": 1,
    "reset": 1,
    "abort": 1,
    "overloaded": 1,
    "endless-error": 1,
    "long-line": 1,
    "hangup": 1,
}
# The most an endless body may send before the gateway closes it: its 4 MiB line limit (the
# 64 KiB error-body limit for an error) plus what socket buffers hold on the way.
ENDLESS_BOUND = 8 * 1024 * 1024
BEHAVIOURS = {
    "read": 10,
    "cut-queued": 2,
    "cut-before-first-token": 2,
    "cut-mid-stream": 2,
    "malformed": 2,
}
MALFORMED = [
    b"{not json",
    b"{}",
    b'{"model":"reasoning"}',
    b'{"model":"ghost","max_tokens":5,"messages":[]}',
    b'{"model":"reasoning","max_tokens":-1,"messages":[{"role":"user","content":"hi"}]}',
    b"[" * 3000,
]


def config(stub_url: str) -> str:
    return f"""
[server]
ping_interval = 0.5

[upstreams.vllm]
url = "{stub_url}"
slots = 3
idle_timeout = 1
queue_limit = 10000

[models.reasoning]
upstream = "vllm"
"""


def pick(rng: random.Random, weights: dict[str, int]) -> str:
    return rng.choices(list(weights), weights=list(weights.values()))[0]


def cut_policy(behaviour: str, rng: random.Random) -> Any:
    deltas = rng.randint(1, 6)

    def cut(result: Result) -> bool:
        events = result.events
        if behaviour == "cut-queued":
            return (bool(events) and events[-1] == "queue") or "message_start" in events
        if behaviour == "cut-before-first-token":
            return "message_start" in events
        if behaviour == "cut-mid-stream":
            return events.count("content_block_delta") >= deltas
        return False

    return cut if behaviour.startswith("cut") else None


def verdict(scenario: str, behaviour: str, result: Result) -> str | None:
    """None if the answer is what the scenario allows, else what is wrong."""
    if result.cut:
        return None
    if result.error is not None:
        return f"transport error {result.error}"
    if behaviour == "malformed" or result.status != 200:
        if result.status is None or not 400 <= result.status < 600:
            return f"status {result.status}"
        try:
            document = json.loads(result.body)
        except ValueError:
            return f"status {result.status} with a body that is not JSON"
        if document.get("type") != "error" or not document.get("error", {}).get("type"):
            return f"status {result.status} not in Anthropic shape: {document}"
        if result.status >= 500 and scenario in GOOD and behaviour != "malformed":
            return f"status {result.status} for a good scenario"
        return None
    if not result.headers.get("content-type", "").startswith("text/event-stream"):
        message = json.loads(result.body)
        if message.get("type") != "message" or not message.get("stop_reason"):
            return f"a 200 that is not a complete message: {message}"
        return None if scenario in GOOD else f"{scenario} answered 200 without streaming"
    frames = [f.data for f in result.frames]
    if "message_stop" in result.events and result.events[-1] != "message_stop":
        return f"frames after message_stop: {result.events[-3:]}"
    try:
        ending = check_stream(frames)
    except AssertionError as e:
        return f"bad stream: {e}"
    if scenario in GOOD and ending != "complete":
        return f"{scenario} ended in {ending}: {frames[-1]}"
    if scenario in BAD and ending != "error":
        return f"{scenario} ended in {ending}"
    return None


async def chaos(url: str, n: int, concurrency: int, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    semaphore = asyncio.Semaphore(concurrency)
    problems: list[str] = []
    counts: Counter[str] = Counter()
    sent: Counter[str] = Counter()

    async def one(i: int) -> None:
        scenario = pick(rng, {**GOOD, **BAD})
        behaviour = pick(rng, BEHAVIOURS)
        body: Any = {
            "model": "reasoning",
            "max_tokens": 40,
            "stream": rng.random() < 0.85,
            "messages": [{"role": "user", "content": f"{scenario} please #{i}"}],
        }
        if behaviour == "malformed":
            body = rng.choice(MALFORMED)
        elif not body["stream"] and behaviour.startswith("cut"):
            behaviour = "read"
        if behaviour != "malformed":
            sent[scenario] += 1
        async with semaphore:
            result = await request(
                url + "/llm/v1/messages", body, cut=cut_policy(behaviour, rng), timeout=60
            )
        counts[f"{behaviour}:{'cut' if result.cut else result.status}"] += 1
        problem = verdict(scenario, behaviour, result)
        if problem is not None:
            problems.append(f"#{i} {scenario}/{behaviour}: {problem}")

    started = time.monotonic()
    await asyncio.gather(*(one(i) for i in range(n)))
    return {
        "requests": n,
        "seconds": round(time.monotonic() - started, 1),
        "problems": problems,
        "outcomes": dict(sorted(counts.items())),
        "hangups_sent": sent["hangup"],
    }


def settle(gateway_url: str, stub_url: str, timeout: float = 15.0) -> dict[str, Any]:
    """Wait (bounded) for the cancellations to land, then report what is left anywhere."""
    deadline = time.monotonic() + timeout
    while True:
        gateway = get_json(gateway_url + "/llm/v1/status")["upstreams"]["vllm"]
        stub = get_json(stub_url.removesuffix("/v1") + "/stub/status")
        if (
            gateway["in_use"] == gateway["waiting"] == stub["in_flight"] == stub["held_open"] == 0
        ) or time.monotonic() > deadline:
            health = urllib.request.urlopen(gateway_url + "/healthz", timeout=5).status
            return {
                "slots_in_use": gateway["in_use"],
                "waiting": gateway["waiting"],
                "stub_in_flight": stub["in_flight"],
                "stub_requests": stub["requests"],
                "stub_cancelled": stub["cancelled"],
                "stub_held_open": stub["held_open"],
                "stub_hangups": stub["hangups"],
                "stub_endless_bytes": stub["endless_bytes"],
                "healthz": health,
            }
        time.sleep(0.05)


def run(n: int, concurrency: int, seed: int, workdir: Path) -> dict[str, Any]:
    stub, stub_url = start_stub(
        workdir, "--hold", "0.05", "--delay", "0.005", "--content-tokens", "12"
    )
    gateway: Process | None = None
    try:
        gateway, url = start_gateway(workdir, config(stub_url))
        report = asyncio.run(chaos(url, n, concurrency, seed))
        report["after"] = settle(url, stub_url)
    finally:
        if gateway is not None:
            gateway.stop()
        stub.stop()
    log = "".join(gateway.output) if gateway is not None else ""
    report["unhandled_errors"] = log.count("Unhandled") + log.count("Traceback")
    after = report["after"]
    if after["stub_hangups"] > report["hangups_sent"]:
        report["problems"].append(
            f"the upstream was sent {after['stub_hangups']} hangup requests for "
            f"{report['hangups_sent']} sent to the gateway: some went twice"
        )
    if after["stub_endless_bytes"] > ENDLESS_BOUND:
        report["problems"].append(
            f"an endless body was read to {after['stub_endless_bytes']} bytes before it was cut"
        )
    report["ok"] = (
        not report["problems"]
        and not report["unhandled_errors"]
        and (
            after["slots_in_use"]
            == after["waiting"]
            == after["stub_in_flight"]
            == after["stub_held_open"]
            == 0
            and after["healthz"] == 200
        )
    )
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=60)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as workdir:
        report = run(args.requests, args.concurrency, args.seed, Path(workdir))
    print(json.dumps(report, indent=2))
    sys.exit(0 if report["ok"] else 1)


if __name__ == "__main__":
    main()
