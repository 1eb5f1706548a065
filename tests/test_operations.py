"""What an operator relies on: metrics, request logs, keys, CORS, limits, readiness, drain."""

from __future__ import annotations

import hashlib
import hmac
import json
import re
from dataclasses import replace
from typing import Any

from twisted.internet.defer import Deferred
from twisted.logger import formatEvent
from twisted.web.client import _HTTP11ClientFactory as HTTP11ClientFactory

from homelab_gateway.web.access import AccessPolicy
from tests.surfaces.test_llm import LLMSurface
from tests.surfaces.test_proxy import async_test
from testsupport.grammar import check_stream
from testsupport.helpers import (
    Servers,
    capture_log,
    capture_request_log,
    chat,
    gateway_document,
    raw_request,
    wait_for,
)

KEY = "sk-gw-correct-horse"


def metric(text: str, name: str, **labels: str) -> float:
    """The value of one sample in Prometheus text format (0 if absent)."""
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        match = re.match(r"([a-z_]+)(?:\{(.*)\})? (\S+)$", line)
        if not match or match.group(1) != name:
            continue
        have = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2) or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            return float(match.group(3))
    return 0.0


class Metrics(LLMSurface):
    stub_settings = {"hold": 0.5, "reasoning_tokens": 2, "content_tokens": 3}
    gateway_overrides = {"slots": 1}

    async def scrape(self) -> str:
        response = raw_request(self.port, "GET", "/metrics")
        await response.closed
        self.assertEqual(response.status, 200)
        self.assertTrue(response.header("content-type").startswith("text/plain"))
        return response.body_text()

    @async_test
    async def test_values_move_as_requests_run(self) -> None:
        before = await self.scrape()
        self.assertEqual(metric(before, "homelab_gateway_slots", upstream="vllm"), 1)
        first = raw_request(self.port, "POST", "/llm/v1/messages", chat())
        await wait_for(lambda: self.slots.in_use == 1, what="the slot to fill")
        queued = raw_request(self.port, "POST", "/llm/v1/messages", chat())
        await wait_for(lambda: len(self.slots.waiting) == 1, what="one to queue")
        during = await self.scrape()
        self.assertEqual(metric(during, "homelab_gateway_slots_in_use", upstream="vllm"), 1)
        self.assertEqual(metric(during, "homelab_gateway_queue_waiting", upstream="vllm"), 1)
        await first.closed
        await queued.closed
        await self.settled()
        after = await self.scrape()
        self.assertEqual(metric(after, "homelab_gateway_queue_waiting", upstream="vllm"), 0)
        self.assertEqual(metric(after, "homelab_gateway_slots_in_use", upstream="vllm"), 0)
        labels = {"upstream": "vllm", "surface": "messages", "model": "reasoning"}
        self.assertEqual(
            metric(after, "homelab_gateway_requests_total", outcome="completed", **labels), 2
        )
        self.assertEqual(
            metric(
                after, "homelab_gateway_output_tokens_total", upstream="vllm", model="reasoning"
            ),
            10,
        )
        self.assertEqual(
            metric(after, "homelab_gateway_queue_wait_seconds_count", upstream="vllm"), 2
        )
        self.assertGreater(
            metric(after, "homelab_gateway_queue_wait_seconds_sum", upstream="vllm"), 0.3
        )
        self.assertEqual(
            metric(
                after,
                "homelab_gateway_time_to_first_token_seconds_count",
                upstream="vllm",
                model="reasoning",
            ),
            2,
        )

    @async_test
    async def test_outcomes_and_cancellations_are_counted(self) -> None:
        await self.post(chat(model="ghost"))
        leaver = raw_request(self.port, "POST", "/llm/v1/messages", chat(content="long"))
        await wait_for(lambda: self.log.events("start"), what="the upstream request")
        leaver.disconnect()
        await wait_for(lambda: self.log.events("cancelled"), what="the cancel")
        await self.settled()
        text = await self.scrape()
        self.assertEqual(
            metric(text, "homelab_gateway_requests_total", outcome="bad_request", model="unknown"),
            1,
        )
        self.assertEqual(
            metric(text, "homelab_gateway_requests_total", outcome="client_disconnected"), 1
        )
        self.assertEqual(
            metric(text, "homelab_gateway_upstream_cancellations_total", upstream="vllm"), 1
        )


