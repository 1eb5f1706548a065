"""The chaos run: random upstream failures and client behaviours, then prove nothing leaked.

`python -m bench.chaos` runs 2,000 requests (under two minutes) for one model over two stub
replicas with `slots = 2` each, sharing one line, where each request picks a stub scenario at
random (fail mid-stream, a non-JSON line, 500 before the stream, stall past the idle timeout,
reset, truncate, abort, a body left open after [DONE], a 500 whose body never ends, a line that
never ends, a request read and then dropped, or a clean answer), while clients randomly hang up
while queued, before the first token or mid-stream, or send malformed requests. Meanwhile
replica `b` dies (its process is killed: port closed, connections gone) and comes back on its
port, again and again. At the end: no slot in use, nobody waiting, nothing in flight or held
open at either stub, every finished answer grammatical or an error in Anthropic shape with no
frame after `message_stop` (a good scenario may fail only if it overlapped an outage of `b` and
its error names `b`), no endless body read past the gateway's limits, no request run twice
(each prompt is unique, and the stubs log a digest of each prompt they start, across restarts:
only a 503 may be sent again, to another replica, as many times as the gateway counted status
retries), no unhandled error in the gateway's log, and /healthz still answering.
tests/test_chaos.py runs a smaller one.

Meanwhile the config is reloaded (SIGHUP) every `RELOAD_EVERY` seconds, cycling through fewer
slots, an invalid file and the original: every answer must stay as valid as without reloads.
Last, on a fresh stack whose upstream takes a second per answer, SIGTERM lands while
non-streaming and streaming clients are in flight and queued: each in-flight one must get its
whole answer, each queued one its 529 (or error frame), none a dropped connection, and the
process must exit 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import re
import signal
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

from testsupport.client import Result, get_json, request
from testsupport.grammar import check_stream
from testsupport.processes import Process, start_gateway, start_stub, wait_until

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


REFUSED_TWICE = "a 503'd request went back to the replica that refused it"
KILLED = "b"
"""The replica whose stub dies and comes back during the run; `a` stays up throughout."""


def config(stubs: dict[str, str], slots: int = 2) -> str:
    """One model over the upstreams `stubs` (name -> URL). A 0.5 s cooldown: a revived
    replica gets its trial request within the run."""
    upstreams = "".join(
        f"""
[upstreams.{name}]
url = "{url}"
slots = {slots}
idle_timeout = 1
queue_limit = 10000
cooldown = 0.5
"""
        for name, url in stubs.items()
    )
    return f"""
[server]
ping_interval = 0.5
{upstreams}
[models.reasoning]
upstreams = {json.dumps(list(stubs))}
"""


def reload_configs(stubs: dict[str, str]) -> list[tuple[str, bool]]:
    """The files a reload cycles through, each with whether it is valid."""
    return [
        (config(stubs, slots=1), True),
        (config(stubs).replace("slots = 2", "slots = 0"), False),
        (config(stubs), True),
    ]


def pick(rng: random.Random, weights: dict[str, int]) -> str:
    return rng.choices(list(weights), weights=list(weights.values()))[0]


def cut_policy(behaviour: str, deltas: int) -> Any:
    """When a client of `behaviour` hangs up: at its first queue frame (or its first token if
    it never waited), at its first token, or after `deltas` deltas; None: it reads it all.
    `deltas` is the caller's, so that a run planned ahead from its seed (testsupport.chaos_cluster)
    decides it with the rest of the request."""

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


def failure_text(result: Result) -> str:
    """Where an answer says what went wrong: its body, or its stream's last frame."""
    last = json.dumps(result.frames[-1].data) if result.frames else ""
    return result.body.decode(errors="replace") + last


def verdict(scenario: str, behaviour: str, result: Result, may_fail: bool = False) -> str | None:
    """None if the answer is what the scenario allows, else what is wrong. `may_fail`: a good
    scenario may end in an error (it overlapped an outage of the replica its error names)."""
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
        if result.status >= 500 and scenario in GOOD and behaviour != "malformed" and not may_fail:
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
    if scenario in GOOD and ending != "complete" and not (may_fail and ending == "error"):
        return f"{scenario} ended in {ending}: {frames[-1]}"
    if scenario in BAD and ending != "error":
        return f"{scenario} ended in {ending}"
    return None


