"""The cluster chaos run (`python -m bench.chaos --cluster`): the shared line under faults.

Three gateways (real `twistd homelab-gateway` processes with `[cluster]`) share one
redis-server and one stub upstream whose cap is `SLOTS` in every gateway's config. Requests of
every kind go to the three gateways (streaming or not, a good answer or one of a few upstream
failures, clients that leave while queued, before their first token, mid-stream or, not
streaming, after a while) from four API keys: `[clients]` of each priority class, one with
`max_in_flight`. Meanwhile, at random but from the seed: a gateway is killed (SIGKILL) and
started again on its port, Redis is paused (SIGSTOP, 1-3 s, then SIGCONT), Redis is restarted
empty, the stub is killed and started again on its port. Redis faults and process faults come
from two loops of their own, so they may overlap, as real ones do.

With `--sentinel`, Redis is a primary and its replica under a Sentinel (`[cluster] sentinels`),
and its faults are failovers: the primary paused past the Sentinel's patience (the replica is
promoted; the paused one wakes up a primary nobody follows, and is made a replica), or killed
(the replica is promoted; the killed one comes back empty as its replica).

What must hold whatever happened, read from the stub's own log where the gateways' word would
not do (a gateway's count cannot prove a cap it keeps itself):

- the upstream never runs more than `SLOTS` requests at once, nor the capped client more than
  its `max_in_flight` (every start, refusal, hangup and end the stub logged, in its order, each
  life of the stub apart: a killed stub's requests end with it);
- no request starts twice (each prompt is unique, and carries its number as `user`);
- every request ends: answered, left by its client, a clean error naming its reason (a 5xx
  in Anthropic's shape, or a stream's `event: error` frame), or dropped by a gateway that was
  killed under it ("gateway killed", counted apart); a good scenario fails only if the stub
  died while it ran or its gateway did;
- at the end, nothing held and nobody waiting, on every gateway and in Redis (the slots and
  waiting hashes; in the primary, with Sentinel), nothing in flight at the stub, nothing
  still being handled by a gateway (`surfaces` in /llm/v1/status); no traceback in any
  gateway's log, every gateway stops cleanly, and every kind of fault was injected and its
  process served again.

Its `Report` (which `python -m bench.chaos --cluster` prints) has the figures: requests,
faults by kind, outcomes by kind, the longest wait (to the first token, or to a whole answer)
of requests that overlapped each kind of fault beside those that overlapped none, and
pass/fail per invariant. The request mix and the faults' kinds, order, targets, durations and
the answer counts they fire at all follow from the seed; only the timing between processes
does not. tests/test_chaos_cluster.py runs a small one (not the Sentinel variant, whose
failovers take a minute: tests/line/test_sentinel.py has one).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import random
import re
import shutil
import socket
import time
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from homelab_gateway.line.cluster import SETTLE
from testsupport.chaos import BEHAVIOURS, GOOD, Outages, cut_policy, pick
from testsupport.client import Result, get_json, percentile, request
from testsupport.grammar import check_stream
from testsupport.processes import Process, linked, load_average, start_gateway
from testsupport.redis_server import RedisServer, SentinelSet

SLOTS = 3
GATEWAYS = 3
LEASE = 2  # seconds: a killed gateway's slots are swept within the run, not after it
UPSTREAM = "vllm"
# Mostly good answers, so that the faults, not the scenarios, are what fails requests.
SCENARIOS = {k: 2 * v for k, v in GOOD.items()} | {
    k: 1 for k in ("fail", "error500", "overloaded", "stall", "truncate", "reset", "hangup")
}
WHOLE_BEHAVIOURS = {"read": 10, "leave-waiting": 2}
"""A non-streaming client has no frame to hang up at: it leaves after a time of its own."""
CAPPED = "agent"
CAP_OF_CAPPED = 1
CLIENTS = {
    # name: (its [clients] settings, its share of the requests)
    "frontend": ('priority = "interactive"', 3),
    "coder": ('priority = "normal"\nweight = 2', 4),
    CAPPED: (f'priority = "normal"\nmax_in_flight = {CAP_OF_CAPPED}', 2),
    "nightly": ('priority = "batch"', 2),
}
PROCESS_FAULTS = ("gateway killed", "stub killed")
STUB_ENDS = frozenset({"refused", "hangup", "complete", "cancelled", "reset", "truncated"})
"""The stub's lines that end a request it started (a refusal and a hangup at once)."""
CLIENT_TIMEOUT = 120.0  # a request still unanswered then never ends: a failed invariant
STUB_OPTIONS = ("--hold", "0.03", "--delay", "0.004", "--content-tokens", "10")
STUB_OUTAGE_MARGIN = 1.0
"""Seconds after the stub is back during which a good request may still fail of its outage
(an upstream connection made just before it was killed, noticed late)."""