class QuietLog(LLMSurface):
    @async_test
    async def test_a_request_logs_its_own_line_and_no_connection_of_its_upstream(self) -> None:
        """One line per request, the gateway's: not Twisted's "Starting factory" and "Stopping
        factory" pair for each upstream connection it opens."""
        events = capture_log(self)
        responses = [raw_request(self.port, "POST", "/llm/v1/messages", chat()) for _ in range(2)]
        for response in responses:
            await response.closed
        await self.servers.gateway.http_pool.closeCachedConnections()
        upstream = [e for e in events if isinstance(e.get("factory"), HTTP11ClientFactory)]
        self.assertEqual([formatEvent(e) for e in upstream], [])
        requests = [e for e in events if e.get("log_namespace") == "homelab_gateway.requests"]
        self.assertEqual(len(requests), 2)


class RequestLog(LLMSurface):
    def setUp(self) -> None:
        super().setUp()
        self.logged = capture_request_log(self)

    @async_test
    async def test_one_event_per_request_with_the_fields_and_no_secrets(self) -> None:
        secret_prompt = "my secret prompt text"
        response = await self.post(chat(content=secret_prompt), headers={"x-api-key": KEY})
        self.assertEqual(response.status, 200)
        await wait_for(lambda: len(self.logged) == 1, what="the log event")
        event = self.logged[0]
        for field in (
            "request_id",
            "surface",
            "model",
            "upstream",
            "stream",
            "queue_wait",
            "time_to_first_token",
            "duration",
            "input_tokens",
            "output_tokens",
            "stop_reason",
            "outcome",
            "status",
        ):
            self.assertIn(field, event)
        self.assertEqual(
            (event["surface"], event["model"], event["upstream"]), ("messages", "reasoning", "vllm")
        )
        self.assertEqual(
            (event["outcome"], event["status"], event["stop_reason"]),
            ("completed", 200, "end_turn"),
        )
        self.assertEqual(event["request_id"], response.header("request-id"))
        self.assertEqual(event["output_tokens"], 16)
        everything = json.dumps({k: str(v) for k, v in event.items()})
        self.assertNotIn("secret prompt", everything)
        self.assertNotIn(KEY, everything)
        self.assertNotIn("Hello!", everything)  # the completion text


class Keys(LLMSurface):
    def setUp(self) -> None:
        self.servers = Servers(self)
        self.stub_url, self.stub, self.log = self.servers.stub()
        document = gateway_document(self.stub_url)
        document["auth"] = {"api_keys_env": "GATEWAY_KEYS"}
        self.servers.start_gateway(document, environ={"GATEWAY_KEYS": f"other-key, {KEY}"})
        self.port = self.servers.gateway_port

    @async_test
    async def test_llm_and_routes_need_a_key(self) -> None:
        message = await self.error(chat(), 401, "authentication_error")
        self.assertNotIn(KEY, message)
        await self.error(chat(), 401, "authentication_error", headers={"x-api-key": "wrong"})
        await self.error(
            chat(), 401, "authentication_error", headers={"Authorization": f"Basic {KEY}"}
        )
        self.assertEqual((await self.post(chat(), headers={"x-api-key": KEY})).status, 200)
        self.assertEqual(
            (await self.post(chat(), headers={"Authorization": f"Bearer {KEY}"})).status, 200
        )
        response = raw_request(self.port, "GET", "/openai/models")
        await response.closed
        self.assertEqual(response.status, 401)
        self.assertEqual(json.loads(response.body_text())["error"]["type"], "authentication_error")
        response = raw_request(self.port, "GET", "/llm/v1/models")
        await response.closed
        self.assertEqual(response.status, 401)

    @async_test
    async def test_health_metrics_and_status_stay_open(self) -> None:
        for path in ("/healthz", "/readyz", "/metrics", "/llm/v1/status"):
            response = raw_request(self.port, "GET", path)
            await response.closed
            self.assertIn(response.status, (200, 503), path)  # 503: readiness not probed yet

    def test_every_key_is_compared_whatever_matches(self) -> None:
        calls: list[int] = []
        original = hmac.compare_digest

        def counting(a: bytes, b: bytes) -> bool:
            calls.append(1)
            return original(a, b)

        policy = AccessPolicy(["k1", "k2", "k3"], protect_metrics=False, cors_origins=())
        self.patch(hmac, "compare_digest", counting)
        request = _FakeRequest({b"x-api-key": b"k1"})
        self.assertEqual(policy.key_name(request), "key-" + hashlib.sha256(b"k1").hexdigest()[:8])
        self.assertEqual(len(calls), 3, "stopped at the first match")
        calls.clear()
        self.assertIsNone(policy.key_name(_FakeRequest({b"x-api-key": b"nope"})))
        self.assertEqual(len(calls), 3)


