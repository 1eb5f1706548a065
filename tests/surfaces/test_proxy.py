"""The reverse-proxy layer against the real stub on loopback: streaming, cancellation, errors."""

from __future__ import annotations

import json
import select
import socket
import time
from collections.abc import Callable, Coroutine
from typing import Any

from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.internet.protocol import Factory, Protocol
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.trial.unittest import TestCase
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET, Site

from homelab_gateway.line.limiter import PositionedSemaphore, Replica
from homelab_gateway.line.pool import TOKENIZE_CONCURRENCY, Pool
from homelab_gateway.surfaces.proxy import escapes_prefix, forward_headers, response_headers
from homelab_gateway.upstream.client import LINGER_AFTER_END, AnswerComplete, Upstream
from testsupport.grammar import check_stream
from testsupport.helpers import (
    PROMPTLY,
    Servers,
    SoonerResetClock,
    chat,
    gateway_document,
    raw_request,
    wait_for,
)


def async_test(f: Callable[..., Coroutine[Any, Any, None]]) -> Callable[..., Deferred[None]]:
    def run(self: TestCase) -> Deferred[None]:
        return Deferred.fromCoroutine(f(self))

    run.__name__ = f.__name__
    return run


class HeaderHandling(TestCase):
    def test_hop_by_hop_and_connection_named_headers_are_dropped(self) -> None:
        out = forward_headers(
            [
                (b"Connection", [b"close, X-Secret"]),
                (b"X-Secret", [b"1"]),
                (b"Keep-Alive", [b"5"]),
                (b"Transfer-Encoding", [b"chunked"]),
                (b"TE", [b"trailers"]),
                (b"Upgrade", [b"h2c"]),
                (b"Proxy-Authorization", [b"Basic x"]),
                (b"Host", [b"gw"]),
                (b"Content-Length", [b"3"]),
                (b"Accept", [b"text/event-stream"]),
                (b"Authorization", [b"Bearer client"]),
            ],
            client_ip="10.1.2.3",
            proto="http",
            host=b"gw:8080",
            keep_authorization=True,
        )
        self.assertEqual(
            out,
            {
                b"accept": [b"text/event-stream"],
                b"authorization": [b"Bearer client"],
                b"x-forwarded-for": [b"10.1.2.3"],
                b"x-forwarded-proto": [b"http"],
                b"x-forwarded-host": [b"gw:8080"],
            },
        )

    def test_client_authorization_is_not_forwarded_to_an_upstream_with_its_own_key(self) -> None:
        out = forward_headers(
            [(b"Authorization", [b"Bearer client"])],
            client_ip="1.1.1.1",
            proto="http",
            host=None,
            keep_authorization=False,
        )
        self.assertNotIn(b"authorization", out)

    def test_x_forwarded_for_from_a_trusted_proxy_is_appended_to(self) -> None:
        out = forward_headers(
            [(b"X-Forwarded-For", [b"203.0.113.9"])],
            client_ip="10.0.0.2",
            proto="https",
            host=None,
            keep_authorization=True,
            trusted=True,
        )
        self.assertEqual(out[b"x-forwarded-for"], [b"203.0.113.9, 10.0.0.2"])

    def test_response_hop_by_hop_headers_are_dropped(self) -> None:
        kept = response_headers(
            [
                (b"Content-Type", [b"x"]),
                (b"Connection", [b"keep-alive, X-Hop"]),
                (b"X-Hop", [b"1"]),
                (b"Keep-Alive", [b"timeout=5"]),
                (b"X-Real", [b"2"]),
            ]
        )
        self.assertEqual([name for name, _ in kept], [b"Content-Type", b"X-Real"])

    def test_dot_segments_escape_however_encoded(self) -> None:
        for bad in (
            b"../etc",
            b"a/../../b",
            b"%2e%2e/x",
            b"a/%2E%2E%2Fb",
            b"..",
            b"./x",
            b"a\\..\\b",
        ):
            self.assertTrue(escapes_prefix(bad), bad)
        for good in (b"chat/completions", b"a..b/c", b"v1/models", b""):
            self.assertFalse(escapes_prefix(good), good)


