"""Models loaded on demand, with real processes: `twistd homelab-gateway` starting and stopping
real `homelab-stub` servers (`--load-time`: the port opens only after it, as vLLM's does).

One gateway (`box`) serves the scenarios that leave it as they found it: two models that do not
fit together on gpu0 (swaps, alternating clients, a crash), one alone on gpu1 (a cold start,
idle unload), one that never gets healthy on gpu2. Killing and stopping the gateway itself
(adoption, no process left) and reading probes before anything ran take gateways of their own.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from homelab_gateway.core.residency import IDLE_GRACE
from testsupport.client import get_json
from testsupport.processes import (
    TWISTD,
    Process,
    free_port,
    start_gateway,
    start_stub,
    wait_until,
)

LOAD_TIME = 1.0  # the stubs' --load-time: seconds before their port opens
MIN_RESIDENT = 1.0
COOLDOWN = 2.0


def stub_argv(port: int, *options: str) -> list[str]:
    return [
        TWISTD,
        "--nodaemon",
        "--pidfile=",
        "homelab-stub",
        "--port",
        f"tcp:{port}:interface=127.0.0.1",
        *options,
    ]


def managed(name: str, box: str, memory: float, argv: list[str], port: int, **keys: Any) -> str:
    """A managed upstream `name` and its model `m{name}`."""
    extra = "".join(f"{key} = {json.dumps(value)}\n" for key, value in keys.items())
    return (
        f'[upstreams.{name}]\nurl = "http://127.0.0.1:{port}/v1"\nslots = 2\nbox = "{box}"\n'
        f"memory = {memory}\nstart = {json.dumps(argv)}\nstop_timeout = 5\n{extra}\n"
        f'[models.m{name}]\nupstream = "{name}"\n\n'
    )


def box_table(name: str, memory: float, min_resident: float = MIN_RESIDENT) -> str:
    return f"[boxes.{name}]\nmemory = {memory}\nmin_resident = {min_resident}\n\n"


@dataclass
class Gateway:
    process: Process
    url: str
    cwd: Path

    def status(self) -> dict[str, Any]:
        return get_json(self.url + "/llm/v1/status")

    def state(self, name: str) -> str:
        return self.status()["upstreams"][name]["state"]

    def wait_state(self, name: str, state: str, timeout: float = 20.0) -> None:
        wait_until(lambda: self.state(name) == state, timeout)

    def pid(self, name: str) -> int:
        """The pid its state file (run/NAME.json) names."""
        return json.loads((self.cwd / "run" / f"{name}.json").read_text())["pid"]

    def log(self) -> str:
        return self.process.output_so_far()

    def started(self, name: str | None = None) -> list[int]:
        """The pids of the servers it started (of `name` only, if given), from its log."""
        who = re.escape(name) if name is not None else r"\w+"
        return [int(p) for p in re.findall(rf"\b{who}: started .* as pid (\d+)", self.log())]


def group(pgid: int) -> list[int]:
    """The live processes of a process group (a zombie has exited: this machine's init may
    never reap it)."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            text = (entry / "stat").read_text()
        except OSError:
            continue
        state, _ppid, pgrp = text[text.rindex(")") + 2 :].split()[:3]
        if int(pgrp) == pgid and state not in "ZX":
            members.append(int(entry.name))
    return members


def kill_groups(pids: list[int]) -> None:
    """A test's last resort: nothing it started outlives it, whatever failed."""
    for pid in pids:
        with contextlib.suppress(OSError):
            os.killpg(pid, signal.SIGKILL)


def stop_leaves_nothing(gateway: Gateway) -> None:
    """SIGTERM the gateway: it exits cleanly, and every server it started is gone with its whole
    process group."""
    started = gateway.started()
    try:
        assert gateway.process.stopped_cleanly(), gateway.process.all_output()
        left = {pid: group(pid) for pid in started if group(pid)}
        assert not left, f"left running after the gateway's stop: {left}"
    finally:
        kill_groups(started)


# -- streams, read as raw lines with the time each arrived ------------------------------------