class _FakeRequest:
    def __init__(self, headers: dict[bytes, bytes]) -> None:
        self.headers = headers

    def getHeader(self, name: bytes) -> bytes | None:
        return self.headers.get(name)


class ProtectedMetrics(LLMSurface):
    def setUp(self) -> None:
        self.servers = Servers(self)
        self.stub_url, self.stub, self.log = self.servers.stub()
        document = gateway_document(self.stub_url)
        document["auth"] = {"api_keys_env": "GATEWAY_KEYS", "protect_metrics": True}
        self.servers.start_gateway(document, environ={"GATEWAY_KEYS": KEY})
        self.port = self.servers.gateway_port

    @async_test
    async def test_metrics_and_status_need_the_key(self) -> None:
        for path in ("/metrics", "/llm/v1/status"):
            response = raw_request(self.port, "GET", path)
            await response.closed
            self.assertEqual(response.status, 401, path)
            response = raw_request(self.port, "GET", path, headers={"x-api-key": KEY})
            await response.closed
            self.assertEqual(response.status, 200, path)


class Cors(LLMSurface):
    gateway_overrides = {"server": {"cors_origins": ["https://chat.home.lan"]}}

    @async_test
    async def test_preflight_for_a_listed_origin(self) -> None:
        response = raw_request(
            self.port,
            "OPTIONS",
            "/llm/v1/messages",
            headers={
                "Origin": "https://chat.home.lan",
                "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "content-type, x-api-key, anthropic-version",
            },
        )
        await response.closed
        self.assertEqual(response.status, 204)
        self.assertEqual(response.header("access-control-allow-origin"), "https://chat.home.lan")
        self.assertIn("POST", response.header("access-control-allow-methods"))
        self.assertEqual(
            response.header("access-control-allow-headers"),
            "content-type, x-api-key, anthropic-version",
        )
        self.assertEqual(self.stub.stats.requests, 0)

    @async_test
    async def test_an_unlisted_origin_gets_no_allow_origin(self) -> None:
        response = raw_request(
            self.port,
            "OPTIONS",
            "/llm/v1/messages",
            headers={"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"},
        )
        await response.closed
        self.assertIsNone(response.header("access-control-allow-origin"))
        response = await self.post(chat(), headers={"Origin": "https://evil.example"})
        self.assertIsNone(response.header("access-control-allow-origin"))

    @async_test
    async def test_the_actual_request_echoes_the_origin_and_exposes_request_id(self) -> None:
        response = await self.post(chat(), headers={"Origin": "https://chat.home.lan"})
        self.assertEqual(response.header("access-control-allow-origin"), "https://chat.home.lan")
        self.assertIn("request-id", response.header("access-control-expose-headers"))
        self.assertEqual(response.header("vary"), "Origin")


class WireLimits(LLMSurface):
    gateway_overrides = {
        "server": {"max_body_bytes": 1000, "request_timeout": 0.5, "max_header_bytes": 2048}
    }

    @async_test
    async def test_oversized_body_is_refused_before_it_is_read(self) -> None:
        response = raw_request(
            self.port,
            "POST",
            "/llm/v1/messages",
            b"",
            headers={"Content-Length": "5000000"},
            length=False,
        )
        await response.closed  # answered from the headers alone: no body was ever sent
        self.assertEqual(response.status, 413)
        self.assertEqual(json.loads(response.body_text())["error"]["type"], "request_too_large")

    @async_test
    async def test_oversized_chunked_body_is_refused_as_it_arrives(self) -> None:
        chunk = b"x" * 800
        body = b"%x\r\n%s\r\n" % (len(chunk), chunk) * 3 + b"0\r\n\r\n"
        response = raw_request(
            self.port,
            "POST",
            "/openai/chat/completions",
            body,
            headers={"Transfer-Encoding": "chunked"},
            length=False,
        )
        await response.closed
        self.assertEqual(response.status, 413)

    @async_test
    async def test_a_body_that_never_finishes_is_dropped_after_request_timeout(self) -> None:
        response = raw_request(
            self.port,
            "POST",
            "/llm/v1/messages",
            b'{"model"',
            headers={"Content-Length": "100"},
            length=False,
        )
        await response.closed
        self.assertEqual(response.status, 408)

    @async_test
    async def test_oversized_headers_are_refused(self) -> None:
        headers = {f"X-Big-{i}": "y" * 500 for i in range(6)}
        response = raw_request(self.port, "GET", "/healthz", headers=headers)
        await response.closed
        self.assertEqual(response.status, 431)
        self.assertEqual(json.loads(response.body_text())["error"]["code"], 431)
        self.assertTrue(response.header("request-id").startswith("req_"))


