"""What a hostile client or a careless operator found at the edges: numbers that are not
JSON, model names that are not labels, paths and headers the router never expected, and
connections that never say anything."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given
from hypothesis import strategies as st
from twisted.internet import reactor
from twisted.internet.error import ConnectionDone
from twisted.internet.testing import MemoryReactorClock, StringTransport
from twisted.logger import formatEvent, globalLogPublisher
from twisted.python.failure import Failure
from twisted.trial.unittest import TestCase
from twisted.web.resource import Resource
from twisted.web.test.requesthelper import DummyChannel

from homelab_gateway.core.surfaces import SURFACES, Shape
from homelab_gateway.telemetry import loggable
from homelab_gateway.web.channel import GatewayRequest, GatewaySite, WireLimits
from tests.surfaces.test_llm import LLMSurface
from tests.surfaces.test_proxy import async_test
from tests.test_operations import metric
from testsupport.helpers import (
    RawResponse,
    capture_request_log,
    chat,
    raw_request,
    send_raw,
    wait_for,
)


class NonFiniteNumbers(LLMSurface):
    @async_test
    async def test_a_number_that_overflows_to_infinity_is_refused(self) -> None:
        for field in ('"temperature": 1e400', '"top_p": -1E+999'):
            body = json.dumps(chat())[:-1] + f", {field}}}"
            message = await self.error(body.encode(), 400, "invalid_request_error")
            self.assertIn(field.split(": ")[1], message)
        self.assertEqual(self.stub.stats.requests, 0)

    @async_test
    async def test_the_same_inside_count_tokens(self) -> None:
        body = json.dumps(chat(stream=False))[:-1] + ', "temperature": 1e400}'
        response = await self.post(body.encode(), "/llm/v1/messages/count_tokens")
        self.assertEqual(response.status, 400, response.body_text())
        self.assertIn("1e400", json.loads(response.body_text())["error"]["message"])


class ModelNames(LLMSurface):
    """A model name is the client's to choose: it must not become a metric label, nor reach a
    log line whole or in a form the log file cannot encode."""

    def setUp(self) -> None:
        super().setUp()
        self.logged = capture_request_log(self)

    async def scrape(self) -> str:
        response = raw_request(self.port, "GET", "/metrics")
        await response.closed
        self.assertEqual(response.status, 200, response.body_text()[:300])
        return response.body_text()

    @async_test
    async def test_a_lone_surrogate_cannot_break_metrics_or_the_log(self) -> None:
        await self.error(chat(model="x\ud800\nforged line"), 404, "not_found_error")
        text = await self.scrape()
        self.assertEqual(
            metric(text, "homelab_gateway_requests_total", outcome="bad_request", model="unknown"),
            1,
        )
        self.assertNotIn("forged", text)
        await wait_for(lambda: len(self.logged) == 1, what="the log event")
        event = self.logged[0]
        line = formatEvent(event)
        line.encode("utf-8")  # what a text log file does with it
        self.assertNotIn("\n", line)
        self.assertEqual(event["model"], "x\\ud800\\nforged line")
        json.dumps(event["model"], ensure_ascii=False).encode("utf-8")

    @async_test
    async def test_unknown_names_are_not_kept(self) -> None:
        for i in range(20):
            await self.post(chat(model=f"ghost-{i}-" + "m" * 5000))
        text = await self.scrape()
        self.assertNotIn("ghost", text)
        self.assertLess(len(text), 20_000)
        await wait_for(lambda: len(self.logged) == 20, what="the log events")
        self.assertTrue(all(len(formatEvent(e)) < 1000 for e in self.logged))
        served = await self.post(chat())
        self.assertEqual(served.status, 200)
        text = await self.scrape()
        labels = {"upstream": "vllm", "surface": "messages", "model": "reasoning"}
        self.assertEqual(metric(text, "homelab_gateway_requests_total", **labels), 1)


def test_loggable_caps_and_escapes() -> None:
    assert loggable("modèle-7b") == "modèle-7b"
    assert loggable("a\x00b\u2028c\ud800") == "a\\x00b\\u2028c\\ud800"
    assert loggable("x" * 500) == "x" * 200 + "..."


@given(st.text(alphabet=st.characters(exclude_categories=()), max_size=400))
def test_anything_loggable_is_one_encodable_bounded_line(text: str) -> None:
    shown = loggable(text, limit=50)
    shown.encode("utf-8")
    assert shown.isprintable()
    assert len(shown) <= 50 * len("\\U0010ffff") + len("...")
    assert shown == text or len(text) > 50 or not text.isprintable()


class SilentConnections(LLMSurface):
    """Twisted's idle timeout is 60 s whatever `request_timeout` says: a generous bound far
    below that shows the gateway's own limit acted."""

    gateway_overrides = {"server": {"request_timeout": 0.5}}

    async def closed_soon(self, connection: RawResponse) -> None:
        self.addCleanup(lambda: connection.transport and connection.transport.abortConnection())
        await connection.closed.addTimeout(20, reactor)

    @async_test
    async def test_a_connection_that_sends_nothing_is_closed_without_an_answer(self) -> None:
        connection = send_raw(self.port)
        await self.closed_soon(connection)
        self.assertEqual(connection.raw, b"")

    @async_test
    async def test_an_idle_keep_alive_connection_is_closed_after_its_answer(self) -> None:
        connection = send_raw(self.port, b"GET /healthz HTTP/1.1\r\nHost: gw\r\n\r\n")
        await connection.until(lambda: connection.raw.endswith(b"0\r\n\r\n"))
        await self.closed_soon(connection)
        self.assertEqual(connection.raw.count(b"HTTP/1.1 "), 1, connection.raw)
        self.assertEqual(connection.status, 200)

    @async_test
    async def test_keep_alive_still_serves_the_next_request(self) -> None:
        request = b"GET /healthz HTTP/1.1\r\nHost: gw\r\n\r\n"
        connection = send_raw(self.port, request)
        await connection.until(lambda: connection.raw.count(b"0\r\n\r\n") == 1)
        connection.transport.write(request)
        await connection.until(lambda: connection.raw.count(b"0\r\n\r\n") == 2)
        await self.closed_soon(connection)
        self.assertEqual(connection.raw.count(b"HTTP/1.1 200 OK"), 2)