class EchoHeaders(Resource):
    isLeaf = True

    def render(self, request: Any) -> bytes:
        headers = {
            k.decode().lower(): [v.decode() for v in vs]
            for k, vs in request.requestHeaders.getAllRawHeaders()
        }
        return json.dumps(
            {
                "path": request.uri.decode(),
                "method": request.method.decode(),
                "headers": headers,
                "body": request.content.read().decode(),
            }
        ).encode()


class Silent(Protocol):
    """Accepts the connection and never answers."""


class ProxyIntegration(TestCase):
    def setUp(self) -> None:
        self.servers = Servers(self)
        self.stub_url, self.stub, self.log = self.servers.stub(delay=0.05, content_tokens=10)
        self.echo_port = self.servers.listen(Site(EchoHeaders()))
        silent = Factory.forProtocol(Silent)
        self.silent_port = reactor.listenTCP(0, silent, interface="127.0.0.1")
        self.addCleanup(self.silent_port.stopListening)
        routes = [
            {"prefix": "/openai/", "upstream": "vllm"},
            {"prefix": "/echo/", "url": f"http://127.0.0.1:{self.echo_port}/base"},
            {"prefix": "/keyed/", "upstream": "keyed"},
            {"prefix": "/dead/", "url": "http://127.0.0.1:1"},
            {
                "prefix": "/silent/",
                "url": f"http://127.0.0.1:{self.silent_port.getHost().port}",
                "connect_timeout": 0.3,
            },
            {"prefix": "/stalls/", "upstream": "vllm", "idle_timeout": 0.3},
        ]
        document = gateway_document(self.stub_url, routes=routes)
        document["upstreams"]["keyed"] = {
            "url": f"http://127.0.0.1:{self.echo_port}",
            "slots": 1,
            "api_key_env": "TEST_KEY",
        }
        self.servers.start_gateway(document)
        self.port = self.servers.gateway_port

    def stream_body(self, content: str = "content-only") -> dict[str, Any]:
        return {
            "model": "m",
            "stream": True,
            "max_tokens": 50,
            "messages": [{"role": "user", "content": content}],
        }

    @async_test
    async def test_sse_passes_through_frame_by_frame(self) -> None:
        response = raw_request(self.port, "POST", "/openai/chat/completions", self.stream_body())
        await response.until_text("data: ")
        first_frame_at = time.monotonic()
        await response.closed
        completed_at = self.log.events("complete")[0][0]
        self.assertLess(first_frame_at, completed_at, "the first frame waited for the whole stream")
        self.assertEqual(response.status, 200)
        self.assertIsNone(response.header("content-encoding"))
        body = response.body_text()
        self.assertTrue(
            body.rstrip().endswith("data: [DONE]")
        )  # a passthrough: OpenAI's framing, untouched
        self.assertGreater(len(response.received), 3, "the body came in one piece")

    @async_test
    async def test_client_disconnect_mid_stream_cancels_upstream_within_a_second(self) -> None:
        response = raw_request(
            self.port, "POST", "/openai/chat/completions", self.stream_body("long")
        )
        await response.until_text('"content":"')
        response.disconnect()
        left = time.monotonic()
        await wait_for(lambda: self.log.events("cancelled"), what="the stub to log cancelled")
        self.assertLess(self.log.events("cancelled")[0][0] - left, PROMPTLY)
        await wait_for(lambda: self.servers.gateway.pools["vllm"].line.in_use == 0, what="the slot")

    @async_test
    async def test_client_disconnect_before_upstream_headers_cancels_upstream(self) -> None:
        body = {**self.stream_body(), "stream": False}
        self.stub.settings.hold = 30  # non-streaming: headers come only with the answer
        response = raw_request(self.port, "POST", "/openai/chat/completions", body)
        await wait_for(lambda: self.log.events("start"), what="the stub to see the request")
        response.disconnect()
        await wait_for(lambda: self.log.events("cancelled"), what="the stub to log cancelled")
        await wait_for(lambda: self.servers.gateway.pools["vllm"].line.in_use == 0, what="the slot")

    @async_test
    async def test_client_leaving_while_sending_its_body_never_reaches_the_upstream(self) -> None:
        gateway_side = self.servers.factories[-1].protocols
        for path in ("/openai/chat/completions", "/llm/v1/messages"):
            partial = raw_request(
                self.port,
                "POST",
                path,
                b'{"model": "m", "mess',
                headers={"Content-Length": "5000"},
                length=False,
            )
            await wait_for(
                lambda: len(gateway_side) == 1, what="the gateway to take the connection"
            )
            partial.disconnect()
            await partial.closed
            await wait_for(lambda: not gateway_side, what="the gateway to drop it")
        self.assertEqual(self.stub.stats.requests, 0)
        self.assertEqual(self.servers.gateway.pools["vllm"].line.in_use, 0)

    @async_test
    async def test_refused_upstream_is_502(self) -> None:
        response = raw_request(self.port, "GET", "/dead/x")
        await response.closed
        self.assertEqual(response.status, 502)
        self.assertIn("connection refused", json.loads(response.body_text())["error"]["message"])

    @async_test
    async def test_no_response_headers_within_connect_timeout_is_504(self) -> None:
        response = raw_request(self.port, "GET", "/silent/x")
        await response.closed
        self.assertEqual(response.status, 504)

    @async_test
    async def test_upstream_silent_past_idle_timeout_is_cut(self) -> None:
        response = raw_request(
            self.port, "POST", "/stalls/chat/completions", self.stream_body("stall")
        )
        await response.closed
        self.assertEqual(response.status, 200)
        self.assertFalse(
            response.raw.endswith(b"0\r\n\r\n"), "a cut body must not end like a complete one"
        )
        await wait_for(lambda: self.log.events("cancelled"), what="the stub to log cancelled")

    @async_test
    async def test_unknown_path_is_404_and_bare_prefix_redirects(self) -> None:
        for path, status in (
            ("/nothing/here", 404),
            ("/", 302),  # to the status page: no route can own "/"
            ("/openai", 308),
            ("/llm/v2/x", 404),
        ):
            response = raw_request(self.port, "GET", path)
            await response.closed
            self.assertEqual(response.status, status, path)

    @async_test
    async def test_dot_segments_cannot_escape_the_prefix(self) -> None:
        for path in ("/echo/../../etc/passwd", "/echo/%2e%2e/secret", "/echo/a/%2E%2E/%2e%2e/b"):
            response = raw_request(self.port, "GET", path)
            await response.closed
            self.assertEqual(response.status, 400, path)

    @async_test
    async def test_absolute_form_request_target_is_not_an_open_proxy(self) -> None:
        response = raw_request(self.port, "GET", f"http://127.0.0.1:{self.echo_port}/echo/x")
        await response.closed
        self.assertEqual(response.status, 404)

    @async_test
    async def test_path_query_body_and_headers_are_forwarded(self) -> None:
        response = raw_request(
            self.port,
            "POST",
            "/echo/a/b%20c?x=1&y=%2F",
            {"k": 1},
            headers={
                "Authorization": "Bearer mine",
                "X-Custom": "v",
                "Keep-Alive": "timeout=5",
                "X-Forwarded-For": "203.0.113.5",
                "Forwarded": "for=203.0.113.5",
                "X-Real-IP": "203.0.113.5",
                "X-Forwarded-Port": "443",
                "X-Forwarded-Prefix": "/admin",
                "X-Forwarded-Proto": "https",
            },
        )
        await response.closed
        echoed = json.loads(response.body_text())
        self.assertEqual(echoed["path"], "/base/a/b%20c?x=1&y=%2F")
        self.assertEqual(echoed["method"], "POST")
        self.assertEqual(echoed["body"], '{"k": 1}')
        headers = echoed["headers"]
        self.assertEqual(headers["authorization"], ["Bearer mine"])
        self.assertEqual(headers["x-custom"], ["v"])
        self.assertNotIn("keep-alive", headers)
        # The peer is no trusted proxy: what it claims about the original request is dropped.
        self.assertEqual(headers["x-forwarded-for"], ["127.0.0.1"])
        for claimed in ("forwarded", "x-real-ip", "x-forwarded-port", "x-forwarded-prefix"):
            self.assertNotIn(claimed, headers)
        self.assertEqual(headers["x-forwarded-proto"], ["http"])
        self.assertEqual(headers["x-forwarded-host"], [f"127.0.0.1:{self.port}"])
        self.assertEqual(response.header("content-length"), str(len(response.body_bytes())))

    @async_test
    async def test_upstream_key_replaces_the_clients_authorization(self) -> None:
        response = raw_request(
            self.port, "GET", "/keyed/x", headers={"Authorization": "Bearer mine"}
        )
        await response.closed
        self.assertEqual(
            json.loads(response.body_text())["headers"]["authorization"], ["Bearer sekrit"]
        )

    @async_test
    async def test_healthz_touches_no_upstream(self) -> None:
        response = raw_request(self.port, "GET", "/healthz")
        await response.closed
        self.assertEqual(
            (response.status, json.loads(response.body_text())), (200, {"status": "ok"})
        )
        self.assertEqual(self.stub.stats.requests, 0)

    @async_test
    async def test_passthrough_route_waits_silently_for_a_slot_it_shares(self) -> None:
        self.stub.settings.hold = 0.4
        holders = [
            raw_request(self.port, "POST", "/llm/v1/messages", chat(content="content-only"))
            for _ in range(2)
        ]
        await wait_for(lambda: self.stub.stats.in_flight == 2, what="two requests in flight")
        response = raw_request(self.port, "POST", "/openai/chat/completions", self.stream_body())
        await wait_for(
            lambda: len(self.servers.gateway.pools["vllm"].line.waiting) == 1,
            what="it to queue",
        )
        await response.closed
        self.assertTrue(
            response.body_text().startswith("data: {"), "no extension frames on this surface"
        )
        self.assertLessEqual(self.stub.stats.max_in_flight, 2)
        for holder in holders:
            await holder.closed


