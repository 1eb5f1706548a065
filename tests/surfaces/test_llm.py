"""The /llm Anthropic surface end to end against the real stub, over raw HTTP like curl."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

from klein import Klein
from twisted.internet import reactor
from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.protocol import Factory, Protocol
from twisted.internet.testing import MemoryReactorClock
from twisted.trial.unittest import TestCase
from twisted.web.test.requesthelper import DummyRequest

from homelab_gateway.core.instructions import marked
from homelab_gateway.core.translator import UpstreamDecoder
from homelab_gateway.upstream.connections import UpstreamPool
from homelab_gateway.web.channel import GatewaySite, WireLimits, send_at_once
from homelab_gateway.web.respond import send_json
from tests.core.test_instructions import render
from tests.surfaces.test_proxy import async_test
from testsupport.grammar import check_stream
from testsupport.helpers import (
    PROMPTLY,
    Servers,
    capture_request_log,
    chat,
    gateway_document,
    raw_request,
    wait_for,
)


class LLMSurface(TestCase):
    stub_settings: dict[str, Any] = {"delay": 0.02}
    gateway_overrides: dict[str, Any] = {}

    def setUp(self) -> None:
        self.servers = Servers(self)
        self.stub_url, self.stub, self.log = self.servers.stub(**self.stub_settings)
        self.servers.start_gateway(gateway_document(self.stub_url, **self.gateway_overrides))
        self.port = self.servers.gateway_port

    @property
    def slots(self) -> Any:
        return self.servers.gateway.pools["vllm"].line

    async def post(self, body: Any, path: str = "/llm/v1/messages", **kw: Any) -> Any:
        response = raw_request(self.port, "POST", path, body, **kw)
        await response.closed
        return response

    async def error(self, body: Any, status: int, error_type: str, **kw: Any) -> str:
        response = await self.post(body, **kw)
        self.assertEqual(response.status, status, response.body_text())
        document = json.loads(response.body_text())
        self.assertEqual(document["type"], "error")
        self.assertEqual(document["error"]["type"], error_type)
        self.assertTrue(response.header("request-id").startswith("req_"))
        return str(document["error"]["message"])

    async def settled(self) -> None:
        await wait_for(
            lambda: self.slots.in_use == 0 and not self.slots.waiting, what="slots to be free"
        )


class Streaming(LLMSurface):
    @async_test
    async def test_thinking_then_text_as_curl_sees_it(self) -> None:
        response = await self.post(chat())
        self.assertEqual(response.status, 200)
        self.assertEqual(response.header("content-type"), "text/event-stream; charset=utf-8")
        self.assertIsNone(response.header("content-encoding"))
        self.assertTrue(response.header("request-id").startswith("req_"))
        self.assertTrue(response.body_text().startswith("event: message_start\n"))
        frames = [data for _, data in response.frames()]
        self.assertEqual(check_stream(frames, allow_queue=False), "complete")
        starts = [f["content_block"]["type"] for f in frames if f["type"] == "content_block_start"]
        self.assertEqual(starts, ["thinking", "text"])
        self.assertNotIn("[DONE]", response.body_text())
        self.assertEqual(frames[0]["message"]["model"], "reasoning")
        usage = frames[0]["message"]["usage"]
        self.assertEqual(
            usage["input_tokens"], self.stub_prompt_tokens()
        )  # exact, via continuous usage
        self.assertEqual(frames[-2]["usage"]["output_tokens"], 16)
        await self.settled()

    def stub_prompt_tokens(self) -> int:
        return 1 + 4  # "hi" and one message, as the stub counts

    @async_test
    async def test_first_delta_is_flushed_before_the_upstream_finishes(self) -> None:
        self.stub.settings.delay = 0.05
        response = raw_request(self.port, "POST", "/llm/v1/messages", chat())
        await response.until_text("event: content_block_delta")
        first_delta_at = time.monotonic()
        await response.closed
        self.assertLess(first_delta_at, self.log.events("complete")[0][0])

    @async_test
    async def test_content_only_tool_and_reasoning_only(self) -> None:
        cases = {
            "content-only": (["text"], "end_turn"),
            "tool": (["text", "tool_use"], "tool_use"),
            "parallel-tools": (["text", "tool_use", "tool_use"], "tool_use"),
            "reasoning-only": (["thinking"], "max_tokens"),
        }
        for prompt, (blocks, stop_reason) in cases.items():
            response = await self.post(chat(content=prompt, max_tokens=20))
            frames = [data for _, data in response.frames()]
            self.assertEqual(check_stream(frames, allow_queue=False), "complete", prompt)
            starts = [
                f["content_block"]["type"] for f in frames if f["type"] == "content_block_start"
            ]
            self.assertEqual(starts, blocks, prompt)
            self.assertEqual(frames[-2]["delta"]["stop_reason"], stop_reason, prompt)

    @async_test
    async def test_stop_sequence_is_reported(self) -> None:
        response = await self.post(chat(content="stop", stop_sequences=["END", "###"]))
        delta = [d for _, d in response.frames()][-2]["delta"]
        self.assertEqual(delta, {"stop_reason": "stop_sequence", "stop_sequence": "END"})

    @async_test
    async def test_upstream_failures_mid_stream_end_with_an_error_frame(self) -> None:
        for prompt in ("fail", "garbage", "reset", "truncate", "abort"):
            response = await self.post(chat(content=prompt))
            self.assertEqual(response.status, 200, prompt)
            frames = [data for _, data in response.frames()]
            self.assertEqual(frames[0]["type"], "message_start", prompt)
            self.assertEqual(check_stream(frames, allow_queue=False), "error", prompt)
            self.assertNotIn("message_stop", [f["type"] for f in frames], prompt)
        await self.settled()

    @async_test
    async def test_client_disconnect_mid_stream_cancels_upstream_within_a_second(self) -> None:
        response = raw_request(
            self.port, "POST", "/llm/v1/messages", chat(content="long", max_tokens=512)
        )
        await response.until_text("text_delta")
        response.disconnect()
        left = time.monotonic()
        await wait_for(lambda: self.log.events("cancelled"), what="the stub to log cancelled")
        self.assertLess(self.log.events("cancelled")[0][0] - left, PROMPTLY)
        await self.settled()

    @async_test
    async def test_client_disconnect_during_the_prefill_cancels_upstream(self) -> None:
        self.stub.settings.hold = 30
        response = raw_request(self.port, "POST", "/llm/v1/messages", chat(content="long"))
        await wait_for(lambda: self.log.events("start"), what="the stub to start")
        self.assertEqual(response.raw, b"", "nothing is sent before message_start")
        response.disconnect()
        await wait_for(lambda: self.log.events("cancelled"), what="the stub to log cancelled")
        await self.settled()


class ClaudeCode(LLMSurface):
    @async_test
    async def test_a_recorded_claude_code_request_streams(self) -> None:
        fixture = Path(__file__).parents[1] / "fixtures" / "claude_code_2.1.197_request.json"
        headers = {
            "anthropic-version": "2023-06-01",
            "x-api-key": "sk-anything",
            "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14",
            "anthropic-dangerous-direct-browser-access": "true",
            "User-Agent": "claude-cli/2.1.197 (external, sdk-cli)",
        }
        response = await self.post(
            fixture.read_bytes(), path="/llm/v1/messages?beta=true", headers=headers
        )
        self.assertEqual(response.status, 200, response.body_text())
        self.assertEqual(
            check_stream([d for _, d in response.frames()], allow_queue=False), "complete"
        )


class Pings(LLMSurface):
    gateway_overrides = {"server": {"ping_interval": 0.1}}
    stub_settings = {"delay": 0.35, "reasoning_tokens": 0, "content_tokens": 2}

    @async_test
    async def test_silence_after_message_start_gets_pings(self) -> None:
        response = await self.post(chat())
        names = response.events()
        self.assertEqual(names[0], "message_start")
        self.assertIn("ping", names)
        self.assertEqual(
            check_stream([d for _, d in response.frames()], allow_queue=False), "complete"
        )

    @async_test
    async def test_idle_upstream_ends_the_stream_with_an_error(self) -> None:
        self.servers.gateway.pools["vllm"].upstream.idle_timeout = 0.5
        response = await self.post(chat(content="stall"))
        frames = [d for _, d in response.frames()]
        self.assertEqual(check_stream(frames, allow_queue=False), "error")
        self.assertIn("silent", frames[-1]["error"]["message"])
        await wait_for(lambda: self.log.events("cancelled"), what="the stub to be cancelled")


class NonStreaming(LLMSurface):
    @async_test
    async def test_one_message_object(self) -> None:
        response = await self.post(
            chat(
                stream=False,
                content="tool",
                tools=[{"name": "get_weather", "input_schema": {"type": "object"}}],
            )
        )
        self.assertEqual(response.status, 200)
        message = json.loads(response.body_text())
        self.assertEqual(message["type"], "message")
        self.assertEqual(message["model"], "reasoning")
        self.assertEqual([b["type"] for b in message["content"]], ["text", "tool_use"])
        self.assertEqual(message["content"][1]["input"], {"city": "Paris", "unit": "celsius"})
        self.assertEqual(message["content"][1]["name"], "get_weather")
        self.assertEqual(message["stop_reason"], "tool_use")
        self.assertGreater(message["usage"]["output_tokens"], 0)

    @async_test
    async def test_thinking_first_then_text(self) -> None:
        message = json.loads((await self.post(chat(stream=False))).body_text())
        self.assertEqual([b["type"] for b in message["content"]], ["thinking", "text"])
        self.assertEqual(message["stop_reason"], "end_turn")

    @async_test
    async def test_upstream_failure_is_an_http_error(self) -> None:
        self.assertIn(
            "engine died", await self.error(chat(stream=False, content="fail"), 502, "api_error")
        )
        await self.error(chat(stream=False, content="abort"), 529, "overloaded_error")


class Errors(LLMSurface):
    @async_test
    async def test_client_mistakes(self) -> None:
        self.assertIn("not valid JSON", await self.error(b"{nope", 400, "invalid_request_error"))
        self.assertIn(
            "nested too deeply", await self.error(b"[" * 100000, 400, "invalid_request_error")
        )
        self.assertTrue(
            (await self.error({"max_tokens": 5}, 400, "invalid_request_error")).startswith("model:")
        )
        self.assertTrue(
            (await self.error(chat(max_tokens="x"), 400, "invalid_request_error")).startswith(
                "max_tokens:"
            )
        )
        self.assertIn("'ghost'", await self.error(chat(model="ghost"), 404, "not_found_error"))
        self.assertEqual(self.stub.stats.requests, 0)

    @async_test
    async def test_wrong_method_is_405(self) -> None:
        response = raw_request(self.port, "GET", "/llm/v1/messages")
        await response.closed
        self.assertEqual(response.status, 405)
        self.assertEqual(json.loads(response.body_text())["error"]["type"], "invalid_request_error")

    @async_test
    async def test_body_over_the_limit_is_413(self) -> None:
        site = self.servers.gateway.site
        site.limits = WireLimits(max_body_bytes=1000, max_header_bytes=16384, request_timeout=60)
        body = chat(content="x" * 2000)
        await self.error(body, 413, "request_too_large")

    @async_test
    async def test_upstream_refusals_before_the_stream(self) -> None:
        self.assertIn(
            "internal error", await self.error(chat(content="error500"), 502, "api_error")
        )
        self.assertIn(
            "maximum context length",
            await self.error(chat(content="error400"), 400, "invalid_request_error"),
        )
        await self.error(chat(content="overloaded"), 529, "overloaded_error")
        await self.settled()

    @async_test
    async def test_unreachable_upstream_is_waited_for_then_529(self) -> None:
        """Nothing was sent to a refusing upstream, so the request waits for it to come back
        (a restarting box) until its queue_timeout, then hears why."""
        pool = self.servers.gateway.pools["vllm"]
        pool.upstream.url = "http://127.0.0.1:1/v1"
        pool.queue_timeout = 0.5
        message = await self.error(chat(stream=False), 529, "overloaded_error")
        self.assertIn("out of rotation", message)
        self.assertIn("connection refused", message)
        self.assertEqual(pool.replica.circuit.state, "down")
        await self.settled()

    @async_test
    async def test_any_anthropic_version_and_either_auth_header_is_accepted(self) -> None:
        for headers in (
            {"x-api-key": "k", "anthropic-version": "2099-01-01"},
            {"Authorization": "Bearer k", "anthropic-beta": "whatever-2025"},
        ):
            response = await self.post(chat(), **{"headers": headers})
            self.assertEqual(response.status, 200)
        response = await self.post(chat(), path="/llm/v1/messages?beta=true")
        self.assertEqual(response.status, 200)


class UnexpectedErrors(LLMSurface):
    """An exception no handler expected is the gateway's own fault: the client gets a 500 in
    its surface's shape (an error event once its stream began), never twisted.web's HTML
    page; the log gets one traceback and the request's outcome, and the slot goes back."""

    def setUp(self) -> None:
        super().setUp()
        self.logged = capture_request_log(self)

    def break_decoder(self, after: int) -> None:
        """The upstream's body decoder raises on its call after `after` good ones."""
        feed, calls = UpstreamDecoder.feed, [0]

        def broken(decoder: UpstreamDecoder, data: bytes) -> Any:
            calls[0] += 1
            if calls[0] > after:
                raise RuntimeError("a bug")
            return feed(decoder, data)

        self.patch(UpstreamDecoder, "feed", broken)

    async def outcome(self) -> str:
        await wait_for(lambda: self.logged, what="the request's log line")
        (event,) = self.logged
        self.assertEqual(len(self.flushLoggedErrors(RuntimeError)), 1)  # one traceback
        return str(event["outcome"])

    @async_test
    async def test_before_the_answer_began_a_500_api_error(self) -> None:
        self.break_decoder(after=0)
        message = await self.error(chat(stream=False), 500, "api_error")
        self.assertIn("the gateway failed", message)
        self.assertEqual(await self.outcome(), "internal_error")
        await self.settled()

    @async_test
    async def test_mid_stream_an_error_event(self) -> None:
        self.break_decoder(after=1)
        response = await self.post(chat())
        self.assertEqual(response.status, 200)
        events = [data for _, data in response.frames()]
        self.assertEqual(events[0]["type"], "message_start")
        self.assertEqual(events[-1]["type"], "error")
        self.assertEqual(events[-1]["error"]["type"], "api_error")
        self.assertEqual(await self.outcome(), "internal_error")
        await self.settled()

    @async_test
    async def test_on_count_tokens_and_a_proxy_route_each_in_its_shape(self) -> None:
        app = self.servers.gateway.app

        def broken(*args: Any) -> Any:
            raise RuntimeError("a bug")

        self.patch(app.surfaces["count_tokens"], "resolve", broken)
        path = "/llm/v1/messages/count_tokens"
        self.assertIn("the gateway failed", await self.error(chat(), 500, "api_error", path=path))
        self.assertEqual(await self.outcome(), "internal_error")

        async def forward(*args: Any) -> Any:
            raise RuntimeError("a bug")

        self.logged.clear()
        self.patch(app.proxy, "forward", forward)
        response = raw_request(self.port, "GET", "/openai/v1/models")
        await response.closed
        self.assertEqual(response.status, 500)
        self.assertEqual(response.header("content-type"), "application/json")
        self.assertEqual(json.loads(response.body_text())["error"]["type"], "api_error")
        self.assertEqual(await self.outcome(), "internal_error")

    @async_test
    async def test_on_a_route_that_answers_at_once(self) -> None:
        def broken() -> Any:
            raise RuntimeError("a bug")

        self.patch(self.servers.gateway.app, "status_document", broken)
        response = raw_request(self.port, "GET", "/llm/v1/status")
        await response.closed
        self.assertEqual(response.status, 500)
        self.assertEqual(json.loads(response.body_text())["error"]["type"], "api_error")
        self.assertEqual(len(self.flushLoggedErrors(RuntimeError)), 1)