class Outages:
    """A stub (here replica `KILLED`'s) killed and started again on its port: each life logs
    to its own file (`name-N.log`), so the starts of every life can be read after the run."""

    def __init__(
        self, workdir: Path, options: tuple[str, ...], name: str = f"stub-{KILLED}"
    ) -> None:
        self.workdir = workdir
        self.options = options
        self.name = name
        self.logs: list[Path] = []
        self.windows: list[tuple[float, float]] = []  # (killed, listening again), monotonic
        self.process, self.url = self._start("tcp:0:interface=127.0.0.1")
        self.port = int(self.url.split(":")[2].split("/")[0])

    def _start(self, endpoint: str) -> tuple[Process, str]:
        log = self.workdir / f"{self.name}-{len(self.logs)}.log"
        self.logs.append(log)
        return start_stub(self.workdir, *self.options, "--log", str(log), "--port", endpoint)

    def kill(self) -> None:
        """SIGKILL: the port closes and the kernel drops every connection, as when the box's
        server crashes."""
        self.windows.append((time.monotonic(), float("inf")))
        self.process.popen.kill()
        self.process.popen.wait()

    def revive(self) -> None:
        self.process, _ = self._start(f"tcp:{self.port}:interface=127.0.0.1")
        self.windows[-1] = (self.windows[-1][0], time.monotonic())

    def overlaps(self, started: float, ended: float, margin: float = 0.0) -> bool:
        """Whether it was down (or came back less than `margin` seconds before) in that time."""
        return any(down <= ended and started <= up + margin for down, up in self.windows)