class Backpressure(TestCase):
    """A client that stops reading must pause the upstream, not fill the gateway's memory."""

    def setUp(self) -> None:
        self.servers = Servers(self)
        self.stub_url, self.stub, self.log = self.servers.stub(
            reasoning_tokens=0, content_tokens=400_000
        )
        self.servers.start_gateway(gateway_document(self.stub_url))
        self.port = self.servers.gateway_port

    async def check(self, path: str, body: dict[str, Any]) -> None:
        response = raw_request(self.port, "POST", path, body)
        await response.until(lambda: len(response.raw) > 0)
        response.transport.pauseProducing()  # stop reading, like a stalled browser tab
        await wait_for(lambda: self.stub.stats.paused > 0, 30.0, "the stub to be paused")
        self.assertEqual(self.log.events("complete"), [], "the whole stream was buffered somewhere")
        response.disconnect()
        await wait_for(lambda: self.log.events("cancelled"), what="the stub to be cancelled")
        await wait_for(lambda: self.servers.gateway.pools["vllm"].line.in_use == 0, what="the slot")

    @async_test
    async def test_through_the_proxy(self) -> None:
        body = {
            "model": "m",
            "stream": True,
            "max_tokens": 10**6,
            "messages": [{"role": "user", "content": "content-only"}],
        }
        await self.check("/openai/chat/completions", body)

    @async_test
    async def test_through_the_translator(self) -> None:
        await self.check("/llm/v1/messages", chat(content="content-only", max_tokens=10**6))