class AsKleinWroteIt(LLMSurface):
    """`/llm/v1/messages` is a Klein route whose request's flight writes the answer and
    finishes the request (Klein gets `web.ANSWERED_BY_ITS_FLIGHT`). Before, the route gave
    Klein the handler's Deferred and Klein wrote the answer; that route, on the same gateway
    objects, is served here on a port of its own, and both must answer alike, byte for byte
    but for the request's id, its date and generated ids."""

    gateway_overrides = {
        "server": {"cors_origins": ["https://chat.home.lan"], "shutdown_grace": 0.2}
    }

    def setUp(self) -> None:
        super().setUp()
        gateway = self.servers.gateway
        app = gateway.app
        before = Klein()

        @before.route("/llm/v1/messages")
        def messages(request: Any) -> Any:  # the route as it was: Klein writes the answer
            return app._work(
                request,
                "messages",
                lambda r: app.surfaces["messages"].answer(request, r),
                shape="anthropic",
            )

        site = GatewaySite(before.resource(), gateway.site.limits, reactor=reactor)
        site.displayTracebacks = False
        self.before_port = self.servers.listen(site)
        send_at_once(self.servers.ports[-1])

    async def both(self, method: str, body: Any = None, **kw: Any) -> list[Any]:
        answers = []
        for port in (self.port, self.before_port):
            response = raw_request(port, method, "/llm/v1/messages", body, **kw)
            await response.closed
            answers.append(response)
        return answers

    def same(self, now: Any, before: Any, *, body: bool = True) -> None:
        def head(response: Any) -> list[str]:
            lines = response.head.split("\r\n")
            return [line for line in lines if not line.lower().startswith(("request-id", "date"))]

        self.assertEqual(head(now), head(before))
        if body:
            self.assertEqual(now.body_bytes(), before.body_bytes())

    @async_test
    async def test_refusals_and_preflights_are_answered_alike(self) -> None:
        cors = {"Origin": "https://chat.home.lan", "Access-Control-Request-Method": "POST"}
        for method, body, headers in (
            ("GET", None, None),
            ("POST", b"{nope", None),
            ("POST", chat(model="ghost"), None),
            ("OPTIONS", None, cors),
        ):
            now, before = await self.both(method, body, headers=headers)
            self.same(now, before)
        self.assertEqual(self.stub.stats.requests, 0)

    @async_test
    async def test_answers_and_streams_are_answered_alike(self) -> None:
        now, before = await self.both("POST", chat(stream=False))
        self.same(now, before, body=False)
        self.assertEqual(now.status, 200)
        now, before = await self.both("POST", chat(), headers={"Origin": "https://chat.home.lan"})
        self.same(now, before, body=False)
        self.assertEqual(now.events(), before.events())
        self.assertEqual(check_stream([d for _, d in now.frames()]), "complete")

    @async_test
    async def test_a_handler_that_fails_gets_twisteds_500_either_way(self) -> None:
        async def broken(request: Any, record: Any) -> None:
            raise RuntimeError("a bug")

        self.servers.gateway.app.surfaces["messages"].answer = broken  # type: ignore[method-assign]
        now, before = await self.both("POST", chat())
        self.same(now, before)
        self.assertEqual(now.status, 500)
        self.assertEqual(len(self.flushLoggedErrors(RuntimeError)), 2)

    @async_test
    async def test_a_handler_cut_by_shutdown_gets_the_503_either_way(self) -> None:
        async def stuck(request: Any, record: Any) -> None:
            await Deferred()  # never answers, and lets the cancel through

        self.servers.gateway.app.surfaces["messages"].answer = stuck  # type: ignore[method-assign]
        now = raw_request(self.port, "POST", "/llm/v1/messages", chat())
        before = raw_request(self.before_port, "POST", "/llm/v1/messages", chat())
        inflight = self.servers.gateway.inflight
        await wait_for(lambda: len(inflight) == 2, what="both requests in flight")
        await self.servers.gateway.drain()
        await now.closed
        await before.closed
        self.same(now, before)
        self.assertEqual(now.status, 503)
        self.assertEqual(json.loads(now.body_text())["error"]["type"], "overloaded_error")

    @async_test
    async def test_a_client_that_leaves_cancels_its_handler_either_way(self) -> None:
        cancelled: list[str] = []

        async def stuck(request: Any, record: Any) -> None:
            try:
                await Deferred()
            except CancelledError:
                cancelled.append(record.outcome)
                raise

        self.servers.gateway.app.surfaces["messages"].answer = stuck  # type: ignore[method-assign]
        inflight = self.servers.gateway.inflight
        for port in (self.port, self.before_port):
            response = raw_request(port, "POST", "/llm/v1/messages", chat())
            await wait_for(lambda: len(inflight) == 1, what="the request in flight")
            response.disconnect()
            await wait_for(lambda: len(inflight) == 0, what="the flight to end")
        self.assertEqual(cancelled, ["client_disconnected"] * 2)
        self.assertEqual(self.flushLoggedErrors(), [])