def key(client: str) -> str:
    return f"chaos-key-{client}"


def config(stub_url: str, where: str, instance: str) -> str:
    """Every gateway's config: the same upstream, slots and clients (the cluster's rule), its
    own instance name; `where` says where Redis is. `aging` is short so the batch client's
    requests end within the run."""
    clients = "".join(
        f'\n[clients.{name}]\nkey_sha256 = "{hashlib.sha256(key(name).encode()).hexdigest()}"'
        f"\n{settings}\n"
        for name, (settings, _) in CLIENTS.items()
    )
    return f"""
[server]
ping_interval = 0.5

[upstreams.{UPSTREAM}]
url = "{stub_url}"
slots = {SLOTS}
idle_timeout = 1
queue_limit = 10000
cooldown = 0.5

[models.reasoning]
upstream = "{UPSTREAM}"

[queue]
aging = 10
{clients}
[cluster]
{where}
instance = "{instance}"
lease = {LEASE}
"""


# -- the plan: every request and fault, from the seed ---------------------------------------------


@dataclass(frozen=True)
class Plan:
    """One request as the seed decides it."""

    i: int
    scenario: str
    stream: bool
    behaviour: str
    client: str
    gateway: int  # the one it goes to, or the next one up if that one is down
    deltas: int  # cut-mid-stream: after this many deltas
    leave_after: float  # leave-waiting: seconds

    @property
    def user(self) -> str:
        """Its `metadata.user_id`, which the stub logs as `user`: its start line names it."""
        return f"r{self.i}"

    def body(self) -> dict[str, Any]:
        return {
            "model": "reasoning",
            "max_tokens": 40,
            "stream": self.stream,
            "messages": [{"role": "user", "content": f"{self.scenario} please #{self.i}"}],
            "metadata": {"user_id": self.user},
        }


def plan_requests(n: int, rng: random.Random) -> list[Plan]:
    shares = {name: share for name, (_, share) in CLIENTS.items()}
    plans = []
    for i in range(n):
        stream = rng.random() < 0.75
        plans.append(
            Plan(
                i=i,
                scenario=pick(rng, SCENARIOS),
                stream=stream,
                behaviour=pick(rng, BEHAVIOURS if stream else WHOLE_BEHAVIOURS),
                client=pick(rng, shares),
                gateway=rng.randrange(GATEWAYS),
                deltas=rng.randint(1, 6),
                leave_after=round(rng.uniform(0.05, 1.5), 2),
            )
        )
    return plans


@dataclass
class Fault:
    kind: str
    target: str
    seconds: float  # the scenario's own length: the pause, or the time down before a restart
    at: int  # fires once this many requests have ended (and its loop's previous fault is over)
    started: float = math.nan
    ended: float = math.nan  # resumed, answering, listening or linked again

    def overlaps(self, start: float, end: float) -> bool:
        return self.started <= end and start <= self.ended