class UpstreamMisbehaviour(TestCase):
    """An upstream that breaks the rules in ways that used to pin a slot or run twice
    (issue 10): each test ends within seconds where the old code waited `idle_timeout`."""

    def setUp(self) -> None:
        self.servers = Servers(self)
        self.stub_url, self.stub, self.log = self.servers.stub()
        self.servers.start_gateway(gateway_document(self.stub_url, server={"ping_interval": 0.1}))
        self.port = self.servers.gateway_port
        self.slots = self.servers.gateway.pools["vllm"].line

    async def answered(self, response: Any) -> None:
        await wait_for(lambda: response.closed.called, what="the client to be answered")

    async def connection_closed(self) -> None:
        stub_side = self.servers.factories[0].protocols
        await wait_for(lambda: not stub_side, what="the gateway to close the open body")

    async def upstream_closed(self) -> None:
        await wait_for(lambda: self.stub.stats.in_flight == 0, what="the upstream to be closed")
        await wait_for(lambda: self.slots.in_use == 0, what="the slot")

    @async_test
    async def test_done_ends_a_stream_whose_body_stays_open(self) -> None:
        response = raw_request(
            self.port, "POST", "/llm/v1/messages", chat(content="open-after-done")
        )
        await self.answered(response)
        frames = [d for _, d in response.frames()]
        self.assertEqual(check_stream(frames, allow_queue=False), "complete")
        self.assertEqual(response.events()[-1], "message_stop", "no ping after message_stop")
        self.assertEqual(self.slots.in_use, 0)
        await self.connection_closed()
        await self.upstream_closed()

    @async_test
    async def test_done_answers_a_non_streaming_client_at_once(self) -> None:
        body = chat(content="open-after-done", stream=False)
        response = raw_request(self.port, "POST", "/llm/v1/messages", body)
        await self.answered(response)
        self.assertEqual(response.status, 200)
        self.assertEqual(json.loads(response.body_text())["stop_reason"], "end_turn")
        await self.connection_closed()
        await self.upstream_closed()

    @async_test
    async def test_an_endless_error_body_is_cut_and_the_client_answered(self) -> None:
        response = raw_request(self.port, "POST", "/llm/v1/messages", chat(content="endless-error"))
        await self.answered(response)
        self.assertGreaterEqual(response.status, 500)
        self.assertEqual(json.loads(response.body_text())["type"], "error")
        await self.upstream_closed()

    @async_test
    async def test_an_endless_line_fails_the_stream_with_an_error_frame(self) -> None:
        response = raw_request(self.port, "POST", "/llm/v1/messages", chat(content="long-line"))
        await self.answered(response)
        frames = [d for _, d in response.frames()]
        self.assertEqual(check_stream(frames, allow_queue=False), "error")
        self.assertIn("exceeded", frames[-1]["error"]["message"])
        await self.upstream_closed()

    @async_test
    async def test_a_request_the_upstream_read_then_dropped_is_not_sent_again(self) -> None:
        response = raw_request(self.port, "POST", "/llm/v1/messages", chat(content="hangup"))
        await self.answered(response)
        self.assertEqual(response.status, 502)
        self.assertEqual(self.stub.stats.requests, 1, "the upstream counted it twice")

    @async_test
    async def test_a_passthrough_post_the_upstream_read_then_dropped_is_not_sent_again(
        self,
    ) -> None:
        body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hangup"}]}
        response = raw_request(self.port, "POST", "/openai/chat/completions", body)
        await self.answered(response)
        self.assertEqual(response.status, 502)
        self.assertEqual(self.stub.stats.requests, 1, "the upstream counted it twice")