@dataclass
class Answer:
    status: int = 0
    lines: list[tuple[float, str]] = field(default_factory=list)  # (monotonic time, line)
    sent: float = 0.0
    done: float = 0.0

    @property
    def text(self) -> str:
        return "\n".join(line for _, line in self.lines)

    def states(self) -> list[str]:
        """The model states the queue frames said, each change once, in order."""
        states: list[str] = []
        for _, line in self.lines:
            queue = queue_of(line)
            state = queue.get("state") if queue is not None else None
            if state is not None and (not states or states[-1] != state):
                states.append(state)
        return states

    def first_answer_line(self) -> float:
        """When the first line of the answer itself (past the queue frames) arrived."""
        for at, line in self.lines:
            if line.startswith("data:") and queue_of(line) is None:
                data = json.loads(line[5:]) if line[5:].strip() != "[DONE]" else {}
                if data.get("type") not in ("response.created",):
                    return at
        raise AssertionError(f"no answer in:\n{self.text}")

    def events(self) -> list[str]:
        return [line[6:].strip() for _, line in self.lines if line.startswith("event:")]


def queue_of(line: str) -> dict[str, Any] | None:
    """The queue object of a queue frame's line on any surface: Messages' `event: queue` data,
    the OpenAI `: queue` comment, Responses' `response.queued`."""
    if line.startswith(": queue "):
        return json.loads(line[len(": queue ") :])
    if not line.startswith("data:") or line[5:].strip() == "[DONE]":
        return None
    data = json.loads(line[5:])
    if data.get("type") == "queue":
        return data
    if data.get("type") == "response.queued":
        return data["queue"]
    return None


SURFACES = {
    "messages": "/llm/v1/messages",
    "chat": "/llm/v1/chat/completions",
    "responses": "/llm/v1/responses",
}


def body(surface: str, model: str, text: str = "hi", stream: bool = True) -> dict[str, Any]:
    if surface == "responses":
        return {"model": model, "stream": stream, "input": text}
    request: dict[str, Any] = {
        "model": model,
        "stream": stream,
        "messages": [{"role": "user", "content": text}],
    }
    if surface == "messages":
        request["max_tokens"] = 4096
    return request


async def send(
    url: str,
    surface: str,
    model: str,
    text: str = "hi",
    stream: bool = True,
    into: Answer | None = None,
) -> Answer:
    """One request over HTTP/1.0 (no chunking: the body is the lines as sent); `into` is
    filled as the lines arrive, for a caller that watches the answer while it runs."""
    payload = json.dumps(body(surface, model, text, stream)).encode()
    host, port = url.removeprefix("http://").split(":")
    answer = into if into is not None else Answer()
    answer.sent = time.monotonic()
    reader, writer = await asyncio.open_connection(host, int(port), limit=2**20)
    try:
        writer.write(
            f"POST {SURFACES[surface]} HTTP/1.0\r\nHost: {host}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n".encode()
            + payload
        )
        answer.status = int((await reader.readline()).split()[1])
        while (line := await reader.readline()) not in (b"\r\n", b""):
            pass
        while line := await asyncio.wait_for(reader.readline(), 60):
            text_line = line.decode().rstrip("\r\n")
            if text_line:
                answer.lines.append((time.monotonic(), text_line))
    finally:
        writer.close()
    answer.done = time.monotonic()
    return answer


def completed(surface: str, answer: Answer) -> bool:
    """Its last event is the surface's end of an answer."""
    if surface == "chat":
        return bool(answer.lines) and answer.lines[-1][1] == "data: [DONE]"
    final = {"messages": "message_stop", "responses": "response.completed"}[surface]
    return answer.events()[-1:] == [final]