class WriteStall(LLMSurface):
    stub_settings = {"reasoning_tokens": 0, "content_tokens": 400_000}
    gateway_overrides = {"server": {"write_stall_timeout": 0.5}}

    @async_test
    async def test_a_client_that_stops_reading_loses_its_slot(self) -> None:
        response = raw_request(
            self.port, "POST", "/llm/v1/messages", chat(content="content-only", max_tokens=10**6)
        )
        await response.until(lambda: len(response.raw) > 0)
        response.transport.pauseProducing()
        await wait_for(lambda: self.log.events("cancelled"), 30.0, "the stalled stream to be cut")
        await self.settled()
        response.disconnect()


class Ready(LLMSurface):
    gateway_overrides = {"server": {"probe_interval": 0.5}}

    @async_test
    async def test_ready_only_while_every_upstream_answers(self) -> None:
        self.servers.gateway.start()
        self.addCleanup(self.servers.gateway.readiness.stop)
        await wait_for(
            lambda: self.servers.gateway.readiness.report()[0], what="a successful probe"
        )
        response = raw_request(self.port, "GET", "/readyz")
        await response.closed
        self.assertEqual(response.status, 200)
        self.servers.gateway.pools["vllm"].upstream.url = "http://127.0.0.1:1/v1"
        await wait_for(
            lambda: not self.servers.gateway.readiness.report()[0], what="a failed probe"
        )
        response = raw_request(self.port, "GET", "/readyz")
        await response.closed
        self.assertEqual(response.status, 503)
        self.assertIn(
            "connection refused", json.loads(response.body_text())["upstreams"]["vllm"]["detail"]
        )


class Drain(LLMSurface):
    stub_settings = {"hold": 0.3, "delay": 0.05, "reasoning_tokens": 2, "content_tokens": 6}
    gateway_overrides = {"slots": 1, "server": {"shutdown_grace": 5}}

    @async_test
    async def test_in_flight_finishes_queued_fails_new_refused(self) -> None:
        running = raw_request(self.port, "POST", "/llm/v1/messages", chat())
        await wait_for(lambda: self.slots.in_use == 1, what="the slot")
        queued = raw_request(self.port, "POST", "/llm/v1/messages", chat())
        queued_whole = raw_request(self.port, "POST", "/llm/v1/messages", chat(stream=False))
        await wait_for(lambda: len(self.slots.waiting) == 2, what="two to queue")
        drained = Deferred.fromCoroutine(self.servers.gateway.drain())
        late = await self.post(chat())
        await drained
        await running.closed
        await queued.closed
        await queued_whole.closed
        self.assertEqual(
            check_stream([d for _, d in running.frames()], allow_queue=False), "complete"
        )
        self.assertEqual([name for name, _ in queued.frames()], ["queue", "error"])
        self.assertEqual(queued_whole.status, 529)
        self.assertEqual(late.status, 503)
        self.assertEqual(self.stub.stats.requests, 1)
        await self.settled()

    @async_test
    async def test_past_the_grace_period_streams_end_with_an_error_and_upstreams_are_cancelled(
        self,
    ) -> None:
        self.servers.gateway.config = _with_grace(self.servers.gateway.config, 0.3)
        running = raw_request(
            self.port, "POST", "/llm/v1/messages", chat(content="long", max_tokens=2000)
        )
        await running.until_text("text_delta")
        await self.servers.gateway.drain()
        await running.closed
        frames = [d for _, d in running.frames()]
        self.assertEqual(check_stream(frames, allow_queue=False), "error")
        self.assertIn("shut down", frames[-1]["error"]["message"])
        self.assertTrue(running.raw.endswith(b"0\r\n\r\n"), "the response was not ended cleanly")
        await wait_for(lambda: self.log.events("cancelled"), what="the upstream to be cancelled")
        await self.settled()


def _with_grace(config: Any, grace: float) -> Any:
    return replace(config, server=replace(config.server, shutdown_grace=grace))
