"""One model on several upstreams, over real sockets: spread, failover, retries, affinity."""

from __future__ import annotations

import json
from typing import Any

from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.logger import formatEvent, globalLogPublisher
from twisted.protocols.policies import WrappingFactory
from twisted.trial.unittest import TestCase
from twisted.web.resource import Resource
from twisted.web.server import Site

from homelab_gateway.config import parse_config
from homelab_gateway.core.errors import GatewayError
from homelab_gateway.dev.stub import StubResource
from tests.surfaces.test_proxy import async_test
from testsupport.grammar import check_stream
from testsupport.helpers import Servers, chat, raw_request, wait_for


class Refusing(Resource):
    """An upstream that answers every request with `status` and counts them."""

    isLeaf = True

    def __init__(self, status: int) -> None:
        super().__init__()
        self.status = status
        self.requests = 0

    def render_POST(self, request: Any) -> bytes:
        self.requests += 1
        request.setResponseCode(self.status)
        request.setHeader(b"content-type", b"application/json")
        return json.dumps({"error": {"message": f"refusing with {self.status}"}}).encode()

    def render_GET(self, request: Any) -> bytes:
        return b'{"data": []}'


class Stub:
    """A stub upstream that can be killed and brought back on its port."""

    def __init__(self, servers: Servers, **settings: Any) -> None:
        self.servers = servers
        self.url, self.resource, self.log = servers.stub(**settings)
        self.port, self.factory = servers.ports[-1], servers.factories[-1]
        self.number = self.port.getHost().port

    @property
    def stats(self) -> Any:
        assert isinstance(self.resource, StubResource)
        return self.resource.stats

    async def kill(self) -> None:
        self.servers.ports.remove(self.port)
        await self.port.stopListening()
        for protocol in list(self.factory.protocols):
            protocol.transport.abortConnection()

    def revive(self) -> None:
        factory = WrappingFactory(self.factory.wrappedFactory)
        self.port = reactor.listenTCP(self.number, factory, interface="127.0.0.1")
        self.factory = factory
        self.servers.ports.append(self.port)
        self.servers.factories.append(factory)


def document(urls: dict[str, str], **extra: Any) -> dict[str, Any]:
    upstreams = {
        name: {"url": url, "slots": 2, "failures_to_open": 2, "cooldown": 0.5}
        for name, url in urls.items()
    }
    for name, settings in extra.pop("upstream_settings", {}).items():
        upstreams[name].update(settings)
    return {
        "server": {"ping_interval": 10, **extra.pop("server", {})},
        "upstreams": upstreams,
        "models": {"reasoning": {"upstreams": list(urls), **extra.pop("model", {})}},
    }