class Catalogue(LLMSurface):
    @async_test
    async def test_models_list_and_get(self) -> None:
        response = raw_request(self.port, "GET", "/llm/v1/models")
        await response.closed
        listing = json.loads(response.body_text())
        self.assertEqual([m["id"] for m in listing["data"]], ["reasoning"])
        entry = listing["data"][0]
        self.assertEqual(
            (entry["type"], entry["object"], entry["display_name"]), ("model", "model", "reasoning")
        )
        self.assertFalse(listing["has_more"])
        response = raw_request(self.port, "GET", "/llm/v1/models/reasoning")
        await response.closed
        self.assertEqual(json.loads(response.body_text())["id"], "reasoning")

    @async_test
    async def test_count_tokens_is_exact_via_tokenize(self) -> None:
        body = {"model": "reasoning", "messages": [{"role": "user", "content": "one two three"}]}
        response = await self.post(body, path="/llm/v1/messages/count_tokens")
        self.assertEqual(json.loads(response.body_text()), {"input_tokens": 3 + 4})

    @async_test
    async def test_count_tokens_falls_back_to_an_estimate(self) -> None:
        self.servers.gateway.pools["vllm"].upstream.url = "http://127.0.0.1:1/v1"
        body = {"model": "reasoning", "messages": [{"role": "user", "content": "one two three"}]}
        response = await self.post(body, path="/llm/v1/messages/count_tokens")
        self.assertGreater(json.loads(response.body_text())["input_tokens"], 0)

    @async_test
    async def test_status_counts(self) -> None:
        response = raw_request(self.port, "GET", "/llm/v1/status")
        await response.closed
        self.assertEqual(
            json.loads(response.body_text()),
            {
                "upstreams": {
                    "vllm": {
                        "slots": 2,
                        "in_use": 0,
                        "health": "up",
                        "down_since": None,
                        "retry_at": None,
                        "last_error": None,
                        "fallback": False,
                        "models": ["reasoning"],
                        "line": "vllm",
                        "waiting": 0,
                        "waiting_by_class": {"interactive": 0, "normal": 0, "batch": 0},
                        "waiting_by_client": {},
                    }
                },
                "models": {"reasoning": {"upstreams": ["vllm"], "line": "vllm", "waiting": 0}},
                "surfaces": {},
            },
        )


