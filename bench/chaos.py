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

Meanwhile the config is reloaded (SIGHUP) every `RELOAD_EVERY` seconds, cycling through fewer
slots, an invalid file and the original: every answer must stay as valid as without reloads.
Last, on a fresh stack whose upstream takes a second per answer, SIGTERM lands while
non-streaming and streaming clients are in flight and queued: each in-flight one must get its
whole answer, each queued one its 529 (or error frame), none a dropped connection, and the
process must exit 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import signal
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

from bench.client import Result, get_json, request
from tests.grammar import check_stream
from tests.processes import Process, start_gateway, start_stub, wait_until

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


RELOAD_EVERY = 0.5


def config(stub_url: str, slots: int = 3) -> str:
    return f"""
[server]
ping_interval = 0.5

[upstreams.vllm]
url = "{stub_url}"
slots = {slots}
idle_timeout = 1
queue_limit = 10000

[models.reasoning]
upstream = "vllm"
"""


def reload_configs(stub_url: str) -> list[tuple[str, bool]]:
    """The files a reload cycles through, each with whether it is valid."""
    return [
        (config(stub_url, slots=2), True),
        (config(stub_url).replace("slots = 3", "slots = 0"), False),
        (config(stub_url), True),
    ]


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


async def chaos(
    url: str, n: int, concurrency: int, seed: int, reload: Any = None
) -> dict[str, Any]:
    """`reload(i)`, if given, is called every RELOAD_EVERY seconds while the requests run."""
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

    async def reloading(done: asyncio.Event) -> None:
        i = 0
        while not done.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(done.wait(), RELOAD_EVERY)
            if not done.is_set():
                reload(i)
                i += 1

    started = time.monotonic()
    done = asyncio.Event()
    reloader = asyncio.create_task(reloading(done)) if reload is not None else None
    await asyncio.gather(*(one(i) for i in range(n)))
    done.set()
    if reloader is not None:
        await reloader
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
    files = reload_configs(stub_url)
    sent = {True: 0, False: 0}

    def reload(i: int) -> None:
        text, valid = files[i % len(files)]
        (workdir / "gateway.toml").write_text(text)
        assert gateway is not None
        gateway.signal(signal.SIGHUP)
        sent[valid] += 1

    try:
        gateway, url = start_gateway(workdir, config(stub_url))
        report = asyncio.run(chaos(url, n, concurrency, seed, reload))
        report["after"] = settle(url, stub_url)
    finally:
        exit_status = gateway.stop() if gateway is not None else None
        stub.stop()
    log = gateway.all_output() if gateway is not None else ""
    report["unhandled_errors"] = log.count("Unhandled") + log.count("Traceback")
    report["reloads"] = {
        "valid": sent[True],
        "invalid": sent[False],
        "applied": log.count("config reloaded from"),
        "refused": log.count("reload failed, still running the previous config"),
    }
    report["exit_status"] = exit_status
    report["drain"] = drain_under_load(workdir / "drain")
    after, reloads = report["after"], report["reloads"]
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
        and (reloads["applied"], reloads["refused"]) == (reloads["valid"], reloads["invalid"])
        and exit_status == 0
        and report["drain"]["ok"]
    )
    return report


def drain_under_load(workdir: Path, clients: int = 16, slots: int = 3) -> dict[str, Any]:
    """SIGTERM with `slots` answers in flight and the rest queued, most of them non-streaming:
    the in-flight ones get their whole answer, the queued ones a 529 or an error frame, and
    the process exits 0 with no traceback."""
    workdir.mkdir()
    # Each answer takes ~3.5 s (a 3 s prefill, then 40 tokens): every client must have arrived
    # before the first answer ends, even on a loaded machine. The chaos config's 1 s
    # idle_timeout would cut such a prefill, so this stack has a longer one.
    stub, stub_url = start_stub(workdir, "--hold", "3", "--delay", "0.01")
    text = (
        config(stub_url, slots=slots)
        .replace("[server]", "[server]\nshutdown_grace = 20")
        .replace("idle_timeout = 1\n", "idle_timeout = 30\n")
    )
    gateway, url = start_gateway(workdir, text)

    async def load() -> list[tuple[bool, Result]]:
        def body(i: int, stream: bool) -> dict[str, Any]:
            content = f"content-only please #{i}"
            messages = [{"role": "user", "content": content}]
            return {"model": "reasoning", "max_tokens": 40, "stream": stream, "messages": messages}

        streams = [i % 4 == 3 for i in range(clients)]
        tasks = [
            asyncio.create_task(request(url + "/llm/v1/messages", body(i, s), timeout=60))
            for i, s in enumerate(streams)
        ]

        def all_arrived() -> bool:
            status = get_json(url + "/llm/v1/status")["upstreams"]["vllm"]
            return status["in_use"] + status["waiting"] == clients

        await asyncio.to_thread(wait_until, all_arrived)
        gateway.signal(signal.SIGTERM)
        return list(zip(streams, await asyncio.gather(*tasks), strict=True))

    try:
        results = asyncio.run(load())
        exit_status = gateway.stop(timeout=30)
    finally:
        gateway.stop()
        stub.stop()
    outcomes: Counter[str] = Counter()
    problems = []
    for i, (stream, result) in enumerate(results):
        kind = "stream" if stream else "whole"
        if result.error is not None or result.status is None:
            problems.append(f"#{i} {kind}: no answer ({result.error})")
            continue
        if stream and result.status == 200:
            ending = check_stream([f.data for f in result.frames])
            outcomes[f"{kind}:{ending}"] += 1
            if ending not in ("complete", "error"):
                problems.append(f"#{i} stream ended in {ending}")
            continue
        document = json.loads(result.body)
        outcomes[f"{kind}:{result.status}"] += 1
        if result.status == 200 and document.get("type") != "message":
            problems.append(f"#{i} a 200 that is not a message: {document}")
        elif result.status != 200 and document.get("type") != "error":
            problems.append(f"#{i} {result.status} not in Anthropic shape: {document}")
    completed = outcomes["whole:200"] + outcomes["stream:complete"]
    log = gateway.all_output()
    return {
        "outcomes": dict(sorted(outcomes.items())),
        "problems": problems,
        "exit_status": exit_status,
        "tracebacks": log.count("Traceback"),
        "ok": not problems and completed == slots and exit_status == 0 and "Traceback" not in log,
    }


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
