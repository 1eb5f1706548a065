"""Two real gateway processes (`twistd homelab-gateway`) sharing one real redis-server and one
stub upstream with 2 slots: the cap is the cluster's, the line is one, and a gateway killed
with SIGKILL loses nothing for the other."""

from __future__ import annotations

import json
import re
import signal
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from testsupport.processes import Process, start_gateway, start_stub, wait_until
from testsupport.redis_server import RedisServer

LEASE = 2
GRACE = 4  # seconds Redis may be away before waiters get 529


def config(stub_url: str, redis_url: str, instance: str) -> str:
    return f"""
[upstreams.vllm]
url = "{stub_url}"
slots = 2

[models.reasoning]
upstream = "vllm"

[cluster]
redis_url = "{redis_url}"
instance = "{instance}"
lease = {LEASE}
outage_grace = {GRACE}
"""


def get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.load(response)


class Stream(threading.Thread):
    """One streaming request read to its end on a thread: its status, its queue positions and
    whether the answer ended with message_stop."""

    def __init__(
        self,
        gateway: str,
        prompt: str,
        max_tokens: int = 64,
        headers: dict[str, str] | None = None,
        stream: bool = True,
    ) -> None:
        super().__init__(daemon=True)
        self.gateway, self.prompt, self.max_tokens = gateway, prompt, max_tokens
        self.headers, self.stream = headers or {}, stream
        self.body: Any = None
        self.status: int | None = None
        self.positions: list[int] = []
        self.events: list[str] = []
        self.error: Exception | None = None
        self.retry_after: str | None = None
        self.start()

    def run(self) -> None:
        body = {
            "model": "reasoning",
            "max_tokens": self.max_tokens,
            "stream": self.stream,
            "messages": [{"role": "user", "content": self.prompt}],
        }
        request = urllib.request.Request(
            self.gateway + "/llm/v1/messages",
            data=json.dumps(body).encode(),
            headers={"content-type": "application/json", **self.headers},
        )
        try:
            with urllib.request.urlopen(request, timeout=120) as response:
                self.retry_after = response.headers["retry-after"]
                self.status = response.status
                if not self.stream:
                    self.body = json.load(response)
                    return
                event = None
                for raw in response:
                    line = raw.decode().rstrip("\n")
                    if line.startswith("event: "):
                        event = line[7:]
                        self.events.append(event)
                    elif line.startswith("data: ") and event == "queue":
                        self.positions.append(json.loads(line[6:])["position"])
        except urllib.error.HTTPError as e:
            self.status, self.retry_after, self.error = e.code, e.headers["retry-after"], e
        except Exception as e:  # a dead gateway's client sees its connection end
            self.error = e

    @property
    def completed(self) -> bool:
        return self.status == 200 and self.events[-1:] == ["message_stop"]


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[dict[str, Any]]:
    redis = RedisServer()
    redis.start()
    stub, stub_url = start_stub(
        tmp_path, "--delay", "0.02", "--content-tokens", "30", "--log", str(tmp_path / "stub.log")
    )
    gateways: list[Process] = []
    urls = []
    for name in ("gw-a", "gw-b"):
        cwd = tmp_path / name
        cwd.mkdir()
        process, url = start_gateway(cwd, config(stub_url, redis.url, name))
        gateways.append(process)
        urls.append(url)
    wait_until(lambda: all(get(u + "/llm/v1/status")["cluster"]["redis"] == "up" for u in urls))
    yield {
        "urls": urls,
        "gateways": gateways,
        "stub": stub,
        "stub_url": stub_url,
        "stub_log": tmp_path / "stub.log",
        "redis": redis,
    }
    for process in gateways:
        if process.popen.poll() is None:
            assert process.stopped_cleanly(), process.all_output()
    stub.stop()
    redis.close()


def stub_stats(stub_url: str) -> dict[str, Any]:
    return get(stub_url.removesuffix("/v1") + "/stub/status")


def waiting(url: str) -> int:
    return int(get(url + "/llm/v1/status")["upstreams"]["vllm"]["waiting"])