class Refusals(LLMSurface):
    """What the wire and the router refuse still comes in the gateway's shape with an id."""

    def setUp(self) -> None:
        super().setUp()
        self.failures: list[dict[str, Any]] = []

        def observe(event: dict[str, Any]) -> None:
            if event.get("log_failure") is not None or event.get("isError"):
                self.failures.append(event)

        globalLogPublisher.addObserver(observe)
        self.addCleanup(globalLogPublisher.removeObserver, observe)

    async def get(self, path: str, **kw: Any) -> RawResponse:
        response = raw_request(self.port, kw.pop("method", "GET"), path, **kw)
        await response.closed
        self.assertTrue((response.header("request-id") or "").startswith("req_"), path)
        return response

    def assert_json_error(self, response: RawResponse, status: int, anthropic: bool) -> str:
        self.assertEqual(response.status, status, response.raw[:300])
        self.assertEqual(response.header("content-type"), "application/json")
        document = json.loads(response.body_text())
        if anthropic:
            self.assertEqual(document["type"], "error")
        else:
            self.assertEqual(document["error"]["code"], status)
        return str(document["error"]["message"])

    @async_test
    async def test_one_header_line_over_16_kib_gets_431(self) -> None:
        response = await self.get("/llm/v1/models", headers={"X-Big": "y" * 20_000})
        self.assert_json_error(response, 431, anthropic=True)

    @async_test
    async def test_a_request_line_over_the_limit_gets_414(self) -> None:
        response = await self.get("/openai/" + "a" * 20_000)
        self.assert_json_error(response, 414, anthropic=False)

    @async_test
    async def test_a_malformed_request_gets_a_json_400(self) -> None:
        connection = send_raw(self.port, b"NONSENSE\r\n\r\n")
        await connection.closed
        self.assert_json_error(connection, 400, anthropic=False)
        self.assertTrue(connection.header("request-id").startswith("req_"))

    @async_test
    async def test_every_answer_has_a_request_id(self) -> None:
        for path in ("/healthz", "/readyz", "/metrics", "/llm/v1/models", "/llm/v1/status"):
            await self.get(path)
        self.assertEqual((await self.get("/openai")).status, 308)
        self.assert_json_error(await self.get("/nowhere"), 404, anthropic=False)
        self.assert_json_error(await self.get("/llm/v1/nothing"), 404, anthropic=True)
        self.assert_json_error(await self.get("/llm/v1/models/ghost"), 404, anthropic=True)

    @async_test
    async def test_an_encoded_newline_in_a_path_gets_a_json_404(self) -> None:
        self.assert_json_error(await self.get("/openai/a%0ab"), 404, anthropic=False)
        self.assert_json_error(await self.get("/llm/v1/models/a%0ab"), 404, anthropic=True)
        self.assertEqual(self.stub.stats.requests, 0)

    @async_test
    async def test_a_non_utf8_escape_gets_a_json_400_and_no_traceback(self) -> None:
        self.assert_json_error(await self.get("/openai/%ff"), 400, anthropic=False)
        self.assert_json_error(await self.get("/llm/v1/models/%c3"), 400, anthropic=True)
        connection = send_raw(self.port, b"GET /healthz HTTP/1.1\r\nHost: \xff\r\n\r\n")
        await connection.until(lambda: connection.raw.endswith(b"\r\n0\r\n\r\n"))
        connection.transport.loseConnection()
        await connection.closed
        self.assert_json_error(connection, 400, anthropic=False)
        self.assertEqual(self.failures, [])
        self.assertEqual(self.stub.stats.requests, 0)

    @async_test
    async def test_529_has_a_reason_phrase(self) -> None:
        response = await self.post(chat(content="overloaded"))
        self.assertEqual(response.status, 529)
        self.assertTrue(response.head.startswith("HTTP/1.1 529 Site Overloaded\r\n"))
        self.assertTrue(response.header("request-id").startswith("req_"))


