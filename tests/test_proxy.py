"""The reverse-proxy layer against the real stub on loopback: streaming, cancellation, errors."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Coroutine
from typing import Any

from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.internet.protocol import Factory, Protocol
from twisted.trial.unittest import TestCase
from twisted.web.resource import Resource
from twisted.web.server import Site

from homelab_gateway.proxy import escapes_prefix, forward_headers, response_headers
from tests.helpers import Servers, chat, gateway_document, raw_request, wait_for


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
        await response.until_text('"content": "')
        response.disconnect()
        left = time.monotonic()
        await wait_for(lambda: self.log.events("cancelled"), 1.0, "the stub to log cancelled")
        self.assertLess(self.log.events("cancelled")[0][0] - left, 1.0)
        await wait_for(
            lambda: self.servers.gateway.pools["vllm"].slots.in_use == 0, 1.0, "the slot"
        )

    @async_test
    async def test_client_disconnect_before_upstream_headers_cancels_upstream(self) -> None:
        body = {**self.stream_body(), "stream": False}
        self.stub.settings.hold = 30  # non-streaming: headers come only with the answer
        response = raw_request(self.port, "POST", "/openai/chat/completions", body)
        await wait_for(lambda: self.log.events("start"), 2.0, "the stub to see the request")
        response.disconnect()
        await wait_for(lambda: self.log.events("cancelled"), 1.0, "the stub to log cancelled")
        await wait_for(
            lambda: self.servers.gateway.pools["vllm"].slots.in_use == 0, 1.0, "the slot"
        )

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
                lambda: len(gateway_side) == 1, 2.0, "the gateway to take the connection"
            )
            partial.disconnect()
            await partial.closed
            await wait_for(lambda: not gateway_side, 2.0, "the gateway to drop it")
        self.assertEqual(self.stub.stats.requests, 0)
        self.assertEqual(self.servers.gateway.pools["vllm"].slots.in_use, 0)

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
        await wait_for(lambda: self.log.events("cancelled"), 1.0, "the stub to log cancelled")

    @async_test
    async def test_unknown_path_is_404_and_bare_prefix_redirects(self) -> None:
        for path, status in (
            ("/nothing/here", 404),
            ("/", 404),
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
        await wait_for(lambda: self.stub.stats.in_flight == 2, 2.0, "two requests in flight")
        response = raw_request(self.port, "POST", "/openai/chat/completions", self.stream_body())
        await wait_for(
            lambda: len(self.servers.gateway.pools["vllm"].slots.waiting) == 1, 2.0, "it to queue"
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
        await wait_for(lambda: self.log.events("cancelled"), 2.0, "the stub to be cancelled")
        await wait_for(
            lambda: self.servers.gateway.pools["vllm"].slots.in_use == 0, 2.0, "the slot"
        )

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