CANNED_SSE = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n"
    + b"".join(
        b"data: " + json.dumps(chunk).encode() + b"\n\n"
        for chunk in (
            {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
            {"choices": [{"index": 0, "delta": {"content": "ok"}}]},
            {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
        )
    )
    + b"data: [DONE]\n\n"
)


class ClosesConnections(Protocol):
    """Reads a request, then closes the first `factory.closing` connections cleanly without a
    word (a server that crashed or restarted mid-request); answers the rest."""

    def dataReceived(self, data: bytes) -> None:
        self.factory.connections += 1
        if self.factory.connections <= self.factory.closing:
            self.transport.loseConnection()
        else:
            self.transport.write(CANNED_SSE)
            self.transport.loseConnection()
        self.dataReceived = lambda data: None  # type: ignore[method-assign]


class StaleConnections(TestCase):
    def start(self, closing: int) -> Any:
        self.servers = Servers(self)
        factory = Factory.forProtocol(ClosesConnections)
        factory.connections, factory.closing = 0, closing
        port = self.servers.listen(factory)
        self.servers.start_gateway(gateway_document(f"http://127.0.0.1:{port}/v1"))
        return factory

    @async_test
    async def test_a_connection_closed_after_the_request_was_written_is_not_retried(
        self,
    ) -> None:
        """The upstream may have read it (issue 10, item 9): sending it again could run a
        generation twice. A brand-new connection is never stale."""
        factory = self.start(closing=1)
        response = raw_request(self.servers.gateway_port, "POST", "/llm/v1/messages", chat())
        await response.closed
        self.assertEqual(response.status, 502)
        self.assertEqual(factory.connections, 1)


class PoolNeverCachesAClosingConnection(TestCase):
    def test_put_connection(self) -> None:
        pool = UpstreamPool(MemoryReactorClock(), persistent=True)

        class Connection:
            def __init__(self, disconnecting: bool) -> None:
                self.transport = type("T", (), {"disconnecting": disconnecting})()
                self.state = "QUIESCENT"

        pool._putConnection("key", Connection(disconnecting=True))
        self.assertEqual(pool._connections.get("key", []), [])
        pool._putConnection("key", Connection(disconnecting=False))
        self.assertEqual(len(pool._connections["key"]), 1)
        self.assertLess(
            UpstreamPool.cachedConnectionTimeout, 5, "must be under uvicorn's keep-alive"
        )


CLAUDE_CODE_SYSTEM = " ".join(f"instruction{i}" for i in range(200))  # a long shared prefix


def claude_code_chat(header: str, **extra: Any) -> dict[str, Any]:
    """A request shaped as Claude Code sends it: the billing header as the first system block."""
    return chat(
        system=[
            {"type": "text", "text": header},
            {"type": "text", "text": CLAUDE_CODE_SYSTEM, "cache_control": {"type": "ephemeral"}},
        ],
        **extra,
    )


class UpstreamBodies(LLMSurface):
    """Records each request body the stub receives: what really reached the upstream."""

    def setUp(self) -> None:
        super().setUp()
        self.bodies: list[dict[str, Any]] = []
        render = self.stub.render_POST

        def recording(request: Any) -> Any:
            body = request.content.read()
            request.content.seek(0)
            if request.path.endswith(b"/chat/completions"):
                self.bodies.append(json.loads(body))
            return render(request)

        self.stub.render_POST = recording  # type: ignore[method-assign]


class BillingHeaderAndCache(UpstreamBodies):
    stub_settings = {"prompt_tokens_details": True}

    @async_test
    async def test_the_header_never_reaches_the_upstream_so_its_prefix_cache_hits(self) -> None:
        first = await self.post(
            claude_code_chat("x-anthropic-billing-header: cc_version=2.1.328.ce7; cch=0a1b2;")
        )
        second = await self.post(  # the next turn: a new user message after the same system
            claude_code_chat(
                "x-anthropic-billing-header: cc_version=2.1.328.27f; cch=9f8e7;", content="next"
            )
        )
        for body in self.bodies:
            self.assertEqual(body["messages"][0], {"role": "system", "content": CLAUDE_CODE_SYSTEM})
        frames = [d for _, d in second.frames()]
        self.assertEqual(check_stream(frames, allow_queue=False), "complete")
        start, delta = frames[0]["message"]["usage"], frames[-2]["usage"]
        prompt = 200 + 4 + 1 + 4  # the system prompt's words and the user's, 4 per message
        self.assertEqual(start["cache_read_input_tokens"], 192)  # whole 16-token blocks
        self.assertEqual(start["cache_creation_input_tokens"], 16)  # the new user block
        self.assertEqual(start["input_tokens"], prompt - 192 - 16)  # the block left unfilled
        self.assertEqual(
            {k: delta[k] for k in start if k != "output_tokens"},
            {k: start[k] for k in start if k != "output_tokens"},
        )
        first_usage = next(d for _, d in first.frames())["message"]["usage"]
        self.assertEqual(first_usage["cache_read_input_tokens"], 0)
        self.assertEqual(first_usage["cache_creation_input_tokens"], 208)  # written, in blocks
        self.assertEqual(first_usage["input_tokens"], prompt - 208)

    @async_test
    async def test_non_streaming_usage_carries_the_cache_fields(self) -> None:
        await self.post(claude_code_chat("x-anthropic-billing-header: cc_version=2.1.328.ce7;"))
        response = await self.post(
            claude_code_chat("x-anthropic-billing-header: cc_version=2.1.77.a1b;", stream=False)
        )
        usage = json.loads(response.body_text())["usage"]  # the same prompt: all but its last token
        self.assertEqual(usage["cache_read_input_tokens"], 208)
        self.assertEqual(usage["input_tokens"], 1)
        self.assertEqual(usage["cache_creation_input_tokens"], 0)


class BillingHeaderKept(UpstreamBodies):
    stub_settings = {"prompt_tokens_details": True}
    gateway_overrides = {"model": {"strip_billing_header": False}}

    @async_test
    async def test_the_option_off_sends_it_and_the_cache_misses(self) -> None:
        header = "x-anthropic-billing-header: cc_version=2.1.328.ce7; cch=0a1b2;"
        await self.post(claude_code_chat(header))
        response = await self.post(claude_code_chat(header.replace("0a1b2", "ffff0")))
        self.assertTrue(self.bodies[0]["messages"][0]["content"].startswith(header))
        usage = next(d for _, d in response.frames())["message"]["usage"]
        self.assertEqual(usage["cache_read_input_tokens"], 0)  # the header is the 2nd token


class MidConversationInstructions(UpstreamBodies):
    @async_test
    async def test_a_system_message_inside_messages_reaches_the_upstream_folded(self) -> None:
        """As Claude Code sends it: a system message after the user's turn. Qwen3.5's template
        refuses it in place; the upstream gets one system message, first, and the text."""
        messages = [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "next"},
            {"role": "system", "content": "mind the time"},
        ]
        response = await self.post(chat(system="be kind", messages=messages))
        frames = [data for _, data in response.frames()]
        self.assertEqual(check_stream(frames, allow_queue=False), "complete")
        sent = self.bodies[-1]["messages"]
        self.assertEqual([m["role"] for m in sent], ["system", "user", "assistant", "user"])
        self.assertEqual(sent[0], {"role": "system", "content": "be kind"})
        self.assertEqual(sent[3]["content"], "next\n\n" + marked("mind the time"))
        render(sent)  # the strict template takes it