class CountsRequests(Resource):
    """Answers every POST with a canned complete stream and counts what it was sent."""

    isLeaf = True

    def __init__(self) -> None:
        super().__init__()
        self.requests = 0

    def render_POST(self, request: Any) -> bytes:
        self.requests += 1
        request.setHeader(b"content-type", b"text/event-stream")
        return b'data: {"choices":[]}\n\ndata: [DONE]\n\n'


class StalePooledConnection(TestCase):
    @async_test
    async def test_an_idle_connection_the_upstream_closed_is_not_written_to(self) -> None:
        """The upstream's close has arrived but the reactor has not read it yet: the request
        must go on a new connection. Open no longer resends what may have been written (issue
        10, item 9), so without the check before the write this request would fail."""
        servers = Servers(self)
        counter = CountsRequests()
        port = servers.listen(Site(counter))
        servers.start_gateway(gateway_document(f"http://127.0.0.1:{port}/v1"))
        upstream = servers.gateway.pools["vllm"].upstream
        pool = servers.gateway.http_pool

        async def post() -> bytes:
            headers = {b"content-type": [b"application/json"]}
            response = await upstream.open(
                "POST", upstream.url + "/chat/completions", headers, b"{}"
            )
            return await upstream.read_limited(response)

        await post()
        await wait_for(lambda: any(pool._connections.values()), what="the connection to be pooled")
        [server_side] = servers.factories[0].protocols
        server_side.transport.getHandle().shutdown(socket.SHUT_WR)  # its close, on the wire now
        [cached] = next(c for c in pool._connections.values() if c)
        readable, _, _ = select.select([cached.transport.getHandle()], [], [], 5.0)
        self.assertTrue(readable, "the close did not arrive")
        second = Deferred.fromCoroutine(post())  # written before the reactor can read the close
        self.assertIn(b"[DONE]", await second)
        self.assertEqual(counter.requests, 2)