async def chaos(
    url: str,
    n: int,
    concurrency: int,
    seed: int,
    reload: Any = None,
    outages: Outages | None = None,
) -> dict[str, Any]:
    """`reload(i)`, if given, is called every RELOAD_EVERY seconds while the requests run;
    `outages`, if given, kills its stub after every n/10 answers and revives it n/20 later."""
    rng = random.Random(seed)
    semaphore = asyncio.Semaphore(concurrency)
    problems: list[str] = []
    counts: Counter[str] = Counter()
    sent: Counter[str] = Counter()
    finished = 0
    excused = 0

    async def one(i: int) -> None:
        nonlocal finished, excused
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
            started = time.monotonic()
            result = await request(
                url + "/llm/v1/messages",
                body,
                cut=cut_policy(behaviour, rng.randint(1, 6)),
                timeout=60,
            )
        finished += 1
        counts[f"{behaviour}:{'cut' if result.cut else result.status}"] += 1
        may_fail = (
            outages is not None
            and outages.overlaps(started, time.monotonic())
            and f"upstream {KILLED} " in failure_text(result)
        )
        problem = verdict(scenario, behaviour, result, may_fail)
        if problem is not None:
            problems.append(f"#{i} {scenario}/{behaviour}: {problem}")
        elif may_fail and scenario in GOOD and verdict(scenario, behaviour, result) is not None:
            excused += 1

    async def reloading(done: asyncio.Event) -> None:
        i = 0
        while not done.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(done.wait(), RELOAD_EVERY)
            if not done.is_set():
                reload(i)
                i += 1

    async def answers(count: int, done: asyncio.Event) -> bool:
        """Wait for `count` more answers; False if the run ended first."""
        target = finished + count
        while finished < target and not done.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(done.wait(), 0.02)
        return not done.is_set()

    async def killing(done: asyncio.Event) -> None:
        assert outages is not None
        every = max(2, n // 10)
        while await answers(every, done):
            await asyncio.to_thread(outages.kill)
            await answers(every // 2, done)
            await asyncio.to_thread(outages.revive)

    started = time.monotonic()
    done = asyncio.Event()
    helpers = [
        *([asyncio.create_task(reloading(done))] if reload is not None else []),
        *([asyncio.create_task(killing(done))] if outages is not None else []),
    ]
    await asyncio.gather(*(one(i) for i in range(n)))
    done.set()
    await asyncio.gather(*helpers)
    return {
        "requests": n,
        "seconds": round(time.monotonic() - started, 1),
        "problems": problems,
        "outcomes": dict(sorted(counts.items())),
        "hangups_sent": sent["hangup"],
        "outages": len(outages.windows) if outages is not None else 0,
        "good_failed_in_outage": excused,
    }


def settle(gateway_url: str, stub_urls: list[str], timeout: float = 15.0) -> dict[str, Any]:
    """Wait (bounded) for the cancellations to land, then report what is left anywhere."""
    deadline = time.monotonic() + timeout
    while True:
        upstreams = get_json(gateway_url + "/llm/v1/status")["upstreams"].values()
        stubs = [get_json(url.removesuffix("/v1") + "/stub/status") for url in stub_urls]
        after = {
            "slots_in_use": sum(u["in_use"] for u in upstreams),
            "waiting": max(u["waiting"] for u in upstreams),
            "stub_in_flight": sum(s["in_flight"] for s in stubs),
            "stub_held_open": sum(s["held_open"] for s in stubs),
            "stub_endless_bytes": max(s["endless_bytes"] for s in stubs),
        }
        left = any(value for key, value in after.items() if key != "stub_endless_bytes")
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    after["healthz"] = urllib.request.urlopen(gateway_url + "/healthz", timeout=5).status
    return after


def starts(logs: dict[str, list[Path]]) -> list[dict[str, str]]:
    """Every request the stubs started (and the hangups among them), from each stub's logs
    over all its lives: the fields of each `start` or `hangup` line and the stub's name."""
    lines = []
    for stub, paths in logs.items():
        for path in paths:
            for line in path.read_text().splitlines():
                _, event, *fields = line.split()
                if event in ("start", "hangup"):
                    values = dict(field.split("=", 1) for field in fields if "=" in field)
                    lines.append({"stub": stub, "event": event, **values})
    return lines


def retries(gateway_url: str) -> Counter[str]:
    """The gateway's retries so far, by reason (a refused connection, a 5xx status...)."""
    with urllib.request.urlopen(gateway_url + "/metrics", timeout=5) as response:
        text = response.read().decode()
    counts: Counter[str] = Counter()
    for match in re.finditer(r"^homelab_gateway_retries_total\{(.*)\} (\S+)$", text, re.M):
        reason = re.search(r'reason="([^"]*)"', match.group(1))
        counts[reason.group(1) if reason else ""] += int(float(match.group(2)))
    return counts


def reruns(started: list[dict[str, str]], retried: Counter[str]) -> list[str]:
    """What ran twice. Each prompt is unique, so each should start once; only a request an
    upstream refused with a 503 (scenario overloaded) may start again, on another replica, and
    no more often in all than the gateway counted retries after a status. A killed stub
    refuses connections, which the gateway retries: those never reach a stub."""
    runs: dict[str, list[dict[str, str]]] = {}
    for line in started:
        if line["event"] == "start":
            runs.setdefault(line["prompt"], []).append(line)
    problems = []
    again = 0
    for prompt, lines in runs.items():
        again += len(lines) - 1
        stubs = [line["stub"] for line in lines]
        scenario = lines[0]["scenario"]
        if len(lines) > 1 and scenario != "overloaded":
            problems.append(f"a {scenario} request (prompt {prompt}) started on {stubs}")
        elif len(set(stubs)) < len(stubs):
            problems.append(f"{REFUSED_TWICE} (prompt {prompt}, started on {stubs})")
    if again > retried["status"]:
        problems.append(f"{again} requests started again for {retried['status']} status retries")
    unexpected = set(retried) - {"connect", "status"}
    if unexpected:
        problems.append(f"retries after a failure that may have run the request: {retried}")
    return problems


def run(n: int, concurrency: int, seed: int, workdir: Path) -> dict[str, Any]:
    options = ("--hold", "0.05", "--delay", "0.005", "--content-tokens", "12")
    steady_log = workdir / "stub-a.log"
    steady, steady_url = start_stub(workdir, *options, "--log", str(steady_log))
    outages: Outages | None = None
    gateway: Process | None = None
    sent = {True: 0, False: 0}

    def reload(i: int) -> None:
        text, valid = files[i % len(files)]
        (workdir / "gateway.toml").write_text(text)
        assert gateway is not None
        gateway.signal(signal.SIGHUP)
        sent[valid] += 1

    try:
        outages = Outages(workdir, options)
        stubs = {"a": steady_url, KILLED: outages.url}
        files = reload_configs(stubs)
        gateway, url = start_gateway(workdir, config(stubs))
        report = asyncio.run(chaos(url, n, concurrency, seed, reload, outages))
        report["after"] = settle(url, list(stubs.values()))
        retried = retries(url)
    finally:
        exit_status = gateway.stop() if gateway is not None else None
        steady.stop()
        if outages is not None:
            outages.process.stop()
    log = gateway.all_output() if gateway is not None else ""
    assert outages is not None
    started = starts({"a": [steady_log], KILLED: outages.logs})
    after = report["after"]
    after["stub_requests"] = sum(line["event"] == "start" for line in started)
    after["stub_hangups"] = sum(line["event"] == "hangup" for line in started)
    revived = starts({KILLED: outages.logs[1:]})
    after["served_after_revival"] = sum(line["event"] == "start" for line in revived)
    report["retries"] = dict(retried)
    report["problems"] += reruns(started, retried)
    report["unhandled_errors"] = log.count("Unhandled") + log.count("Traceback")
    report["reloads"] = {
        "valid": sent[True],
        "invalid": sent[False],
        "applied": log.count("config reloaded from"),
        "refused": log.count("reload failed, still running the previous config"),
    }
    report["exit_status"] = exit_status
    report["drain"] = drain_under_load(workdir / "drain")
    reloads = report["reloads"]
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
        and report["outages"] > 0
        and after["served_after_revival"] > 0
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
        config({"a": stub_url}, slots=slots)
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
            status = get_json(url + "/llm/v1/status")["upstreams"]["a"]
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