class Overflow(LLMSurface):
    """The stub refuses as vLLM 0.32 does past a 64-token window: "at least N" tokens."""

    stub_settings = {"max_model_len": 64, "models": ("reasoning",)}

    @async_test
    async def test_a_prompt_over_the_window_is_anthropics_prompt_is_too_long(self) -> None:
        words = " ".join(["word"] * 100)  # 104 tokens, vLLM says "at least 57"
        for stream in (True, False):
            message = await self.error(
                chat(content=words, max_tokens=8, stream=stream), 400, "invalid_request_error"
            )
            self.assertEqual(message, "prompt is too long: 104 tokens > 64 maximum")
        await self.settled()

    @async_test
    async def test_a_prompt_that_fits_without_its_max_tokens_gets_the_max_tokens_wording(
        self,
    ) -> None:
        message = await self.error(
            chat(content="a b c d e f g h i j", max_tokens=60), 400, "invalid_request_error"
        )
        self.assertEqual(
            message,
            "input length and `max_tokens` exceed context limit: 14 + 60 > 64, "
            "decrease input length or `max_tokens` and try again",
        )

    @async_test
    async def test_the_models_list_says_the_window_vllm_reports(self) -> None:
        readiness = self.servers.gateway.readiness
        readiness.start()
        await wait_for(lambda: readiness.probes["vllm"].ok, what="the first /models probe")
        response = raw_request(self.port, "GET", "/llm/v1/models/reasoning")
        await response.closed
        entry = json.loads(response.body_text())
        self.assertEqual((entry["max_input_tokens"], entry["max_tokens"]), (64, 64))
        self.assertEqual(
            (entry["type"], entry["display_name"], entry["created_at"]),
            ("model", "reasoning", "2025-01-01T00:00:00Z"),
        )