def test_twenty_streams_over_two_gateways_never_pass_two_slots_and_wait_in_one_line(
    cluster: dict[str, Any],
) -> None:
    a, b = cluster["urls"]
    streams = [Stream((a, b)[i % 2], f"hello {i}") for i in range(20)]
    for stream in streams:
        stream.join(120)
    assert all(s.completed for s in streams), [(s.status, s.events[-1:], s.error) for s in streams]
    stats = stub_stats(cluster["stub_url"])
    assert stats["max_in_flight"] <= 2, stats
    assert stats["completed"] == 20, stats
    for stream in streams:  # one client, one class: a FIFO, so a position only falls
        assert stream.positions == sorted(stream.positions, reverse=True), stream.positions
        if stream.positions:
            assert stream.positions[-1] == 1, stream.positions
    first = sorted(s.positions[0] for s in streams if s.positions)
    # Positions count the waiters of both gateways: one gateway alone never had 10 waiting.
    assert first[-1] > 10, first
    assert len(set(first)) == len(first), first
    for url in (a, b):  # a slot is released just after its answer's last byte
        wait_until(lambda url=url: idle(url))
        with urllib.request.urlopen(url + "/metrics", timeout=5) as response:
            assert "homelab_gateway_cluster_up 1.0" in response.read().decode()


def test_claude_codes_session_header_over_the_shared_line(cluster: dict[str, Any]) -> None:
    """Claude Code sends `X-Claude-Code-Session-Id` on every request: over the shared line it
    is the session's digest that goes into Redis, whether the request streams, waits or not."""
    a, b = cluster["urls"]
    session = {"x-claude-code-session-id": "9c1d7d2e-6f3a-4b8e-a1f0-" + "0" * 12}
    streams = [Stream((a, b)[i % 2], f"hello {i}", headers=session) for i in range(6)]
    whole = Stream(a, "hello", headers=session, stream=False)
    for stream in (*streams, whole):
        stream.join(120)
    assert all(s.completed for s in streams), [(s.status, s.events[-1:], s.error) for s in streams]
    assert whole.status == 200 and whole.body["type"] == "message", (whole.status, whole.error)
    for url in (a, b):
        wait_until(lambda url=url: idle(url))


def test_a_gateway_killed_with_slots_and_waiters_frees_them_within_the_lease(
    cluster: dict[str, Any],
) -> None:
    a, b = cluster["urls"]
    stub_url, dead = cluster["stub_url"], cluster["gateways"][1]
    # Both slots held by gateway b's streams, which stall until their client leaves.
    holders = [Stream(b, "stall"), Stream(b, "stall")]
    wait_until(lambda: stub_stats(stub_url)["in_flight"] == 2)
    doomed = [Stream(b, "hello b1"), Stream(b, "hello b2")]
    wait_until(lambda: waiting(a) == 2)
    behind = [Stream(a, "hello a1"), Stream(a, "hello a2")]
    wait_until(lambda: waiting(a) == 4)
    dead.signal(signal.SIGKILL)
    dead.popen.wait(10)
    killed = time.monotonic()
    # The stub sees the dead gateway's requests end (their connections closed with the
    # process), and once its lease expires the survivor's waiters take both slots.
    wait_until(lambda: stub_stats(stub_url)["cancelled"] == 2)
    for stream in behind:
        stream.join(LEASE + 30)
        assert stream.completed, (stream.status, stream.events[-3:], stream.error)
    assert time.monotonic() - killed < LEASE + 20  # the lease, not a request timeout
    for stream in (*holders, *doomed):
        stream.join(10)
        assert not stream.completed
    wait_until(lambda: waiting(a) == 0)
    stats = stub_stats(stub_url)
    assert stats["max_in_flight"] <= 2, stats
    assert stats["completed"] == 2, stats


def idle(url: str) -> bool:
    upstream = get(url + "/llm/v1/status")["upstreams"]["vllm"]
    return (upstream["in_use"], upstream["waiting"]) == (0, 0)


def ready(url: str) -> int:
    try:
        with urllib.request.urlopen(url + "/readyz", timeout=5) as response:
            return response.status
    except urllib.error.HTTPError as e:
        return e.code