def plan_faults(
    n: int, concurrency: int, redis_faults: tuple[str, ...], rng: random.Random
) -> dict[str, list[Fault]]:
    """Each loop's faults: one of each of its kinds first (in an order of the seed's), so even
    a short run has every kind, then kinds at random; at about evenly spread answer counts,
    while requests are still being sent (the last `concurrency` are all sent by the time the
    others ended), so that what a fault hit is seen serving again."""
    each = max(2, round(n / 250))
    sending = max(n - concurrency, n // 2)
    loops = {}
    for loop, kinds in {"processes": PROCESS_FAULTS, "redis": redis_faults}.items():
        order = rng.sample(kinds, len(kinds))
        order += [rng.choice(kinds) for _ in range(each - len(kinds))]
        faults = []
        for k, kind in enumerate(order):
            at = round(sending * (k + rng.uniform(0.5, 1.0)) / (each + 1))
            if kind == "gateway killed":
                target = f"gw-{rng.randrange(GATEWAYS)}"
            else:
                target = "stub" if kind == "stub killed" else "redis"
            low, high = (1.0, 3.0) if kind.endswith("paused") else (0.2, 1.5)
            faults.append(Fault(kind, target, round(rng.uniform(low, high), 1), at))
        loops[loop] = faults
    return loops


# -- the stack ------------------------------------------------------------------------------------


class Gateway:
    """One gateway, in a directory of its own: killed with SIGKILL, started again on its port.
    Each life's output goes to its own file at its end."""

    def __init__(self, workdir: Path, name: str, text: str) -> None:
        self.name = name
        self.home = workdir / name
        self.home.mkdir()
        self.text = text
        self.lives: list[Process] = []
        self.kills: list[tuple[float, float]] = []  # (killed, linked again), monotonic
        self.up = False
        self.port = 0
        self.url = ""

    def start(self) -> None:
        listen = f"tcp:{self.port}:interface=127.0.0.1"
        process, self.url = start_gateway(self.home, self.text, "--listen", listen)
        self.lives.append(process)
        self.port = int(self.url.rsplit(":", 1)[1])
        linked(self.url, timeout=60)
        self.up = True

    def kill(self) -> None:
        self.up = False
        self.kills.append((time.monotonic(), math.inf))
        process = self.lives[-1]
        process.popen.kill()
        process.popen.wait()
        self.keep_output(process)

    def revive(self) -> None:
        self.start()
        self.kills[-1] = (self.kills[-1][0], time.monotonic())

    def killed_during(self, start: float, end: float) -> bool:
        return any(killed <= end and start <= back for killed, back in self.kills)

    def keep_output(self, process: Process) -> None:
        life = self.lives.index(process)
        (self.home / f"life-{life}.log").write_text(process.all_output())

    def stop(self) -> int:
        """SIGTERM to the live one; its exit status."""
        process = self.lives[-1]
        status = process.stop()
        self.keep_output(process)
        return status

    def output(self) -> str:
        return "".join(process.all_output() for process in self.lives)


class Stub(Outages):
    """The one upstream, killed and started again on its port, with each life's own peak."""

    def __init__(self, workdir: Path) -> None:
        self.peaks: list[int] = []  # each life's own max_in_flight, read just before its end
        super().__init__(workdir, STUB_OPTIONS, name="stub")

    def kill(self) -> None:
        self.peaks.append(self.status()["max_in_flight"])
        super().kill()

    def down_during(self, start: float, end: float) -> bool:
        return self.overlaps(start, end, STUB_OUTAGE_MARGIN)

    def status(self) -> dict[str, Any]:
        return get_json(self.url.removesuffix("/v1") + "/stub/status")


def ask(port: int, *args: str) -> Any:
    """One command to the Redis (or Sentinel) on `port`, over a raw socket, its reply parsed:
    the bench never shares the gateways' client library, nor blocks on a paused server long."""
    command = f"*{len(args)}\r\n" + "".join(f"${len(a)}\r\n{a}\r\n" for a in args)
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(command.encode())
        return _reply(s.makefile("rb"))


def _reply(stream: Any) -> Any:
    line = stream.readline()
    kind, rest = line[:1], line[1:].rstrip(b"\r\n")
    if kind == b"*":
        return None if int(rest) < 0 else [_reply(stream) for _ in range(int(rest))]
    if kind == b"$":
        return None if int(rest) < 0 else stream.read(int(rest) + 2)[:-2].decode()
    if kind == b":":
        return int(rest)
    if kind == b"+":
        return rest.decode()
    raise RuntimeError(f"Redis answered {line!r}")


class SingleRedis:
    """One redis-server, paused or restarted empty (no persistence: a restart loses all)."""

    faults = ("redis paused", "redis restarted empty")

    def __init__(self) -> None:
        self.server = RedisServer()

    def start(self) -> None:
        self.server.start()

    def where(self) -> str:
        return f'redis_url = "{self.server.url}"'

    def primary(self) -> RedisServer:
        return self.server

    def inject(self, kind: str, seconds: float) -> None:
        if kind == "redis paused":
            self.server.pause()
            time.sleep(seconds)
            self.server.resume()
        else:
            self.server.stop()
            time.sleep(seconds)
            self.server.start()

    def close(self, workdir: Path) -> None:
        log = self.server.dir / "redis.log"
        if log.exists():
            shutil.copy(log, workdir / "redis.log")
        self.server.close()


class SentinelRedis:
    """A primary, its replica and a Sentinel that fails over half a second after it finds
    the primary silent (testsupport.redis_server.SentinelSet). The primary is paused (longer than
    that: the Sentinel promotes the replica, and turns the paused one into a replica when it
    wakes, discarding what it took meanwhile) or killed (the replica promoted, the killed one
    started again empty as the new primary's replica). Each fault ends with one primary and
    one replica in sync that the Sentinel counts on, so the next can fail over again."""

    faults = ("primary paused", "primary killed")
    HEALTHY_WITHIN = 60.0  # seconds: a failover, a full resync and the Sentinel's next look

    def __init__(self) -> None:
        self.set: SentinelSet | None = None

    def start(self) -> None:
        self.set = SentinelSet()
        self.healthy()

    @property
    def servers(self) -> tuple[RedisServer, RedisServer]:
        assert self.set is not None
        return self.set.primary, self.set.replica  # their roles at the start only

    def where(self) -> str:
        assert self.set is not None
        return f'sentinels = ["127.0.0.1:{self.set.port}"]\nsentinel_master = "{self.set.MASTER}"'

    def named(self) -> int:
        """The primary's port, as the Sentinel names it."""
        assert self.set is not None
        return int(ask(self.set.port, "SENTINEL", "get-master-addr-by-name", self.set.MASTER)[1])

    def primary(self) -> RedisServer:
        port = self.named()
        return next(server for server in self.servers if server.port == port)

    def inject(self, kind: str, seconds: float) -> None:
        old = self.primary()
        if kind == "primary paused":
            old.pause()
            time.sleep(seconds)
            old.resume()
        else:
            old.stop()
            deadline = time.monotonic() + self.HEALTHY_WITHIN
            while self._named_or_none() in (old.port, None):
                assert time.monotonic() < deadline, "the Sentinel promoted no replica"
                time.sleep(0.05)
            time.sleep(seconds)
            old.options = ("--replicaof", "127.0.0.1", str(self.named()))
            old.start()
        self.healthy()

    def _named_or_none(self) -> int | None:
        try:
            return self.named()
        except (OSError, RuntimeError):
            return None

    def healthy(self) -> None:
        """Wait (bounded) for a primary the Sentinel names, the other server its replica in
        sync, and the Sentinel counting on that replica (flags "slave" alone)."""
        assert self.set is not None
        deadline = time.monotonic() + self.HEALTHY_WITHIN
        while True:
            try:
                primary = self.primary()
                replica = next(server for server in self.servers if server is not primary)
                role = ask(replica.port, "ROLE")
                replicas = ask(self.set.port, "SENTINEL", "REPLICAS", self.set.MASTER)
                known = [dict(zip(r[::2], r[1::2], strict=True)) for r in replicas]
                if (
                    ask(primary.port, "ROLE")[0] == "master"
                    and role[0] == "slave"
                    and role[2] == primary.port
                    and role[3] == "connected"
                    and any(r["port"] == str(replica.port) and r["flags"] == "slave" for r in known)
                ):
                    return
            except (OSError, RuntimeError, StopIteration):
                pass  # a server down, paused or not yet known
            assert time.monotonic() < deadline, "no primary with a replica in sync"
            time.sleep(0.1)

    def close(self, workdir: Path) -> None:
        if self.set is None:
            return
        for n, server in enumerate(self.servers):
            log = server.dir / "redis.log"
            if log.exists():
                shutil.copy(log, workdir / f"redis-{n}.log")
        if (self.set.dir / "log").exists():
            shutil.copy(self.set.dir / "log", workdir / "sentinel.log")
        self.set.close()


class Stack:
    def __init__(self, workdir: Path, redis: SingleRedis | SentinelRedis) -> None:
        self.workdir = workdir
        self.redis = redis
        self.gateways: list[Gateway] = []
        self.stub: Stub | None = None

    def start(self) -> None:
        self.redis.start()
        self.stub = Stub(self.workdir)
        where = self.redis.where()
        self.gateways = [
            Gateway(self.workdir, f"gw-{g}", config(self.stub.url, where, f"gw-{g}"))
            for g in range(GATEWAYS)
        ]
        with ThreadPoolExecutor(GATEWAYS) as pool:  # each takes a second or two to start
            list(pool.map(Gateway.start, self.gateways))

    def inject(self, fault: Fault) -> None:
        """Blocks for the fault's length and until what it hit is back."""
        assert self.stub is not None
        fault.started = time.monotonic()
        if fault.kind == "gateway killed":
            gateway = self.gateways[int(fault.target.removeprefix("gw-"))]
            gateway.kill()
            time.sleep(fault.seconds)
            gateway.revive()
        elif fault.kind == "stub killed":
            self.stub.kill()
            time.sleep(fault.seconds)
            self.stub.revive()
        else:
            self.redis.inject(fault.kind, fault.seconds)
        fault.ended = time.monotonic()

    def at_rest(self) -> dict[str, Any]:
        """What is held or waiting anywhere, right now."""
        assert self.stub is not None
        state: dict[str, Any] = {}
        for gateway in self.gateways:
            status = get_json(gateway.url + "/llm/v1/status")
            upstream = status["upstreams"][UPSTREAM]
            state[f"{gateway.name}_in_use"] = upstream["in_use"]
            state[f"{gateway.name}_waiting"] = upstream["waiting"]
            # Requests still being handled (a client gone, its handler not yet unwound)
            state[f"{gateway.name}_in_flight"] = sum(
                surface["in_flight"] for surface in status["surfaces"].values()
            )
            capped = status["clients"][CAPPED]["in_flight"]
            state[f"{gateway.name}_{CAPPED}_in_flight"] = sum(capped.values())
        primary = self.redis.primary().port
        state["redis_slots"] = ask(primary, "HLEN", f"hgw:upstream:{UPSTREAM}:slots")
        state["redis_waiting"] = ask(primary, "HLEN", f"hgw:line:{UPSTREAM}:waiting")
        stub = self.stub.status()
        state["stub_in_flight"] = stub["in_flight"]
        state["stub_held_open"] = stub["held_open"]
        return state

    def settle(self, timeout: float) -> dict[str, Any]:
        """Wait (bounded) for every gateway's sweeps and releases to land: a killed gateway's
        leftovers go within its lease, and nobody is swept for SETTLE s after a (re)join."""
        deadline = time.monotonic() + timeout
        while any((state := self.at_rest()).values()) and time.monotonic() < deadline:
            time.sleep(0.1)
        return state

    def stop(self) -> list[int]:
        """Every process, whatever state the run left them in; the gateways' exit statuses."""
        statuses = []
        for gateway in self.gateways:
            if gateway.lives and gateway.lives[-1].popen.poll() is None:
                statuses.append(gateway.stop())
        if self.stub is not None:
            self.stub.process.stop()
        self.redis.close(self.workdir)
        return statuses


# -- the load -------------------------------------------------------------------------------------


@dataclass
class Done:
    """One request's end."""

    plan: Plan
    gateway: int
    sent: float
    ended: float
    waited: float | None  # to its first token (or its error), or to its whole answer
    outcome: str
    problem: str | None = None


def waited(result: Result, ended: float) -> float | None:
    if result.headers.get("content-type", "").startswith("text/event-stream"):
        first = result.first(lambda f: f.event not in ("queue", "ping"))
        return None if first is None else first.at - result.sent
    return None if result.status is None else ended - result.sent


def error_of(document: Any) -> str | None:
    """The error type of an Anthropic error document that names its reason, else None."""
    error = document.get("error") if isinstance(document, dict) else None
    if document.get("type") != "error" or not isinstance(error, dict):
        return None
    return error.get("type") if error.get("type") and error.get("message") else None


def outcome(plan: Plan, result: Result, killed: bool) -> tuple[str, str | None]:
    """What the request came to, and what is wrong with it if anything (regardless of the
    scenario: `judge` weighs that)."""
    if result.cut:
        return f"left ({plan.behaviour})", None
    if result.error is not None:
        return ("gateway killed", None) if killed else ("dropped", f"{result.error}")
    if not result.headers.get("content-type", "").startswith("text/event-stream"):
        try:
            document = json.loads(result.body)
        except ValueError:
            return "bad body", f"status {result.status}, a body that is not JSON"
        if result.status == 200:
            if document.get("type") == "message" and document.get("stop_reason"):
                return "answered", None
            return "bad body", f"a 200 that is not a whole message: {document}"
        kind = error_of(document)
        if kind is None or result.status is None or result.status < 500:
            return f"{result.status}", f"status {result.status}: {document}"
        return f"{result.status} {kind}", None
    frames = [f.data for f in result.frames]
    try:
        ending = check_stream(frames)
    except (AssertionError, TypeError, KeyError) as e:
        return ("gateway killed", None) if killed else ("bad stream", f"bad stream: {e}")
    if ending == "complete":
        return "answered", None
    kind = error_of({"type": "error", "error": frames[-1].get("error")})
    if kind is None:
        return "error frame", f"an error frame naming no reason: {frames[-1]}"
    return f"error frame {kind}", None


async def load(
    plans: list[Plan], stack: Stack, faults: dict[str, list[Fault]], concurrency: int
) -> list[Done]:
    """Every planned request, `concurrency` at a time, while each fault loop injects its
    faults as the answers reach their counts."""
    semaphore = asyncio.Semaphore(concurrency)
    done: list[Done] = []
    finished = asyncio.Event()

    async def one(plan: Plan) -> None:
        async with semaphore:
            g = next(
                (
                    (plan.gateway + k) % GATEWAYS
                    for k in range(GATEWAYS)
                    if stack.gateways[(plan.gateway + k) % GATEWAYS].up
                ),
                plan.gateway,
            )
            gateway = stack.gateways[g]
            sent = time.monotonic()
            call = request(
                gateway.url + "/llm/v1/messages",
                plan.body(),
                headers={"x-api-key": key(plan.client)},
                cut=cut_policy(plan.behaviour, plan.deltas),
                timeout=CLIENT_TIMEOUT,
            )
            try:
                if plan.behaviour == "leave-waiting":
                    result = await asyncio.wait_for(call, plan.leave_after)
                else:
                    result = await call
            except TimeoutError:
                result = Result(sent=sent, cut=True)
            ended = time.monotonic()
        kind, problem = outcome(plan, result, gateway.killed_during(sent, ended))
        done.append(Done(plan, g, sent, ended, waited(result, ended), kind, problem))

    async def inject(loop: list[Fault]) -> None:
        for fault in loop:
            while len(done) < fault.at and not finished.is_set():
                await asyncio.sleep(0.02)
            if finished.is_set():
                return
            await asyncio.to_thread(stack.inject, fault)

    injectors = [asyncio.create_task(inject(loop)) for loop in faults.values()]
    await asyncio.gather(*(one(plan) for plan in plans))
    finished.set()
    await asyncio.gather(*injectors)
    return done


# -- what the stub saw ----------------------------------------------------------------------------


def stub_figures(logs: list[Path], plans: dict[str, Plan]) -> dict[str, Any]:
    """From every life's log, in its order: the most requests running at once, in all and of
    the capped client, and every request's starts (by `user` and by prompt digest)."""
    peak = peak_capped = 0
    users: Counter[str] = Counter()
    digests: Counter[str] = Counter()
    starts_by_life = []
    for path in logs:
        running: dict[str, str] = {}  # the stub's request id -> its client
        starts = 0
        for line in path.read_text().splitlines():
            _, event, *fields = line.split()
            values = dict(f.split("=", 1) for f in fields if "=" in f)
            if event == "start":
                starts += 1
                plan = plans.get(values.get("user", ""))
                running[values["id"]] = plan.client if plan is not None else ""
                users[values.get("user", "")] += 1
                digests[values["prompt"]] += 1
                peak = max(peak, len(running))
                capped = sum(client == CAPPED for client in running.values())
                peak_capped = max(peak_capped, capped)
            elif event in STUB_ENDS:
                running.pop(values["id"], None)
        starts_by_life.append(starts)
    return {
        "peak_in_flight": peak,
        "peak_in_flight_of_capped_client": peak_capped,
        "starts_by_life": starts_by_life,
        "users_started_twice": sorted(u for u, count in users.items() if count > 1),
        "prompts_started_twice": sorted(d for d, count in digests.items() if count > 1),
        "starts_naming_no_request": users[""],
    }


# -- the verdict ----------------------------------------------------------------------------------


def judge(done: list[Done], stub: Stub) -> list[str]:
    """Beyond each request's own shape: a good scenario must be answered unless the stub or
    its gateway died under it; a bad one must not be."""
    problems = []
    for d in done:
        plan = d.plan
        if d.problem is not None or d.outcome.startswith("left") or d.outcome == "gateway killed":
            continue
        if plan.scenario in GOOD and d.outcome != "answered":
            if not stub.down_during(d.sent, d.ended):
                problems.append(
                    f"#{plan.i} {plan.scenario}/{plan.behaviour} via gw-{d.gateway}: "
                    f"{d.outcome} with the stub up ({d.sent:.2f}-{d.ended:.2f})"
                )
        elif plan.scenario not in GOOD and d.outcome == "answered":
            problems.append(f"#{plan.i} {plan.scenario} was answered")
    return problems


def in_flight_at_stop(output: str) -> int:
    """The requests a gateway's drain found in flight at SIGTERM (-1: it never drained)."""
    found = re.findall(r"draining: (\d+) requests in flight", output)
    return int(found[-1]) if found else -1


def waits(done: list[Done], faults: list[Fault]) -> dict[str, Any]:
    """Per kind of fault, the longest wait (seconds) of the requests whose wait overlapped one,
    and of those whose wait overlapped faults of that kind alone (a long wait overlaps several);
    beside them the longest and the median of the waits that overlapped none."""
    longest: defaultdict[str, dict[str, float]] = defaultdict(dict)
    calm = []
    for d in done:
        if d.waited is None:
            continue
        hit = {f.kind for f in faults if f.overlaps(d.sent, d.sent + d.waited)}
        for kind in hit:
            figures = longest[kind]
            figures["overlapping"] = max(figures.get("overlapping", 0.0), d.waited)
            if hit == {kind}:
                figures["alone"] = max(figures.get("alone", 0.0), d.waited)
        if not hit:
            calm.append(d.waited)
    out: dict[str, Any] = {
        kind: {which: round(s, 2) for which, s in longest[kind].items()} for kind in sorted(longest)
    }
    if calm:
        out["no fault"] = {
            "longest": round(max(calm), 2),
            "median": round(percentile(calm, 50), 3),
        }
    return out


@dataclass
class Report:
    requests: int
    seed: int
    redis: str = ""
    seconds: float = 0.0
    faults: dict[str, Any] = field(default_factory=dict)
    timeline: list[dict[str, Any]] = field(default_factory=list)  # seconds from the first request
    outcomes: dict[str, int] = field(default_factory=dict)
    outcomes_by_client: dict[str, dict[str, int]] = field(default_factory=dict)
    waits_s: dict[str, Any] = field(default_factory=dict)
    stub: dict[str, Any] = field(default_factory=dict)
    at_rest: dict[str, Any] = field(default_factory=dict)
    exit_statuses: list[int] = field(default_factory=list)
    # What each gateway's drain waited for at SIGTERM: nothing, once everything was at rest.
    in_flight_at_stop: list[int] = field(default_factory=list)
    unhandled_errors: int = 0  # "Unhandled" and "Traceback" in the gateways' logs
    load_average: dict[str, str] = field(default_factory=dict)
    unclean_endings: list[str] = field(default_factory=list)
    scenario_problems: list[str] = field(default_factory=list)
    invariants: dict[str, bool] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return bool(self.invariants) and all(self.invariants.values())


def run(n: int, concurrency: int, seed: int, workdir: Path, sentinel: bool = False) -> Report:
    """The whole run in `workdir`, which keeps every process's log (each gateway's lives
    under gw-N/, the stub's lives, Redis's); with `sentinel`, on a primary and replica that a
    Sentinel manages, whose faults are failovers."""
    redis = SentinelRedis() if sentinel else SingleRedis()
    kinds = (*PROCESS_FAULTS, *redis.faults)
    rng = random.Random(seed)
    plans = plan_requests(n, rng)
    faults = plan_faults(n, concurrency, redis.faults, random.Random(f"faults-{seed}"))
    every = [f for loop in faults.values() for f in loop]
    report = Report(requests=n, seed=seed, load_average={"before": load_average()})
    report.redis = "a primary, its replica and a Sentinel" if sentinel else "one redis-server"
    stack = Stack(workdir, redis)
    try:
        stack.start()
        started = time.monotonic()
        done = asyncio.run(load(plans, stack, faults, concurrency))
        report.seconds = round(time.monotonic() - started, 1)
        report.at_rest = stack.settle(timeout=SETTLE + 4 * LEASE + 20)
        assert stack.stub is not None
        stack.stub.peaks.append(stack.stub.status()["max_in_flight"])
    finally:
        report.exit_statuses = stack.stop()
    assert stack.stub is not None
    injected = [f for f in every if not math.isnan(f.ended)]
    report.faults = {
        kind: {
            "count": sum(f.kind == kind for f in injected),
            "seconds": [f.seconds for f in injected if f.kind == kind],
            "targets": dict(Counter(f.target for f in injected if f.kind == kind)),
        }
        for kind in kinds
    }
    report.outcomes = dict(Counter(d.outcome for d in done).most_common())
    by_client: defaultdict[str, Counter[str]] = defaultdict(Counter)
    for d in done:
        by_client[d.plan.client][d.outcome] += 1
    report.outcomes_by_client = {c: dict(by_client[c].most_common()) for c in CLIENTS}
    report.waits_s = waits(done, injected)
    report.stub = stub_figures(stack.stub.logs, {p.user: p for p in plans})
    report.stub["its_own_max_in_flight_by_life"] = stack.stub.peaks
    report.timeline = [
        {
            "kind": f.kind,
            "target": f.target,
            "seconds": f.seconds,
            "after_answers": f.at,
            "from_s": round(f.started - started, 2),
            "back_at_s": round(f.ended - started, 2),
        }
        for f in sorted(injected, key=lambda f: f.started)
    ]
    restarted_served = sum(
        d.outcome == "answered"
        and any(d.sent > back for _, back in stack.gateways[d.gateway].kills)
        for d in done
    )
    report.stub["answered_by_restarted_gateways"] = restarted_served
    logs = [g.output() for g in stack.gateways]
    report.in_flight_at_stop = [in_flight_at_stop(g.lives[-1].all_output()) for g in stack.gateways]
    report.unhandled_errors = sum(log.count("Traceback") + log.count("Unhandled") for log in logs)
    report.unclean_endings = [
        f"#{d.plan.i} {d.plan.scenario}/{d.plan.behaviour} via gw-{d.gateway}: {d.problem}"
        for d in done
        if d.problem is not None
    ]
    report.scenario_problems = judge(done, stack.stub)
    report.load_average["after"] = load_average()
    report.invariants = {
        f"the upstream never ran more than {SLOTS} at once": (
            max(report.stub["peak_in_flight"], *stack.stub.peaks) <= SLOTS
        ),
        f"{CAPPED} never ran more than {CAP_OF_CAPPED} at once": (
            report.stub["peak_in_flight_of_capped_client"] <= CAP_OF_CAPPED
        ),
        "no request started twice": not report.stub["users_started_twice"]
        and not report.stub["prompts_started_twice"]
        and not report.stub["starts_naming_no_request"],
        "every request ended: answered, left, a clean error or its gateway killed": (
            len(done) == n and not report.unclean_endings
        ),
        "good scenarios answered unless the stub died under them": not report.scenario_problems,
        "nothing held and nobody waiting at the end, on every gateway and in Redis": not any(
            report.at_rest.values()
        ),
        "no traceback in any gateway's log": report.unhandled_errors == 0,
        "every gateway stopped cleanly": report.exit_statuses == [0] * GATEWAYS,
        "every kind of fault injected, and what it hit served again": all(
            report.faults[kind]["count"] for kind in kinds
        )
        and restarted_served > 0
        and all(report.stub["starts_by_life"]),
    }
    with (workdir / "requests.jsonl").open("w") as out:
        for d in sorted(done, key=lambda d: d.plan.i):
            out.write(json.dumps(asdict(d)) + "\n")
    (workdir / "report.json").write_text(json.dumps(asdict(report), indent=2))
    return report