class OllamaOverflow(LLMSurface):
    """Ollama's refusal has no number and there is no /tokenize: the config's window stands in."""

    gateway_overrides = {"model": {"context_window": 4096}, "upstream": {"kind": "ollama"}}

    def setUp(self) -> None:
        super().setUp()
        render = self.stub.render_POST

        def as_ollama(request: Any) -> Any:
            if request.path.endswith(b"/tokenize"):
                request.setResponseCode(404)
                return b"404 page not found"
            if request.path.endswith(b"/chat/completions"):
                request.setResponseCode(400)
                error = {
                    "message": "the input length exceeds the context length",
                    "type": "invalid_request_error",
                    "param": None,
                    "code": None,
                }
                return json.dumps({"error": error}).encode()
            return render(request)

        self.stub.render_POST = as_ollama  # type: ignore[method-assign]

    @async_test
    async def test_the_configured_window_fills_the_missing_numbers(self) -> None:
        message = await self.error(chat(), 400, "invalid_request_error")
        self.assertEqual(message, "prompt is too long: 4097 tokens > 4096 maximum")


class StructuredOutputAndReasoning(UpstreamBodies):
    gateway_overrides = {"model": {"show_reasoning": "when_requested"}}

    @async_test
    async def test_output_config_format_reaches_the_upstream_as_response_format(self) -> None:
        schema = {"type": "object", "properties": {"city": {"type": "string"}}}
        response = await self.post(
            chat(output_config={"format": {"type": "json_schema", "schema": schema}})
        )
        self.assertEqual(response.status, 200)
        self.assertEqual(
            self.bodies[0]["response_format"],
            {
                "type": "json_schema",
                "json_schema": {"name": "output", "schema": schema, "strict": True},
            },
        )
        message = await self.error(
            chat(output_format={"type": "json_object"}), 400, "invalid_request_error"
        )
        self.assertTrue(message.startswith("output_format.type:"))
        self.assertEqual(len(self.bodies), 1)

    @async_test
    async def test_reasoning_shows_only_when_the_request_enables_thinking(self) -> None:
        plain = [d for _, d in (await self.post(chat())).frames()]
        self.assertEqual(check_stream(plain, allow_queue=False), "complete")
        self.assertEqual(
            [d["content_block"]["type"] for d in plain if d["type"] == "content_block_start"],
            ["text"],
        )
        thinking = {"type": "enabled", "budget_tokens": 1024}
        asked = [d for _, d in (await self.post(chat(thinking=thinking))).frames()]
        self.assertEqual(check_stream(asked, allow_queue=False), "complete")
        self.assertEqual(
            [d["content_block"]["type"] for d in asked if d["type"] == "content_block_start"],
            ["thinking", "text"],
        )