class IdleTimerAndBackpressure(TestCase):
    def test_the_idle_timer_does_not_run_while_the_gateway_pauses_the_upstream(self) -> None:
        """A slow client pauses the upstream; its silence then is not the upstream's fault
        (issue 10, item 10)."""
        clock = Clock()
        upstream = Upstream(
            name="vllm", url="", http=None, clock=clock, connect_timeout=1, idle_timeout=5
        )
        producers: list[Any] = []
        transport = StringTransport()

        class Response:
            def deliverBody(self, protocol: Protocol) -> None:
                protocol.makeConnection(transport)

        done = upstream.stream(Response(), lambda data: None, producers.append)  # type: ignore[arg-type]
        failures: list[Any] = []
        done.addErrback(failures.append)
        self.addCleanup(done.cancel)
        [producer] = producers
        producer.pauseProducing()
        self.assertEqual(transport.producerState, "paused")
        clock.advance(60)
        self.assertEqual(failures, [], "the upstream was blamed for the gateway's own pause")
        producer.resumeProducing()
        self.assertEqual(transport.producerState, "producing")
        clock.advance(5)
        self.assertEqual(transport.producerState, "stopped", "silent while producing: cut")

    def test_an_answers_end_moves_no_timer_sooner(self) -> None:
        """The idle timer gives way to the shorter linger as a new call: a `reset` to a sooner
        time cost a search of the reactor's every timer, ~3 ms per answer with 5,000 waiting."""
        clock = SoonerResetClock()
        upstream = Upstream(
            name="vllm", url="", http=None, clock=clock, connect_timeout=1, idle_timeout=300
        )
        transport = StringTransport()

        class Response:
            def deliverBody(self, protocol: Protocol) -> None:
                protocol.makeConnection(transport)
                protocol.dataReceived(b"tokens")
                protocol.dataReceived(b"[DONE]")

        def on_data(data: bytes) -> None:
            if data == b"[DONE]":
                raise AnswerComplete()

        done = upstream.stream(Response(), on_data)  # type: ignore[arg-type]
        self.assertIsNone(self.successResultOf(done))
        self.assertEqual(clock.moved_sooner, 0)
        self.assertEqual(len(clock.getDelayedCalls()), 1, "the idle timer is gone")
        clock.advance(LINGER_AFTER_END)
        self.assertEqual(transport.producerState, "stopped", "the linger still ends it")


class HoldsTokenize(Resource):
    """A /tokenize that answers only when told, counting how many it holds at once."""

    isLeaf = True

    def __init__(self) -> None:
        super().__init__()
        self.held: list[Any] = []
        self.most = 0

    def render_POST(self, request: Any) -> Any:
        self.held.append(request)
        self.most = max(self.most, len(self.held))
        return NOT_DONE_YET

    def answer_all(self) -> None:
        held, self.held = self.held, []
        for request in held:
            request.write(
                json.dumps({"count": 7, "max_model_len": 100, "tokens": [1] * 7}).encode()
            )
            request.finish()


class CountTokensCap(TestCase):
    @async_test
    async def test_a_burst_of_count_tokens_is_capped_per_upstream(self) -> None:
        """100 count_tokens with slots = 2 opened 100 /tokenize requests (issue 10, item 5)."""
        servers = Servers(self)
        tokenizer = HoldsTokenize()
        port = servers.listen(Site(tokenizer))
        servers.start_gateway(gateway_document(f"http://127.0.0.1:{port}/v1"))
        pool = servers.gateway.pools["vllm"]
        body = chat(stream=False)
        responses = [
            raw_request(servers.gateway_port, "POST", "/llm/v1/messages/count_tokens", body)
            for _ in range(10)
        ]
        await wait_for(lambda: len(pool.tokenizer.waiting) == 10 - TOKENIZE_CONCURRENCY, 5.0)
        await wait_for(lambda: len(tokenizer.held) == TOKENIZE_CONCURRENCY, 5.0)
        self.assertEqual(pool.line.in_use, 0, "a count takes no generation slot")
        while any(not r.closed.called for r in responses):
            tokenizer.answer_all()
            await wait_for(lambda: tokenizer.held or all(r.closed.called for r in responses))
        self.assertEqual(tokenizer.most, TOKENIZE_CONCURRENCY)
        for response in responses:
            self.assertEqual(json.loads(response.body_text()), {"input_tokens": 7})