class Replicas(TestCase):
    def setUp(self) -> None:
        self.servers = Servers(self)

    def start(self, doc: dict[str, Any]) -> None:
        self.servers.start_gateway(doc)
        self.port = self.servers.gateway_port
        self.gateway = self.servers.gateway

    def replica(self, name: str) -> Any:
        return self.gateway.pools[name].replica

    @property
    def line(self) -> Any:
        return self.gateway.pools["a"].line

    async def settled(self) -> None:
        await wait_for(
            lambda: self.line.in_use == 0 and not self.line.waiting, what="the line to empty"
        )

    async def finish(self, responses: list[Any]) -> None:
        for response in responses:
            await response.closed

    @async_test
    async def test_eight_streams_put_two_on_each_replica_and_wait_in_one_line(self) -> None:
        a = Stub(self.servers, hold=0.3, delay=0.01)
        b = Stub(self.servers, hold=0.3, delay=0.01)
        self.start(document({"a": a.url, "b": b.url}))
        responses = [raw_request(self.port, "POST", "/llm/v1/messages", chat()) for _ in range(8)]
        await wait_for(lambda: len(self.line.waiting) == 4, what="four to wait")
        self.assertEqual((self.replica("a").held, self.replica("b").held), (2, 2))
        await self.finish(responses)
        for response in responses:
            self.assertEqual(check_stream([d for _, d in response.frames()]), "complete")
        self.assertEqual((a.stats.max_in_flight, b.stats.max_in_flight), (2, 2))
        self.assertEqual(a.stats.requests + b.stats.requests, 8)
        await self.settled()

    @async_test
    async def test_a_replica_dies_waiters_move_to_the_survivor_and_it_comes_back(self) -> None:
        a = Stub(self.servers, delay=0.02, content_tokens=40)
        b = Stub(self.servers, delay=0.02, content_tokens=40)
        self.start(document({"a": a.url, "b": b.url}))
        logged: list[str] = []

        def observe(event: dict[str, Any]) -> None:
            if event.get("log_namespace") == "homelab_gateway.service":
                logged.append(formatEvent(event))

        globalLogPublisher.addObserver(observe)
        self.addCleanup(globalLogPublisher.removeObserver, observe)
        running = [raw_request(self.port, "POST", "/llm/v1/messages", chat()) for _ in range(4)]
        for response in running:
            await response.until_text("content_block_delta")
        waiting = [raw_request(self.port, "POST", "/llm/v1/messages", chat()) for _ in range(4)]
        await wait_for(lambda: len(self.line.waiting) == 4, what="four to wait")
        await a.kill()
        await self.finish([*running, *waiting])
        outcomes = [check_stream([d for _, d in r.frames()]) for r in running]
        self.assertEqual(sorted(outcomes), ["complete", "complete", "error", "error"])
        for response in waiting:
            self.assertEqual(check_stream([d for _, d in response.frames()]), "complete")
        self.assertEqual(a.stats.requests + b.stats.requests, 8, "no request ran twice")
        self.assertEqual(b.stats.requests, 6)
        self.assertEqual(self.replica("a").circuit.state, "down")
        status = raw_request(self.port, "GET", "/llm/v1/status")
        await status.closed
        shown = json.loads(status.body_text())["upstreams"]["a"]
        self.assertEqual(shown["health"], "down")
        self.assertIn("connection refused", shown["last_error"])

        a.revive()
        for _ in range(20):
            response = raw_request(self.port, "POST", "/llm/v1/messages", chat(stream=False))
            await response.closed
            self.assertEqual(response.status, 200, response.body_text())
            if self.replica("a").circuit.state == "up":
                break
            await wait_for(
                lambda: self.replica("a").circuit.admits(reactor.seconds()),
                what="the cool-down to end",
            )
        self.assertEqual(self.replica("a").circuit.state, "up")
        self.assertEqual(a.stats.requests, 3, "the trial request ran on the revived replica")
        self.assertIn(
            "upstream a is out of rotation for 0.5s: upstream a unreachable: connection refused",
            logged,
        )
        self.assertIn("upstream a is back in rotation: it answered", logged)
        await self.settled()

    @async_test
    async def test_one_session_stays_on_one_replica(self) -> None:
        a = Stub(self.servers)
        b = Stub(self.servers)
        self.start(document({"a": a.url, "b": b.url}))
        for _ in range(10):
            response = raw_request(
                self.port,
                "POST",
                "/llm/v1/messages",
                chat(stream=False),
                headers={"X-Claude-Code-Session-Id": "3f2a-session"},
            )
            await response.closed
            self.assertEqual(response.status, 200)
        self.assertEqual(sorted([a.stats.requests, b.stats.requests]), [0, 10])
        for _ in range(4):  # no session: most free slots, ties in turn
            response = raw_request(self.port, "POST", "/llm/v1/messages", chat(stream=False))
            await response.closed
        self.assertEqual(sorted([a.stats.requests, b.stats.requests]), [2, 12])

    @async_test
    async def test_metadata_user_id_is_the_session_without_the_header(self) -> None:
        a = Stub(self.servers)
        b = Stub(self.servers)
        self.start(document({"a": a.url, "b": b.url}))
        for _ in range(6):
            body = chat(stream=False, metadata={"user_id": "user-7"})
            response = raw_request(self.port, "POST", "/llm/v1/messages", body)
            await response.closed
        self.assertEqual(sorted([a.stats.requests, b.stats.requests]), [0, 6])

    @async_test
    async def test_a_fallback_takes_requests_only_when_the_others_are_full(self) -> None:
        vllm = Stub(self.servers, hold=0.5, models=("Qwen/QwQ-32B",))
        ollama = Stub(self.servers, hold=0.5, models=("qwq:32b",))
        doc = document(
            {"a": vllm.url, "ollama": ollama.url},
            upstream_settings={"a": {"slots": 1}, "ollama": {"slots": 1, "fallback": True}},
            model={"upstream_model": "Qwen/QwQ-32B", "upstream_models": {"ollama": "qwq:32b"}},
        )
        self.start(doc)
        for _ in range(3):
            response = raw_request(self.port, "POST", "/llm/v1/messages", chat(stream=False))
            await response.closed
            self.assertEqual(response.status, 200, response.body_text())
        self.assertEqual((vllm.stats.requests, ollama.stats.requests), (3, 0))
        both = [
            raw_request(self.port, "POST", "/llm/v1/messages", chat(stream=False)) for _ in range(2)
        ]
        await self.finish(both)
        self.assertEqual([r.status for r in both], [200, 200])
        self.assertEqual(vllm.stats.models, {"Qwen/QwQ-32B": 4})
        self.assertEqual(ollama.stats.models, {"qwq:32b": 1}, "each replica's own model name")
        await self.settled()

    def refusing(self, status: int) -> tuple[str, Refusing]:
        resource = Refusing(status)
        port = self.servers.listen(Site(resource))
        return f"http://127.0.0.1:{port}/v1", resource

    @async_test
    async def test_a_503_is_retried_on_another_replica_unseen_by_the_client(self) -> None:
        url, refusing = self.refusing(503)
        good = Stub(self.servers)
        self.start(document({"a": url, "b": good.url}))
        for stream in (True, False):
            response = raw_request(self.port, "POST", "/llm/v1/messages", chat(stream=stream))
            await response.closed
            self.assertEqual(response.status, 200, response.body_text())
            if stream:
                self.assertEqual(check_stream([d for _, d in response.frames()]), "complete")
                self.assertNotIn(b"event: queue", response.body_bytes())
        self.assertEqual(good.stats.requests, 2)
        self.assertEqual(refusing.requests, 2, "the first of each went to a (turn)")
        self.assertEqual(self.replica("a").circuit.state, "down")
        metrics = raw_request(self.port, "GET", "/metrics")
        await metrics.closed
        text = metrics.body_text()
        self.assertIn('homelab_gateway_retries_total{reason="status",upstream="a"} 2.0', text)
        self.assertIn('homelab_gateway_failovers_total{reason="status",upstream="a"} 2.0', text)
        self.assertIn('homelab_gateway_upstream_up{upstream="a"} 0.0', text)
        self.assertIn('homelab_gateway_upstream_up{upstream="b"} 1.0', text)
        await self.settled()

    @async_test
    async def test_a_refused_request_never_goes_back_to_the_replica_that_refused_it(
        self,
    ) -> None:
        """A 503 from a, then b refuses connections: the retries never take a again, which
        would refuse the same request twice; once b is out of rotation, a's refusal is the
        answer, at once."""
        url, refusing = self.refusing(503)
        dead = Stub(self.servers)
        await dead.kill()
        self.start(document({"a": url, "b": dead.url}))
        response = raw_request(self.port, "POST", "/llm/v1/messages", chat(stream=False))
        await response.closed
        self.assertEqual(response.status, 529, response.body_text())
        self.assertIn("refusing with 503", response.body_text())
        self.assertEqual(refusing.requests, 1, "the refused request went back to a")
        self.assertEqual(self.replica("b").circuit.state, "down")
        await self.settled()

    @async_test
    async def test_a_500_and_a_4xx_are_never_retried(self) -> None:
        for status, expected in ((500, 502), (400, 400)):
            url, refusing = self.refusing(status)
            good = Stub(self.servers)
            doc = document({"a": url, "b": good.url})
            doc["upstreams"]["b"]["fallback"] = True  # so the first attempt goes to a
            if self.servers.gateway is None:
                self.start(doc)
            else:
                self.gateway.reload(parse_config(doc, environ={}))
            response = raw_request(self.port, "POST", "/llm/v1/messages", chat(stream=False))
            await response.closed
            self.assertEqual(response.status, expected, response.body_text())
            self.assertEqual((refusing.requests, good.stats.requests), (1, 0))
            circuit = self.replica("a").circuit
            self.assertEqual((circuit.failures, circuit.state), (0, "up"), "it answered")
        await self.settled()

    @async_test
    async def test_a_reload_that_adds_a_replica_starts_the_waiters_on_it(self) -> None:
        a = Stub(self.servers, hold=30)
        b = Stub(self.servers)
        doc = document({"a": a.url}, upstream_settings={"a": {"slots": 1}})
        self.start(doc)
        held = raw_request(self.port, "POST", "/llm/v1/messages", chat())
        await wait_for(lambda: self.replica("a").held == 1, what="a's slot")
        waiting = [raw_request(self.port, "POST", "/llm/v1/messages", chat()) for _ in range(2)]
        await waiting[1].until_text('"position":2')
        grown = document({"a": a.url, "b": b.url}, upstream_settings={"a": {"slots": 1}})
        self.gateway.reload(parse_config(grown, environ={}))
        await self.finish(waiting)
        for response in waiting:
            self.assertEqual(check_stream([d for _, d in response.frames()]), "complete")
        self.assertEqual(b.stats.requests, 2)
        held.disconnect()
        await self.settled()

    @async_test
    async def test_ready_while_a_replica_serves_and_a_probe_brings_one_back(self) -> None:
        a = Stub(self.servers)
        b = Stub(self.servers)
        doc = document({"a": a.url, "b": b.url}, server={"probe_interval": 0.3})
        doc["upstreams"]["a"]["cooldown"] = 3600  # only a probe can bring it back in time
        self.start(doc)
        self.gateway.start()
        self.addCleanup(self.gateway.readiness.stop)
        readiness = self.gateway.readiness
        await wait_for(lambda: readiness.report()[0], what="a successful probe")
        await a.kill()
        await wait_for(lambda: not readiness.report()[1]["a"]["ready"], what="a's probe to fail")
        self.assertTrue(readiness.report()[0], "b still serves the model")
        for _ in range(2):  # failures_to_open: take a out of rotation
            self.replica("a").circuit.failed(reactor.seconds(), "killed")
        self.assertEqual(self.replica("a").circuit.state, "down")
        await b.kill()
        await wait_for(lambda: not readiness.report()[0], what="no replica left")
        response = raw_request(self.port, "GET", "/readyz")
        await response.closed
        self.assertEqual(response.status, 503)
        a.revive()
        await wait_for(lambda: self.replica("a").circuit.state == "up", what="a probe to revive a")
        await wait_for(lambda: readiness.report()[0], what="ready again")

    @async_test
    async def test_a_client_that_leaves_while_connecting_is_not_retried(self) -> None:
        """Twisted can report a cancelled connection attempt as the failure it caused (a DNS
        lookup that failed): that must not look like a refusal worth another attempt."""
        a = Stub(self.servers)
        b = Stub(self.servers)
        self.start(document({"a": a.url, "b": b.url}))
        attempts: list[str] = []

        def connecting(*args: Any, **kwargs: Any) -> Deferred[Any]:
            attempts.append(args[1])

            def cancelled(d: Deferred[Any]) -> None:
                d.errback(GatewayError(502, "DNS lookup failed", fault="connect", retry=True))

            return Deferred(cancelled)

        for name in ("a", "b"):
            self.gateway.pools[name].upstream.open = connecting  # type: ignore[method-assign]
        response = raw_request(self.port, "POST", "/llm/v1/messages", chat())
        await wait_for(lambda: attempts, what="the first attempt")
        response.disconnect()
        await self.settled()
        self.assertEqual(len(attempts), 1)
        self.assertEqual([self.replica(n).circuit.failures for n in "ab"], [0, 0], "no fault")

    @async_test
    async def test_a_reload_that_removes_a_replica_keeps_the_waiters_and_its_running_streams(
        self,
    ) -> None:
        a = Stub(self.servers, hold=0.5)
        b = Stub(self.servers, hold=0.5)
        settings = {"a": {"slots": 1}, "b": {"slots": 1}}
        self.start(document({"a": a.url, "b": b.url}, upstream_settings=settings))
        running = [raw_request(self.port, "POST", "/llm/v1/messages", chat()) for _ in range(2)]
        await wait_for(
            lambda: self.replica("a").held == 1 and self.replica("b").held == 1,
            what="a slot on each",
        )
        waiting = [raw_request(self.port, "POST", "/llm/v1/messages", chat()) for _ in range(3)]
        await wait_for(lambda: len(self.line.waiting) == 3, what="three to wait")
        old_b = self.replica("b")
        self.gateway.reload(
            parse_config(document({"a": a.url}, upstream_settings={"a": {"slots": 1}}), environ={})
        )
        self.assertEqual(len(self.line.waiting), 3, "the waiters moved to a's new line")
        await self.finish([*running, *waiting])
        for response in [*running, *waiting]:
            self.assertEqual(check_stream([d for _, d in response.frames()]), "complete")
        self.assertEqual((a.stats.requests, b.stats.requests), (4, 1))
        self.assertEqual(old_b.held, 0)
        await self.settled()