class NamePatterns(LLMSurface):
    def setUp(self) -> None:
        self.servers = Servers(self)
        self.stub_url, self.stub, self.log = self.servers.stub()
        document = gateway_document(self.stub_url)
        document["models"].update(
            {
                "claude-*": {"upstream": "vllm", "upstream_model": "big"},
                "claude-*haiku*": {"upstream": "vllm", "upstream_model": "small"},
                "claude-opus-4-1": {"upstream": "vllm", "upstream_model": "exact"},
            }
        )
        self.servers.start_gateway(document)
        self.port = self.servers.gateway_port

    @async_test
    async def test_claude_codes_names_reach_the_models_their_patterns_name(self) -> None:
        for name, upstream_model in (
            ("claude-haiku-4-5-20251001", "small"),
            ("claude-sonnet-4-5-20250929", "big"),
            ("claude-opus-4-1", "exact"),
            ("reasoning", "reasoning"),
        ):
            response = await self.post(chat(model=name, stream=False))
            self.assertEqual(response.status, 200, response.body_text())
            self.assertEqual(json.loads(response.body_text())["model"], name)
            self.assertEqual(self.stub.stats.models.get(upstream_model), 1, name)
        self.assertIn("'gpt-4'", await self.error(chat(model="gpt-4"), 404, "not_found_error"))
        # metrics are labelled by the configured entry, never by the client's string
        response = raw_request(self.port, "GET", "/metrics")
        await response.closed
        labels = set(re.findall(r'model="([^"]*)"', response.body_text()))
        self.assertTrue({"claude-*haiku*", "claude-*", "claude-opus-4-1"} <= labels, labels)
        self.assertFalse({"claude-haiku-4-5-20251001", "claude-sonnet-4-5-20250929"} & labels)

    @async_test
    async def test_the_catalogue_lists_names_and_answers_for_a_patterns_name(self) -> None:
        response = raw_request(self.port, "GET", "/llm/v1/models")
        await response.closed
        ids = [m["id"] for m in json.loads(response.body_text())["data"]]
        self.assertEqual(ids, ["reasoning", "claude-opus-4-1"])
        response = raw_request(self.port, "GET", "/llm/v1/models/claude-haiku-4-5")
        await response.closed
        self.assertEqual(json.loads(response.body_text())["id"], "claude-haiku-4-5")


def test_a_whole_answer_with_a_lone_surrogate_is_still_json() -> None:
    """A model's tool arguments may spell half an emoji as `\\ud83d`: the non-streaming answer
    carries it as that escape, as the stream's `partial_json` does, rather than failing."""
    document = {"content": [{"type": "tool_use", "input": {"face": "\ud83d"}}]}
    body = send_json(DummyRequest([]), 200, document)
    assert json.loads(body) == document
    assert send_json(DummyRequest([]), 200, {"text": "é"}) == '{"text": "é"}'.encode()
