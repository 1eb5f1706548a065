"""Drain and reload in process: every answer reaches its client before the process may exit.

The process ends right after the drain: twistd's reactor then drops every connection without
flushing it. `exit_now` does the same the moment the drain returns, so an answer that was not
yet handed over and written out is lost here exactly as it was in production.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.internet.protocol import ClientFactory
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET, Site

from tests.surfaces.test_llm import LLMSurface
from tests.surfaces.test_proxy import async_test
from testsupport.helpers import RawResponse, Servers, chat, raw_request, wait_for


class Drain(LLMSurface):
    stub_settings = {"hold": 0.3}
    gateway_overrides = {"slots": 2, "server": {"shutdown_grace": 10}}

    async def drain_then_exit(self) -> None:
        assert self.servers.gateway is not None
        await self.servers.gateway.drain()
        exit_now(self.servers)

    def assert_answered(self, response: RawResponse) -> None:
        self.assertEqual(response.status, 200, response.raw[-300:])
        self.assertEqual(json.loads(response.body_text())["type"], "message")

    @async_test
    async def test_every_whole_answer_finished_in_the_grace_reaches_its_client(self) -> None:
        first = raw_request(self.port, "POST", "/llm/v1/messages", chat(stream=False))
        await wait_for(lambda: self.slots.in_use == 1, what="the first slot")
        last = raw_request(self.port, "POST", "/llm/v1/messages", chat(stream=False))
        await wait_for(lambda: self.slots.in_use == 2, what="the second slot")
        await self.drain_then_exit()
        await first.closed
        await last.closed
        self.assert_answered(first)
        self.assert_answered(last)

    @async_test
    async def test_a_single_whole_answer_reaches_its_client(self) -> None:
        only = raw_request(self.port, "POST", "/llm/v1/messages", chat(stream=False))
        await wait_for(lambda: self.slots.in_use == 1, what="the slot")
        await self.drain_then_exit()
        await only.closed
        self.assert_answered(only)

    @async_test
    async def test_a_whole_answer_cut_at_the_end_of_the_grace_gets_a_503(self) -> None:
        self.stub.settings.hold = 60
        self.servers.gateway.config = _with_grace(self.servers.gateway.config, 0.2)
        cut = raw_request(self.port, "POST", "/llm/v1/messages", chat(stream=False))
        await wait_for(lambda: self.stub.stats.in_flight == 1, what="the upstream request")
        await self.drain_then_exit()
        await cut.closed
        self.assertEqual(cut.status, 503, cut.raw)
        error = json.loads(cut.body_text())["error"]
        self.assertEqual(error["type"], "overloaded_error")
        self.assertIn("shut down", error["message"])

    @async_test
    async def test_a_second_signal_ends_the_grace_at_once(self) -> None:
        self.stub.settings.hold = 60
        cut = raw_request(self.port, "POST", "/llm/v1/messages", chat(stream=False))
        await wait_for(lambda: self.stub.stats.in_flight == 1, what="the upstream request")
        drained = Deferred.fromCoroutine(self.drain_then_exit())
        self.assertTrue(self.servers.gateway.cut_short())
        await drained
        await cut.closed
        self.assertEqual(cut.status, 503, cut.raw)
        self.assertFalse(self.servers.gateway.cut_short(), "nothing is left to cut")


class KeepAliveDrain(LLMSurface):
    @async_test
    async def test_an_idle_keep_alive_connection_is_closed_by_the_drain(self) -> None:
        idle = RawResponse()

        class Once(ClientFactory):
            def buildProtocol(self, addr: Any) -> RawResponse:
                return idle

        idle.connectionMade = lambda: idle.transport.write(  # type: ignore[method-assign]
            b"GET /healthz HTTP/1.1\r\nHost: gateway\r\n\r\n"
        )
        reactor.connectTCP("127.0.0.1", self.port, Once())
        await idle.until_text('"ok"')
        self.assertFalse(idle.closed.called, "HTTP/1.1 keeps the connection open")
        await self.servers.gateway.drain()
        self.assertEqual(self.servers.gateway.site.connections, set())
        await idle.closed


class _StuckChannel:
    """A connection whose client stopped reading: closing it never completes on its own."""

    def __init__(self, site: Any) -> None:
        self.site = site
        self.transport = self
        self.aborted = False

    def loseConnection(self) -> None:
        """Waits for buffered bytes that the client never takes."""

    def abortConnection(self) -> None:
        self.aborted = True
        self.site.connection_lost(self)


class StuckClientDrain(LLMSurface):
    @async_test
    async def test_a_client_that_stopped_reading_is_cut_after_the_close_timeout(self) -> None:
        gateway = self.servers.gateway
        gateway.close_timeout = 0.2
        stuck = _StuckChannel(gateway.site)
        gateway.site.connection_made(stuck)
        await gateway.drain()
        self.assertTrue(stuck.aborted)
        self.assertEqual(gateway.site.connections, set())


class _SilentTokenizer(Resource):
    """An upstream whose /tokenize never answers: a count_tokens still running at the end of
    the grace."""

    isLeaf = True

    def __init__(self) -> None:
        super().__init__()
        self.waiting: list[Any] = []

    def render_POST(self, request: Any) -> Any:
        self.waiting.append(request)
        return NOT_DONE_YET


class CountTokensDrain(LLMSurface):
    gateway_overrides = {"server": {"shutdown_grace": 0.2}}

    def setUp(self) -> None:
        super().setUp()
        self.tokenizer = _SilentTokenizer()
        port = self.servers.listen(Site(self.tokenizer))
        self.servers.gateway.pools["vllm"].upstream.url = f"http://127.0.0.1:{port}/v1"

    @async_test
    async def test_count_tokens_cut_at_the_end_of_the_grace_gets_a_503(self) -> None:
        counting = raw_request(
            self.port, "POST", "/llm/v1/messages/count_tokens", chat(stream=False)
        )
        await wait_for(lambda: self.tokenizer.waiting, what="the /tokenize request")
        await self.servers.gateway.drain()
        exit_now(self.servers)
        await counting.closed
        self.assertEqual(counting.status, 503, counting.raw)
        self.assertEqual(json.loads(counting.body_text())["error"]["type"], "overloaded_error")


def exit_now(servers: Servers) -> None:
    """What the reactor does once the service has stopped: every gateway connection lost at
    once, whatever is still in its write buffer (the stub is the first server, the gateway the
    second)."""
    for protocol in list(servers.factories[1].protocols):
        protocol.transport.abortConnection()


def _with_grace(config: Any, grace: float) -> Any:
    return replace(config, server=replace(config.server, shutdown_grace=grace))