def assert_shape(test: TestCase, status: int, body: bytes, shape: Shape, path: str) -> None:
    """`body` is an error in `shape`: Anthropic's (`type` "error"), OpenAI's (`param` beside
    the message), or the gateway's plain one (`code` the status)."""
    document = json.loads(body)
    if shape == "anthropic":
        test.assertEqual(document["type"], "error", path)
    elif shape == "openai":
        test.assertNotIn("type", document, path)
        test.assertIn("param", document["error"], path)
    else:
        test.assertEqual(document["error"]["code"], status, path)


class RefusalsBeforeAnyRoute(LLMSurface):
    """What the channel refuses before a route is chosen comes in the shape of the surface
    the path belongs to: every path of every surface in the table."""

    @async_test
    async def test_a_body_over_the_limit_is_a_413_in_each_surfaces_shape(self) -> None:
        site = self.servers.gateway.site
        site.limits = WireLimits(max_body_bytes=1000, max_header_bytes=16384, request_timeout=60)
        for row in SURFACES:
            for path in row.paths:
                response = raw_request(self.port, "POST", path.decode(), b"x" * 2000)
                await response.closed
                self.assertEqual(response.status, 413, path)
                assert_shape(self, 413, response.body_text().encode(), row.shape, path.decode())
        self.assertEqual(self.stub.stats.requests, 0)

    @async_test
    async def test_each_path_of_the_table_is_routed_to_its_surface(self) -> None:
        """A GET reaches the surface (its 405 says to POST), in the row's shape, and the
        request is counted under the row's name."""
        for row in SURFACES:
            for path in row.paths:
                response = raw_request(self.port, "GET", path.decode())
                await response.closed
                self.assertEqual(response.status, 405, path)
                self.assertEqual(response.header("allow"), "POST", path)
                assert_shape(self, 405, response.body_text().encode(), row.shape, path.decode())
        metrics = raw_request(self.port, "GET", "/metrics")
        await metrics.closed
        text = metrics.body_text()
        for row in SURFACES:
            self.assertIn(f'surface="{row.name}"', text, row.name)

    @async_test
    async def test_a_header_over_the_limit_is_a_431_in_each_surfaces_shape(self) -> None:
        for row in SURFACES:
            for path in row.paths:
                response = raw_request(
                    self.port, "POST", path.decode(), {}, {"X-Big": "y" * 20_000}
                )
                await response.closed
                self.assertEqual(response.status, 431, path)
                assert_shape(self, 431, response.body_text().encode(), row.shape, path.decode())


class Forms(TestCase):
    def test_a_form_post_is_not_parsed_into_args(self) -> None:
        """No route reads `request.args` from a body: Twisted's form parsing (the email
        package on every POST's Content-Type, a multipart body in memory) is off."""
        request = GatewayRequest(DummyChannel())
        request.requestHeaders.setRawHeaders(
            b"content-type", [b"application/x-www-form-urlencoded"]
        )
        request.gotLength(3)
        request.content.write(b"a=b")
        request.process = lambda: None  # type: ignore[method-assign]
        request.requestReceived(b"POST", b"/x?q=1", b"HTTP/1.1")
        self.assertEqual(request.args, {b"q": [b"1"]})
        self.assertEqual(request.content.read(), b"a=b")


class IdleTimers(TestCase):
    def test_only_request_timeout_bounds_a_request_that_arrives_slowly(self) -> None:
        """The channel's own deadlines are the documented ones: twisted.web's 60 s idle timer
        (one more timer per connection) does not cut a request that `request_timeout`
        still allows."""
        clock = MemoryReactorClock()
        limits = WireLimits(max_body_bytes=1000, max_header_bytes=16384, request_timeout=90)
        site = GatewaySite(Resource(), limits, reactor=clock)
        channel = site.buildProtocol(None)
        transport = StringTransport()
        channel.makeConnection(transport)
        channel.dataReceived(b"POST /llm/v1/messages HTTP/1.1\r\nHost: x\r\n")
        clock.advance(75)
        self.assertFalse(transport.disconnecting)
        clock.advance(20)
        self.assertTrue(transport.value().startswith(b"HTTP/1.1 408 "))
        self.assertTrue(transport.disconnecting)
        channel.connectionLost(Failure(ConnectionDone()))

    def test_a_request_too_slow_is_a_408_in_each_surfaces_shape(self) -> None:
        clock = MemoryReactorClock()
        limits = WireLimits(max_body_bytes=1000, max_header_bytes=16384, request_timeout=5)
        site = GatewaySite(Resource(), limits, reactor=clock)
        for row in SURFACES:
            for path in row.paths:
                channel = site.buildProtocol(None)
                transport = StringTransport()
                channel.makeConnection(transport)
                channel.dataReceived(b"POST " + path + b" HTTP/1.1\r\nHost: x\r\n")
                clock.advance(6)
                answer = transport.value()
                self.assertTrue(answer.startswith(b"HTTP/1.1 408 "), path)
                body = answer.partition(b"\r\n\r\n")[2]
                assert_shape(self, 408, body, row.shape, path.decode())
                channel.connectionLost(Failure(ConnectionDone()))