def post_json(url: str, document: dict[str, Any]) -> Any:
    request = urllib.request.Request(
        url, data=json.dumps(document).encode(), headers={"content-type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.load(response)


def readyz(url: str) -> dict[str, Any]:
    """/readyz's body, whether it answered 200 or 503."""
    try:
        return get_json(url + "/readyz")
    except urllib.error.HTTPError as e:
        return json.load(e)


async def until(condition: Any, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not await asyncio.to_thread(condition):
        assert time.monotonic() < deadline, f"condition not met within {timeout}s"
        await asyncio.sleep(0.02)


# -- the shared gateway -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def box(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    """gpu0 (10): a and b (6 each, never together); gpu1 (10): c (4, idle_unload 1); gpu2 (10):
    d, which never answers its health probe within its load_timeout; gpu3 (10): e, which
    serves `mshared` with u, always loaded; gpu4 (10): f, whose server never answers, serving
    `mflaky` with v, always loaded (u and v are one stub). Each test but those on gpu0 has a
    box to itself."""
    cwd = tmp_path_factory.mktemp("residency")
    fast = ("--load-time", str(LOAD_TIME), "--delay", "0.001")
    ports = {name: free_port() for name in "abcde"}
    always, always_url = start_stub(cwd, "--delay", "0.001")
    config = (
        box_table("gpu0", 10)
        + box_table("gpu1", 10)
        + box_table("gpu2", 10)
        + box_table("gpu3", 10)
        + managed("a", "gpu0", 6, stub_argv(ports["a"], *fast), ports["a"])
        + managed("b", "gpu0", 6, stub_argv(ports["b"], *fast), ports["b"])
        + managed("c", "gpu1", 4, stub_argv(ports["c"], *fast), ports["c"], idle_unload=1)
        + managed(
            "d",
            "gpu2",
            4,
            stub_argv(ports["d"], "--load-time", "30"),
            ports["d"],
            load_timeout=1,
            cooldown=COOLDOWN,
        )
        + managed("e", "gpu3", 4, stub_argv(ports["e"], *fast), ports["e"])
        + f'[upstreams.u]\nurl = "{always_url}"\nslots = 1\n\n'
        + '[models.mshared]\nupstreams = ["u", "e"]\n\n'
        + box_table("gpu4", 10)
        + managed("f", "gpu4", 4, ["sleep", "600"], free_port(), load_timeout=1, cooldown=30)
        + f'[upstreams.v]\nurl = "{always_url}"\nslots = 1\n\n'
        + '[models.mflaky]\nupstreams = ["v", "f"]\n\n'
    )
    try:
        process, url = start_gateway(cwd, config)
        gateway = Gateway(process, url, cwd)
        try:
            yield gateway
        finally:
            stop_leaves_nothing(gateway)
    finally:
        always.stop()


def test_a_cold_start_says_unloaded_then_loading_and_answers_then_idle_unload(box: Gateway) -> None:
    """A stream for a model nothing runs hears `unloaded`, then `loading` once its server is
    started, then its answer; the status shows it loaded and its memory used; `idle_unload`
    stops it about that long after its last answer."""
    box.wait_state("c", "unloaded")
    answer = asyncio.run(send(box.url, "messages", "mc"))
    assert answer.status == 200
    assert completed("messages", answer), answer.text
    assert answer.states() == ["unloaded", "loading"], answer.text
    status = box.status()
    pid = box.pid("c")
    assert pid in box.started("c")
    # The answer ended: it is loaded, for at most idle_unload (1 s) plus a turn from now.
    assert status["upstreams"]["c"]["state"] == "loaded"
    assert status["boxes"]["gpu1"] == {"memory": 10, "used": 4, "loaded": ["c"]}
    assert readyz(box.url)["upstreams"]["c"]["ready"], "ready at once, not at the next probe"

    box.wait_state("c", "unloaded", timeout=10)
    idle_for = time.monotonic() - answer.done
    assert 0.9 <= idle_for < 6, idle_for
    assert not group(pid), "its server is gone"
    assert box.status()["boxes"]["gpu1"] == {"memory": 10, "used": 0, "loaded": []}
    assert "c: unloading (idle for 1s)" in box.log()


def test_a_swap_waits_for_the_running_stream_and_every_surface_hears_the_state(
    box: Gateway,
) -> None:
    """A long stream on a runs while streams for b (which does not fit beside a) wait on the
    three surfaces: each hears `unloaded` while a still runs, then `loading`; a's stream ends
    in full before b is even started, then b answers all three."""

    async def scenario() -> tuple[Answer, dict[str, Answer]]:
        long = asyncio.create_task(send(box.url, "messages", "ma", "long"))
        await until(lambda: box.state("a") == "loaded" and box.state("b") == "unloaded")
        await until(lambda: box.status()["upstreams"]["a"]["in_use"] == 1)
        waiting = {s: asyncio.create_task(send(box.url, s, "mb")) for s in SURFACES}
        answers = {s: await task for s, task in waiting.items()}
        return await long, answers

    long, answers = asyncio.run(scenario())
    assert long.status == 200
    assert completed("messages", long), long.text[-500:]
    assert long.text.count("content_block_delta") >= 2000, "the whole long answer"
    for surface, answer in answers.items():
        assert answer.status == 200, (surface, answer.text)
        assert completed(surface, answer), (surface, answer.text)
        assert answer.states() == ["unloaded", "loading"], (surface, answer.text)
        assert answer.first_answer_line() > long.done - 0.05, surface
    assert box.state("b") == "loaded"
    assert box.status()["boxes"]["gpu0"] == {"memory": 10, "used": 6, "loaded": ["b"]}


def test_two_clients_alternating_two_models_are_both_served_without_thrash(box: Gateway) -> None:
    """Two clients, concurrently, each call one model several times in a row, then the other:
    one a a a b b b, the other b b b a a a. A model with work keeps its memory for
    min_resident (1 s, longer than a run of three short requests here) and a load serves every
    request waiting for its model, so the box loads a, then b (both clients' b runs), then a:
    3 loads (2 if b was loaded already: its run goes first), one more allowed for a machine so
    slow that a run outlasts min_resident. A swapper serving in arrival order would load at
    nearly every request (12)."""
    run = 3
    before = len(box.started("a")) + len(box.started("b"))

    async def client(models: list[str]) -> list[Answer]:
        return [await send(box.url, "chat", model, stream=False) for model in models]

    async def both() -> list[list[Answer]]:
        return await asyncio.gather(
            client(["ma"] * run + ["mb"] * run), client(["mb"] * run + ["ma"] * run)
        )

    started = time.monotonic()
    results = asyncio.run(both())
    took = time.monotonic() - started
    loads = len(box.started("a")) + len(box.started("b")) - before
    for answers in results:
        assert [a.status for a in answers] == [200] * 2 * run, [a.text for a in answers]
    assert 2 <= loads <= 4, (loads, took)
    # Neither is starved: a request waits at most for the model in its place's load, its
    # min_resident (or IDLE_GRACE once it has no work), a drain, a stop and its own load.
    load_seconds = [float(s) for s in re.findall(r"\b[ab]: loaded in ([\d.]+)s", box.log())]
    swap = max(MIN_RESIDENT, IDLE_GRACE) + 2 * max(load_seconds) + 3
    waits = [a.done - a.sent for answers in results for a in answers]
    assert max(waits) < swap, (waits, swap)


def test_a_crashed_server_fails_its_stream_and_the_next_request_loads_it_again(
    box: Gateway,
) -> None:
    """The loaded server's whole group is killed while it streams: the stream ends with the
    surface's error event, and the next request starts the server again and is answered; its
    queue frames' estimate is the previous load's time."""

    async def scenario() -> tuple[Answer, int]:
        running = Answer()
        long = asyncio.create_task(send(box.url, "messages", "ma", "long", into=running))
        await until(lambda: "text_delta" in running.text)
        pid = box.pid("a")
        os.killpg(pid, signal.SIGKILL)
        return await long, pid

    cut, pid = asyncio.run(scenario())
    assert cut.status == 200
    assert cut.events()[-1] == "error", cut.text[-500:]
    assert "message_stop" not in cut.events()
    again = asyncio.run(send(box.url, "messages", "ma"))
    assert again.status == 200, again.text
    assert completed("messages", again), again.text
    # Its wait, told while unloaded, is a's last load: learned, not guessed.
    first = next(q for _, line in again.lines if (q := queue_of(line)) is not None)
    loaded_in = float(re.findall(r"\ba: loaded in ([\d.]+)s", box.log())[-2])
    assert first["state"] == "unloaded"
    assert abs(first["estimated_wait_s"] - loaded_in) <= 0.1, (first, loaded_in)
    assert box.pid("a") != pid
    assert box.state("a") == "loaded"


def test_a_server_never_healthy_fails_its_waiter_then_cools_down(box: Gateway) -> None:
    """d's server never answers within its load_timeout (1 s): started twice, then its waiter
    gets a 503 naming it, it reads `failed`, and a new request is refused at once until the
    cool-down ends; the log keeps the server's last lines."""
    box.wait_state("d", "unloaded", timeout=COOLDOWN + 5)
    before = len(box.started("d"))
    failed = asyncio.run(send(box.url, "messages", "md", stream=False))
    assert failed.status == 503, failed.text
    error = json.loads(failed.text)["error"]
    assert error["type"] == "overloaded_error"
    assert "upstream d failed to start twice" in error["message"]
    assert len(box.started("d")) - before == 2
    assert box.state("d") == "failed"
    assert readyz(box.url)["upstreams"]["d"] == {"ready": False, "detail": "failed"}
    refused = asyncio.run(send(box.url, "chat", "md", stream=False))
    assert refused.status == 503, refused.text
    assert refused.done - refused.sent < 0.5 * COOLDOWN
    assert len(box.started("d")) - before == 2, "refused without a start"
    log = box.log()
    assert "d: not healthy within 1s; its last lines:" in log
    # The stub's own start-up lines, under the upstream's name, are among them.
    assert re.search(r"d: .*homelab-stub|d: .*twistd", log), log[-2000:]
    box.wait_state("d", "unloaded", timeout=COOLDOWN + 5)  # tried again by the next request


def test_a_managed_replica_beside_an_always_loaded_one_is_loaded_when_that_one_is_full(
    box: Gateway,
) -> None:
    """`mshared` is served by u (always loaded, one slot) and e (managed): a request finds u
    free and loads nothing; one that must wait while u streams loads e, and is served there.
    Its queue frames carry no state: its model is loaded (on u), only not free."""
    box.wait_state("e", "unloaded")
    alone = asyncio.run(send(box.url, "messages", "mshared"))
    assert completed("messages", alone), alone.text
    assert box.started("e") == [] and box.state("e") == "unloaded"

    async def scenario() -> tuple[Answer, Answer]:
        long = asyncio.create_task(send(box.url, "messages", "mshared", "long"))
        await until(lambda: box.status()["upstreams"]["u"]["in_use"] == 1)
        waiter = await send(box.url, "messages", "mshared")
        return await long, waiter

    long, waiter = asyncio.run(scenario())
    assert completed("messages", long), long.text[-500:]
    assert completed("messages", waiter), waiter.text
    assert waiter.states() == [], waiter.text
    assert waiter.done < long.done, "served by e while u still streamed"
    assert box.state("e") == "loaded"
    assert len(box.started("e")) == 1


def test_a_managed_replica_that_fails_leaves_its_models_waiters_to_the_loaded_one(
    box: Gateway,
) -> None:
    """`mflaky` is served by v (always loaded, one slot) and f, managed, whose server never
    answers. A request waits while v's slot is held: f is loaded for it and fails twice; the
    waiter is not failed with f (v still serves its model), and v answers it once free."""

    async def scenario() -> Answer:
        stall = asyncio.create_task(send(box.url, "messages", "mflaky", "stall"))
        await until(lambda: box.status()["upstreams"]["v"]["in_use"] == 1)
        waiter = asyncio.create_task(send(box.url, "messages", "mflaky"))
        await until(lambda: box.state("f") == "failed")
        assert not waiter.done(), waiter.result().text
        stall.cancel()  # the client leaves: v's slot is free
        return await waiter

    answer = asyncio.run(scenario())
    assert answer.status == 200, answer.text
    assert completed("messages", answer), answer.text
    assert len(box.started("f")) == 2


def test_probes_listings_and_status_reads_load_nothing_and_a_stop_ends_a_load(
    tmp_path: Path,
) -> None:
    """With everything unloaded, model listings, status reads, readiness probes and a token
    count start no server: a managed upstream not loaded is ready. Then a request starts one
    that takes long to load: the gateway's SIGTERM fails the waiting stream and leaves no
    process behind."""
    port = free_port()
    argv = stub_argv(port, "--load-time", "30")
    config = box_table("gpu0", 10) + managed("a", "gpu0", 6, argv, port)
    process, url = start_gateway(tmp_path, config)
    gateway = Gateway(process, url, tmp_path)
    try:
        models = get_json(url + "/llm/v1/models")
        assert "ma" in [m["id"] for m in models["data"]]
        assert get_json(url + "/llm/v1/models/ma")["id"] == "ma"
        assert readyz(url) == {
            "status": "ready",
            "upstreams": {"a": {"ready": True, "detail": "unloaded"}},
        }
        assert get_json(url + "/llm/v1/status")["boxes"]["gpu0"]["used"] == 0
        get_json(url + "/healthz")
        count = post_json(url + "/llm/v1/messages/count_tokens", body("messages", "ma"))
        assert count["input_tokens"] > 0
        assert gateway.state("a") == "unloaded"
        assert gateway.started() == []
        assert not (tmp_path / "run" / "a.json").exists()

        async def stopped_while_loading() -> Answer:
            waiting = asyncio.create_task(send(url, "messages", "ma"))
            await until(lambda: gateway.state("a") == "loading")
            process.signal(signal.SIGTERM)
            return await waiting

        answer = asyncio.run(stopped_while_loading())
        assert answer.states() == ["unloaded", "loading"], answer.text
        assert answer.events()[-1] == "error", answer.text
        assert len(gateway.started("a")) == 1
    finally:
        stop_leaves_nothing(gateway)
    assert not (tmp_path / "run" / "a.json").exists()


def test_a_reload_that_changes_start_restarts_the_server_once_it_has_nothing_running(
    tmp_path: Path,
) -> None:
    """SIGHUP with a new `start` for a loaded, idle upstream: its server is stopped, and the
    next request starts the new command."""
    port = free_port()

    def config(*options: str) -> str:
        argv = stub_argv(port, "--load-time", "0.5", *options)
        return box_table("gpu0", 10) + managed("a", "gpu0", 6, argv, port)

    process, url = start_gateway(tmp_path, config())
    gateway = Gateway(process, url, tmp_path)
    try:
        assert completed("messages", asyncio.run(send(url, "messages", "ma")))
        old = gateway.pid("a")
        (tmp_path / "gateway.toml").write_text(config("--content-tokens", "3"))
        process.signal(signal.SIGHUP)
        process.wait_for_line(r"a: stopping, for its new start command")
        gateway.wait_state("a", "unloaded")
        assert not group(old)
        answer = asyncio.run(send(url, "messages", "ma"))
        assert answer.states() == ["unloaded", "loading"], answer.text
        assert answer.text.count("text_delta") == 3, "the new command's answer"
        assert gateway.started("a") == [old, gateway.pid("a")]
    finally:
        stop_leaves_nothing(gateway)


def test_a_new_gateway_adopts_the_server_a_killed_one_left_and_its_stop_leaves_nothing(
    tmp_path: Path,
) -> None:
    """SIGKILL the gateway while its server is loaded: the server (its own session) lives on,
    and a new gateway in the same directory adopts it: no second process, an answer at once.
    That gateway's SIGTERM then stops it, whole group: the server's shell and its child."""
    port = free_port()
    stub = " ".join(stub_argv(port, "--load-time", "3"))
    argv = ["sh", "-c", f"sleep 600 & exec {stub}"]  # a group of two, as vLLM's engine
    config = box_table("gpu0", 10) + managed("a", "gpu0", 6, argv, port)
    process, url = start_gateway(tmp_path, config)
    first = Gateway(process, url, tmp_path)
    pids: list[int] = []
    try:
        answer = asyncio.run(send(url, "messages", "ma"))
        assert answer.status == 200, answer.text
        pid = first.pid("a")
        pids.append(pid)
        assert first.started("a") == [pid]
        assert len(group(pid)) == 2, "the stub and its sibling sleep"
        process.signal(signal.SIGKILL)
        process.popen.wait(10)
        assert len(group(pid)) == 2, "the server outlives a killed gateway"

        process, url = start_gateway(tmp_path, config)
        second = Gateway(process, url, tmp_path)
        assert f"a: adopting pid {pid}, left by an earlier run" in second.log()
        answer = asyncio.run(send(url, "messages", "ma"))
        assert answer.status == 200, answer.text
        assert answer.done - answer.sent < 2.0, "answered at once: no load of 3 s"
        assert second.started() == [], "no second server"
        assert second.pid("a") == pid
        assert second.state("a") == "loaded"
        stop_leaves_nothing(second)
        assert not group(pid)
        assert not (tmp_path / "run" / "a.json").exists()
    finally:
        kill_groups(pids)
        if process.popen.poll() is None:
            process.stop()