def starts(log: Path) -> list[str]:
    """The prompts the stub began to answer, in order, from its own log."""
    return re.findall(r" start id=\S+ .*prompt=(\S+)", log.read_text())


@pytest.mark.parametrize("outage", ["paused for 2 s", "restarted empty after 1 s"])
def test_redis_away_mid_load_loses_nobodys_place(cluster: dict[str, Any], outage: str) -> None:
    """Two slots, two answers running and eight waiting over both gateways: Redis goes away
    and comes back, and all ten are answered, the upstream never above two, none twice."""
    a, b = cluster["urls"]
    stub_url, redis = cluster["stub_url"], cluster["redis"]
    streams = [Stream((a, b)[i % 2], f"hello {outage} {i}", max_tokens=60) for i in range(2)]
    wait_until(lambda: stub_stats(stub_url)["in_flight"] == 2)
    streams += [Stream((a, b)[i % 2], f"hello {outage} {i}", max_tokens=60) for i in range(2, 10)]
    wait_until(lambda: waiting(a) == 8 and waiting(b) == 8)
    if outage.startswith("paused"):
        redis.pause()
        time.sleep(2)  # the outage itself: its length is the scenario
        redis.resume()
        for gateway in cluster["gateways"]:  # 2 s is twice what a command may wait (lease/2)
            gateway.wait_for_line(r"lost the shared line .*waiters keep their place")
    else:
        redis.stop()
        time.sleep(1)
        redis.start()  # on the same port, with none of its data
    for gateway in cluster["gateways"]:
        gateway.wait_for_line(r"the shared line at .* is back after")
    for stream in streams:
        stream.join(90)
        assert stream.completed, (stream.prompt, stream.status, stream.events[-3:], stream.error)
    assert stub_stats(stub_url)["max_in_flight"] <= 2
    started = starts(cluster["stub_log"])
    assert len(started) == len(set(started)) == 10, started
    for url in (a, b):
        wait_until(lambda url=url: idle(url))
    assert redis.command("HLEN", "hgw:upstream:vllm:slots") == 0  # nothing left held
    assert redis.command("HLEN", "hgw:line:vllm:waiting") == 0


def test_past_the_outage_grace_waiters_get_529_and_new_requests_too(
    cluster: dict[str, Any],
) -> None:
    a, b = cluster["urls"]
    stub_url, redis = cluster["stub_url"], cluster["redis"]
    running = [Stream(a, "long", max_tokens=150), Stream(b, "long", max_tokens=150)]
    wait_until(lambda: stub_stats(stub_url)["in_flight"] == 2)
    queued = Stream(b, "hello queued")
    wait_until(lambda: waiting(a) == 1)
    redis.stop()
    wait_until(lambda: all(get(u + "/llm/v1/status")["cluster"]["redis"] == "down" for u in (a, b)))
    assert (ready(a), ready(b)) == (503, 503)
    queued.join(GRACE + 20)  # waits out the grace, then hears why
    assert queued.status == 200 and "error" in queued.events and not queued.completed
    # a's grace is timed from a's own loss, which may come a moment after b's
    cluster["gateways"][0].wait_for_line(r"has been out of reach for")
    refused = Stream(a, "hello refused")
    refused.join(20)
    assert (refused.status, refused.retry_after) == (529, "5"), refused.error
    redis.start()
    wait_until(lambda: all(get(u + "/llm/v1/status")["cluster"]["redis"] == "up" for u in (a, b)))
    for stream in running:  # they held their slots through the outage and ran to the end
        stream.join(60)
        assert stream.completed, (stream.status, stream.events[-3:], stream.error)
    after = [Stream((a, b)[i % 2], f"hello after {i}") for i in range(4)]
    for stream in after:
        stream.join(60)
        assert stream.completed, (stream.status, stream.events[-3:], stream.error)
    assert stub_stats(stub_url)["max_in_flight"] <= 2
    assert (ready(a), ready(b)) == (200, 200)
    for url in (a, b):
        wait_until(lambda url=url: idle(url))
    assert redis.command("HLEN", "hgw:upstream:vllm:slots") == 0  # nothing left held
