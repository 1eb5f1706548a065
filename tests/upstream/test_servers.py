"""Managed servers: real processes started, probed, stopped as a group, and adopted; sleep mode
against a stubbed vLLM."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections import deque
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from treq.client import HTTPClient
from treq.testing import StubTreq
from twisted.internet import reactor
from twisted.internet.defer import CancelledError
from twisted.internet.error import ProcessDone
from twisted.internet.task import Clock
from twisted.python.failure import Failure
from twisted.trial.unittest import TestCase
from twisted.web.client import Agent, HTTPConnectionPool
from twisted.web.resource import Resource
from twisted.web.server import Request

from homelab_gateway.upstream.processes import LINE_LIMIT, Output
from homelab_gateway.upstream.servers import (
    ManagedServer,
    ServerFailed,
    SleepingServer,
)
from tests.surfaces.test_proxy import async_test
from testsupport.helpers import capture_log, wait_for
from testsupport.processes import TWISTD, Process


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stub_argv(port: int, *options: str) -> list[str]:
    return [TWISTD, "--nodaemon", "--pidfile=", "homelab-stub", "--port", str(port), *options]


def gone(pid: int) -> bool:
    """No process runs as `pid` (a zombie has exited: this machine's init may never reap it)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return text[text.rindex(")") + 2] in "ZX"


def always(answer: str) -> Callable[[], Awaitable[str]]:
    async def probe() -> str:
        return answer

    return probe


def sh(script: str) -> list[str]:
    return ["sh", "-c", script]


def client() -> HTTPClient:
    """A treq client whose connections close after each answer: none left for the next test."""
    return HTTPClient(Agent(reactor, pool=HTTPConnectionPool(reactor, persistent=False)))


def health_probe(client: HTTPClient, url: str) -> Any:
    """GET {root}/health, as the kinds' probes ask it (the gateway asks through the upstream's
    own client and kind, `line.residency`): 200 is ready, 503 loading, no answer down."""
    health = url.removesuffix("/v1") + "/health"

    async def probe() -> str:
        try:
            response = await client.get(health)
            await response.content()
        except CancelledError:
            raise
        except Exception:
            return "down"
        return {200: "ready", 503: "loading"}.get(response.code, "down")

    return probe


class Managed(TestCase):
    def setUp(self) -> None:
        self.dir = Path(tempfile.mkdtemp())
        self.addCleanup(shutil.rmtree, self.dir)
        self.states: list[tuple[str, ServerFailed | None]] = []

    def server(self, argv: list[str], probe: Any = None, **options: Any) -> ManagedServer:
        url = options.pop("url", "http://127.0.0.1:9/v1")
        server = ManagedServer(
            "coder",
            argv,
            url,
            probe or health_probe(client(), url),
            lambda state, failure: self.states.append((state, failure)),
            reactor=reactor,
            state_file=self.dir / "run" / "coder.json",
            **{"stop_timeout": 5.0, "poll_interval": 0.1, **options},
        )
        self.addCleanup(self.leave_nothing, server)
        return server

    async def leave_nothing(self, server: ManagedServer) -> None:
        pid = server.pid
        await server.unload()
        if pid is not None:
            self.assertTrue(gone(pid), f"pid {pid} outlived its unload")

    def stub(self, *options: str) -> tuple[list[str], str]:
        port = free_port()
        return stub_argv(port, *options), f"http://127.0.0.1:{port}/v1"

    def names(self) -> list[str]:
        return [state for state, _ in self.states]


class Servers(Managed):
    @async_test
    async def test_a_cold_start_is_loaded_once_its_health_probe_answers(self) -> None:
        argv, url = self.stub("--load-time", "1")
        answers: list[str] = []
        probe = health_probe(client(), url)

        async def counted() -> str:
            answers.append(await probe())
            return answers[-1]

        server = self.server(argv, counted, url=url)
        first, second = server.load(), server.load()
        self.assertEqual(server.state, "loading")
        await first
        await second
        self.assertEqual(self.names(), ["loading", "loaded"], "started once")
        self.assertIn("down", answers, "its port was closed while it loaded")
        self.assertEqual(answers[-1], "ready")
        assert server.load_seconds is not None
        self.assertGreaterEqual(server.load_seconds, 1)
        record = json.loads(server.state_file.read_text())
        self.assertEqual((record["pid"], record["argv"], record["url"]), (server.pid, argv, url))
        self.assertTrue(server.load().called, "a load of a loaded server is done at once")
        pid = server.pid
        assert pid is not None
        await server.unload()
        self.assertEqual(self.names(), ["loading", "loaded", "unloading", "unloaded"])
        self.assertTrue(gone(pid))
        self.assertFalse(server.state_file.exists())

    @async_test
    async def test_its_output_goes_to_the_log_named_by_the_upstream(self) -> None:
        logged = capture_log(self)
        server = self.server(
            sh("echo hello from the server; echo and its stderr >&2; exec sleep 1000"),
            always("ready"),
        )
        await server.load()
        await wait_for(lambda: len(server.lines) == 2, what="two lines")
        text = [e["log_format"].format(**e) for e in logged if e.get("upstream") == "coder"]
        self.assertIn("coder: hello from the server", text)
        self.assertIn("coder: and its stderr", text)

    @async_test
    async def test_a_server_never_healthy_fails_with_its_last_lines(self) -> None:
        server = self.server(
            sh("echo warming up; echo still warming; exec sleep 1000"),
            always("loading"),
            load_timeout=1.0,
        )
        d = server.load()
        failure = await self.assertFailure(d, ServerFailed)
        self.assertEqual(failure.reason, "not healthy within 1s")
        await wait_for(lambda: server.state == "failed", what="failed")
        self.assertEqual(self.names(), ["loading", "unloading", "failed"])
        final = self.states[-1][1]
        assert final is not None
        self.assertEqual(final.lines, ("warming up", "still warming"))
        self.assertIn("still warming", str(final))
        self.assertFalse(server.state_file.exists())

    @async_test
    async def test_a_second_failure_reports_the_lines_of_its_own_run(self) -> None:
        server = self.server(
            sh("echo warming up; echo still warming; exec sleep 1000"),
            always("loading"),
            load_timeout=1.0,
        )
        for _ in range(2):
            await self.assertFailure(server.load(), ServerFailed)
            await wait_for(lambda: server.state == "failed", what="failed")
        final = self.states[-1][1]
        assert final is not None
        self.assertEqual(final.lines, ("warming up", "still warming"))

    @async_test
    async def test_a_command_that_does_not_exist_fails_its_load(self) -> None:
        server = self.server(["/nonexistent/vllm", "serve"], always("loading"))
        failure = await self.assertFailure(server.load(), ServerFailed)
        self.assertEqual(failure.reason, "exited with code 1")
        await wait_for(lambda: server.state == "failed", what="failed")
        final = self.states[-1][1]
        assert final is not None
        self.assertIn("/nonexistent/vllm: No such file or directory", final.lines)

    @async_test
    async def test_a_crash_is_reported_as_a_failure(self) -> None:
        argv, url = self.stub()
        server = self.server(argv, url=url)
        await server.load()
        assert server.pid is not None
        os.kill(server.pid, signal.SIGKILL)
        await wait_for(lambda: server.state == "failed", what="failed")
        self.assertEqual(self.names(), ["loading", "loaded", "unloading", "failed"])
        for _, failure in self.states[-2:]:
            assert failure is not None
            self.assertEqual(failure.reason, "killed by signal 9")

    @async_test
    async def test_a_stop_ends_the_whole_process_group(self) -> None:
        server = self.server(sh("sleep 1000 & echo $!; exec sleep 1000"), always("ready"))
        await server.load()
        await wait_for(lambda: bool(server.lines), what="the grandchild's pid")
        grandchild = int(server.lines[0])
        leader = server.pid
        assert leader is not None
        self.assertFalse(gone(grandchild))
        await server.unload()
        self.assertTrue(gone(leader))
        self.assertTrue(gone(grandchild), "a child of the server outlived it")

    @async_test
    async def test_a_server_that_ignores_sigterm_is_killed_after_stop_timeout(self) -> None:
        logged = capture_log(self)
        server = self.server(
            sh("trap '' TERM; echo up; exec sleep 1000"), always("ready"), stop_timeout=0.5
        )
        await server.load()
        await wait_for(lambda: bool(server.lines), what="the trap set")
        pid = server.pid
        assert pid is not None
        began = time.monotonic()
        await server.unload()
        self.assertGreaterEqual(time.monotonic() - began, 0.5)
        self.assertTrue(gone(pid))
        self.assertTrue(any("SIGKILL" in e.get("log_format", "") for e in logged))
        self.assertEqual(self.names()[-1], "unloaded")

    @async_test
    async def test_the_stop_argv_is_run_instead_of_sigterm(self) -> None:
        flag = self.dir / "stop-now"
        server = self.server(
            sh(f"trap '' TERM; while [ ! -e {flag} ]; do sleep 0.05; done; echo stopped by it"),
            always("ready"),
            stop_argv=["touch", str(flag)],
            stop_timeout=30.0,
        )
        await server.load()
        began = time.monotonic()
        await server.unload()
        self.assertLess(time.monotonic() - began, 30, "not killed at the end of stop_timeout")
        self.assertIn("stopped by it", server.lines)
        self.assertEqual(self.names(), ["loading", "loaded", "unloading", "unloaded"])

    @async_test
    async def test_an_unload_while_loading_cancels_the_load(self) -> None:
        server = self.server(sh("exec sleep 1000"), always("loading"))
        load = server.load()
        await wait_for(lambda: server.pid is not None and Path(f"/proc/{server.pid}").exists())
        pid = server.pid
        assert pid is not None
        await server.unload()
        await self.assertFailure(load, CancelledError)
        self.assertEqual(self.names(), ["loading", "unloading", "unloaded"])
        self.assertTrue(gone(pid))

    @async_test
    async def test_a_load_while_unloading_starts_again_once_stopped(self) -> None:
        server = self.server(sh("exec sleep 1000"), always("ready"))
        await server.load()
        first = server.pid
        unloaded = server.unload()
        await server.load()
        self.assertTrue(unloaded.called)
        self.assertNotEqual(server.pid, first)
        self.assertEqual(
            self.names(), ["loading", "loaded", "unloading", "unloaded", "loading", "loaded"]
        )


ADOPTEE = """\
import json, sys
from pathlib import Path
from twisted.internet import reactor
from homelab_gateway.upstream.servers import ManagedServer

async def ready():
    return "ready"

args = json.loads(sys.argv[1])
server = ManagedServer(
    "coder", args["argv"], args["url"], ready, lambda state, failure: print(state, flush=True),
    reactor=reactor, state_file=Path(args["state_file"]),
)
server.load().addCallback(lambda _: print("pid", server.pid, flush=True))
reactor.run()
"""


class Adoption(Managed):
    def crashed_gateway(self, argv: list[str], url: str) -> int:
        """A gateway process that starts the server, then is killed: the pid it started."""
        state_file = str(self.dir / "run" / "coder.json")
        args = json.dumps({"argv": argv, "url": url, "state_file": state_file})
        gateway = Process([sys.executable, "-c", ADOPTEE, args], self.dir)
        self.addCleanup(gateway.stop)
        pid = int(gateway.wait_for_line(r"pid (\d+)").group(1))
        self.addCleanup(kill_group, pid)  # whatever the test did
        gateway.signal(signal.SIGKILL)
        gateway.stop()
        self.assertFalse(gone(pid), "the server outlives its gateway")
        return pid

    @async_test
    async def test_a_new_gateway_adopts_the_server_instead_of_starting_another(self) -> None:
        argv, url = self.stub()
        pid = self.crashed_gateway(argv, url)
        server = self.server(argv, url=url)
        self.assertTrue(server.adopt())
        self.assertEqual(server.pid, pid)
        await server.load()
        self.assertEqual(server.pid, pid, "no second server")
        self.assertEqual(self.names(), ["loading", "loaded"])
        await server.unload()
        self.assertTrue(gone(pid))
        self.assertFalse(server.state_file.exists())

    @async_test
    async def test_an_adopted_server_that_exits_is_seen_failed(self) -> None:
        argv = sh("exec sleep 1000")
        pid = self.crashed_gateway(argv, "http://127.0.0.1:9/v1")
        server = self.server(argv, always("ready"))
        self.assertTrue(server.adopt())
        await server.load()
        os.kill(pid, signal.SIGKILL)
        await wait_for(lambda: server.state == "failed", what="failed")
        self.assertEqual(self.states[-1][1].reason, "its process is gone")  # type: ignore[union-attr]

    @async_test
    async def test_a_server_of_another_config_is_stopped_not_adopted(self) -> None:
        pid = self.crashed_gateway(sh("exec sleep 1000"), "http://127.0.0.1:9/v1")
        server = self.server(sh("exec sleep 999"), always("ready"))
        self.assertFalse(server.adopt())
        await server.load()
        self.assertTrue(gone(pid), "the other config's server was stopped")
        self.assertNotEqual(server.pid, pid)
        self.assertEqual(self.names(), ["unloading", "unloaded", "loading", "loaded"])

    @async_test
    async def test_a_record_of_a_process_that_is_gone_is_forgotten(self) -> None:
        pid = self.crashed_gateway(sh("exec sleep 1000"), "http://127.0.0.1:9/v1")
        kill_group(pid)
        await wait_for(lambda: gone(pid), what="the server gone")
        server = self.server(sh("exec sleep 1000"), always("ready"))
        self.assertFalse(server.adopt())
        self.assertFalse(server.state_file.exists())
        await server.load()
        self.assertNotEqual(server.pid, pid)


def kill_group(pid: int) -> None:
    """SIGKILL to the group `pid` leads, or to `pid` before it has a group of its own."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


class SleepyVLLM(Resource):
    """vLLM's sleep-mode endpoints; a command takes effect after `lag` reads of is_sleeping."""

    isLeaf = True

    def __init__(self, sleeping: bool, lag: int = 1, missing: bool = False) -> None:
        super().__init__()
        self.missing = missing  # a server without sleep mode: 404 to everything
        self.sleeping = sleeping
        self.lag = lag
        self.target = sleeping
        self.reads = 0
        self.posts: list[str] = []

    def render_POST(self, request: Request) -> bytes:
        self.posts.append(request.uri.decode())
        if self.missing:
            request.setResponseCode(404)
        elif request.path == b"/sleep" and request.args == {b"level": [b"1"]}:
            self.target, self.reads = True, 0
        elif request.path == b"/wake_up":
            self.target, self.reads = False, 0
        else:
            request.setResponseCode(404)
        return b""

    def render_GET(self, request: Request) -> bytes:
        if self.missing or request.path != b"/is_sleeping":
            request.setResponseCode(404)
            return b""
        self.reads += 1
        if self.reads > self.lag:
            self.sleeping = self.target
        return json.dumps({"is_sleeping": self.sleeping}).encode()


class SleepMode(TestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.states: list[str] = []

    def server(self, vllm: Resource, **options: Any) -> SleepingServer:
        return SleepingServer(
            "coder",
            "http://gpu:8000/v1",
            StubTreq(vllm),
            lambda state, failure: self.states.append(state),
            clock=self.clock,
            **{"poll_interval": 0.5, **options},
        )

    def test_a_load_wakes_it_and_waits_until_it_is_awake(self) -> None:
        vllm = SleepyVLLM(sleeping=True, lag=2)
        server = self.server(vllm)
        d = server.load()
        self.assertEqual(vllm.posts, ["/wake_up"])
        self.assertNoResult(d)
        self.clock.advance(0.5)
        self.assertNoResult(d)
        self.clock.advance(0.5)
        self.successResultOf(d)
        self.assertEqual(self.states, ["loading", "loaded"])
        self.assertEqual(server.load_seconds, 1.0)

    def test_an_unload_puts_it_to_sleep_at_level_one(self) -> None:
        vllm = SleepyVLLM(sleeping=False)
        server = self.server(vllm)
        self.successResultOf(server.load())
        d = server.unload()
        self.assertEqual(vllm.posts[-1], "/sleep?level=1")
        self.assertNoResult(d)
        self.clock.advance(0.5)
        self.successResultOf(d)
        self.assertEqual(self.states[-2:], ["unloading", "unloaded"])

    def test_an_unload_while_waking_cancels_the_load(self) -> None:
        vllm = SleepyVLLM(sleeping=True, lag=5)
        server = self.server(vllm)
        load = server.load()
        unload = server.unload()
        self.failureResultOf(load, CancelledError)
        self.clock.advance(0.5)
        self.successResultOf(unload)
        self.assertEqual(self.states, ["loading", "unloading", "unloaded"])
        self.assertEqual(vllm.posts, ["/wake_up", "/sleep?level=1"])

    def test_a_server_that_never_wakes_fails_after_load_timeout(self) -> None:
        vllm = SleepyVLLM(sleeping=True, lag=10**6)
        server = self.server(vllm, load_timeout=3.0)
        d = server.load()
        self.clock.pump([0.5] * 5)
        self.assertNoResult(d)
        self.clock.advance(0.5)
        failure = self.failureResultOf(d, ServerFailed)
        self.assertIn("not awake within 3s", str(failure.value))
        self.assertEqual(self.states, ["loading", "failed"])

    def test_adopt_finds_an_awake_server_loaded_and_a_sleeping_one_unloaded(self) -> None:
        awake = self.server(SleepyVLLM(sleeping=False))
        awake.adopt()
        self.assertEqual(awake.state, "loaded")
        asleep = self.server(SleepyVLLM(sleeping=True))
        asleep.adopt()
        self.assertEqual(asleep.state, "unloaded")
        self.assertEqual(self.states, ["loading", "loaded", "loading", "unloaded"])

    def test_a_server_that_does_not_answer_is_not_awake(self) -> None:
        server = self.server(SleepyVLLM(sleeping=True, missing=True), load_timeout=1.0)
        d = server.load()
        self.clock.pump([0.5] * 3)
        failure = self.failureResultOf(d, ServerFailed)
        self.assertIn("POST /wake_up answered 404", str(failure.value))


class OutputLines(TestCase):
    def test_lines_are_split_at_either_end_of_line_and_the_rest_kept_for_the_end(self) -> None:
        lines: deque[str] = deque(maxlen=3)
        output = Output("coder", lines)
        output.childDataReceived(1, b"Loading shards: 1/2\rLoading shards: 2/2\r\nready")
        self.assertEqual(list(lines), ["Loading shards: 1/2", "Loading shards: 2/2"])
        output.childDataReceived(2, b"an error\n")
        self.assertEqual(lines[-1], "an error", "stderr has its own partial line")
        output.processEnded(Failure(ProcessDone(0)))
        self.assertEqual(list(lines), ["Loading shards: 2/2", "an error", "ready"])

    def test_a_line_without_an_end_is_logged_once_it_is_too_long(self) -> None:
        lines: deque[str] = deque()
        output = Output("coder", lines)
        output.childDataReceived(1, b"x" * (LINE_LIMIT + 1))
        self.assertEqual(len(lines), 1)