class CountTokensWaiters(TestCase):
    """A count waiting for a tokenizer place is a waiter like any other: at most the line's
    queue_limit of them and the client's max_waiting; one more gets the estimate at once
    rather than holding its request for up to connect_timeout."""

    def setUp(self) -> None:
        self.clock = Clock()
        upstream = Upstream(
            name="vllm", url="", http=None, clock=self.clock, connect_timeout=5, idle_timeout=300
        )
        replica = Replica("vllm", 2)
        PositionedSemaphore([replica], self.clock, queue_limit=3, max_waiting={"greedy": 1})
        self.pool = Pool(upstream, replica, queue_timeout=60)

    def hold(self, client: str) -> Deferred[Any]:
        return Deferred.fromCoroutine(self.pool.hold_tokenizer(self.clock, client))

    def test_bounded_by_the_line_and_the_client(self) -> None:
        places = [self.successResultOf(self.hold("c")) for _ in range(TOKENIZE_CONCURRENCY)]
        greedy = [self.hold("greedy"), self.hold("greedy")]
        self.assertNoResult(greedy[0])
        self.assertIsNone(self.successResultOf(greedy[1]), "over the client's max_waiting")
        others = [self.hold("c") for _ in range(3)]
        self.assertNoResult(others[0])
        self.assertNoResult(others[1])
        self.assertIsNone(self.successResultOf(others[2]), "over the line's queue_limit")
        places[0].release()
        self.assertIs(self.successResultOf(greedy[0]), self.pool.tokenizer)
        self.clock.advance(5)
        self.assertEqual([self.successResultOf(d) for d in others[:2]], [None, None])
        self.assertEqual(self.pool.counting, {})

    @async_test
    async def test_one_over_the_bound_is_answered_with_the_estimate_at_once(self) -> None:
        servers = Servers(self)
        tokenizer = HoldsTokenize()
        port = servers.listen(Site(tokenizer))
        document = gateway_document(f"http://127.0.0.1:{port}/v1", upstream={"queue_limit": 2})
        servers.start_gateway(document)
        pool = servers.gateway.pools["vllm"]
        path = "/llm/v1/messages/count_tokens"
        responses = [
            raw_request(servers.gateway_port, "POST", path, chat(stream=False)) for _ in range(10)
        ]
        await wait_for(lambda: len(tokenizer.held) == TOKENIZE_CONCURRENCY, 5.0)
        await wait_for(lambda: sum(r.closed.called for r in responses) == 4, 5.0)
        self.assertEqual(len(pool.tokenizer.waiting), 2)
        estimated = [json.loads(r.body_text()) for r in responses if r.closed.called]
        self.assertNotIn({"input_tokens": 7}, estimated)
        while not all(r.closed.called for r in responses):
            tokenizer.answer_all()
            await wait_for(lambda: tokenizer.held or all(r.closed.called for r in responses))
        counted = [json.loads(r.body_text()) for r in responses].count({"input_tokens": 7})
        self.assertEqual(counted, TOKENIZE_CONCURRENCY + 2)


class ErrorBodyBounds(TestCase):
    def test_an_error_body_trickling_forever_is_given_up_after_connect_timeout(self) -> None:
        """Under the size limit but never ending: the time bound answers the client (issue 10,
        item 4); the idle timer alone would wait forever for a byte every few seconds."""
        clock = Clock()
        upstream = Upstream(
            name="vllm", url="", http=None, clock=clock, connect_timeout=5, idle_timeout=300
        )
        transport = StringTransport()
        protocols: list[Protocol] = []

        class Response:
            def deliverBody(self, protocol: Protocol) -> None:
                protocols.append(protocol)
                protocol.makeConnection(transport)

        body = Deferred.fromCoroutine(upstream.read_limited(Response()))  # type: ignore[arg-type]
        got: list[bytes] = []
        body.addCallback(got.append)
        for _ in range(4):
            protocols[0].dataReceived(b'{"error"')
            clock.advance(1)
        self.assertEqual(got, [])
        clock.advance(1)
        self.assertEqual(got, [b'{"error"' * 4])
        self.assertEqual(transport.producerState, "stopped", "the connection is closed")
