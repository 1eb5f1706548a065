"""The fair line through the real gateway and stub: who waits, in which order, and who they are.

Clients are told apart by key names (or addresses behind trusted proxies); the stub's log shows
the order in which requests really reached the upstream.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from twisted.internet import reactor
from twisted.trial.unittest import TestCase
from twisted.web.server import Site

from homelab_gateway.config import parse_config
from homelab_gateway.dev.stub import StubLog, StubSettings, stub_site
from tests.surfaces.test_proxy import EchoHeaders, async_test
from testsupport.grammar import check_stream
from testsupport.helpers import Servers, chat, gateway_document, raw_request, wait_for

KEYS = {"FLOOD_KEY": "flood-key", "CHAT_KEY": "chat-key", "NIGHTLY_KEY": "nightly-key"}


class StartLog(StubLog):
    """The stub's `start` events in order, with the tag each request carried (metadata.user_id)
    and the `priority` field it sent."""

    def __init__(self) -> None:
        super().__init__(None)
        self.starts: list[tuple[str, Any]] = []

    def write(self, event: str, request_id: str, **fields: Any) -> None:
        if event == "start":
            self.starts.append((fields.get("user") or "", fields.get("priority")))


def tagged(tag: str, **kw: Any) -> dict[str, Any]:
    return chat(metadata={"user_id": tag}, **kw)


class FairLine(TestCase):
    stub_settings: dict[str, Any] = {
        "hold": 0.15,
        "delay": 0.005,
        "reasoning_tokens": 0,
        "content_tokens": 2,
    }
    slots = 2
    aging = 600.0
    upstream: dict[str, Any] = {}
    limits: dict[str, dict[str, Any]] = {}  # more settings of some clients

    def setUp(self) -> None:
        self.servers = Servers(self)
        self.log = self.make_log()
        site = stub_site(StubSettings(**self.stub_settings), reactor, self.log)
        self.stub_url = f"http://127.0.0.1:{self.servers.listen(site)}/v1"
        self.echo_port = self.servers.listen(Site(EchoHeaders()))
        document = gateway_document(
            self.stub_url,
            slots=self.slots,
            upstream={"queue_limit": 100, **self.upstream},
            routes=[{"prefix": "/echo/", "url": f"http://127.0.0.1:{self.echo_port}"}],
        )
        document["clients"] = {
            "flood": {"key_env": "FLOOD_KEY", "priority": "normal"},
            "frontend": {"key_env": "CHAT_KEY", "priority": "interactive"},
            "nightly": {
                "key_sha256": hashlib.sha256(b"nightly-key").hexdigest(),
                "priority": "batch",
                "max_waiting": 2,
            },
        }
        for name, settings in self.limits.items():
            document["clients"][name].update(settings)
        document["queue"] = {"aging": self.aging}
        self.document = document
        self.servers.start_gateway(document, environ=KEYS)
        self.port = self.servers.gateway_port

    def make_log(self) -> StartLog:
        return StartLog()

    @property
    def line(self) -> Any:
        return self.servers.gateway.pools["vllm"].line

    def send(self, key: str, body: Any, headers: dict[str, str] | None = None) -> Any:
        return raw_request(
            self.port,
            "POST",
            "/llm/v1/messages",
            body,
            headers={"x-api-key": key, **(headers or {})},
        )

    def started(self) -> list[str]:
        return [tag for tag, _ in self.log.starts]

    async def drain(self, responses: list[Any]) -> None:
        for response in responses:
            await response.closed
        await wait_for(
            lambda: self.line.in_use == 0 and not self.line.waiting, what="the line to empty"
        )

    async def status(self) -> dict[str, Any]:
        response = raw_request(self.port, "GET", "/llm/v1/status")
        await response.closed
        return dict(json.loads(response.body_text())["upstreams"]["vllm"])


class Ordering(FairLine):
    @async_test
    async def test_a_second_client_starts_within_two_releases_of_a_thirty_stream_flood(
        self,
    ) -> None:
        flood = [self.send("flood-key", tagged(f"flood-{i}")) for i in range(30)]
        await wait_for(lambda: len(self.line.waiting) == 28, what="the flood to queue")
        single = self.send("chat-key", tagged("single"), headers={"x-priority": "normal"})
        await wait_for(lambda: len(self.line.waiting) == 29, what="the single one to queue")
        await single.closed
        self.assertEqual(check_stream([d for _, d in single.frames()]), "complete")
        self.assertLessEqual(self.started().index("single"), 2 + 2, self.started())
        await self.drain(flood)

    @async_test
    async def test_x_priority_only_lowers_the_class(self) -> None:
        busy = [self.send("flood-key", tagged(f"busy-{i}")) for i in range(2)]
        await wait_for(lambda: self.line.in_use == 2, what="the slots to fill")
        lowered = self.send("chat-key", tagged("lowered"), headers={"x-priority": "batch"})
        raised = self.send("nightly-key", tagged("raised"), headers={"x-priority": "interactive"})
        await wait_for(lambda: len(self.line.waiting) == 2, what="both to queue")
        status = await self.status()
        self.assertEqual(status["waiting_by_class"], {"interactive": 0, "normal": 0, "batch": 2})
        self.assertEqual(status["waiting_by_client"], {"frontend": 1, "nightly": 1})
        self.assertNotIn("chat-key", json.dumps(status))
        await self.drain([*busy, lowered, raised])

    @async_test
    async def test_max_waiting_refuses_that_client_alone_with_529_and_retry_after(self) -> None:
        busy = [self.send("flood-key", tagged(f"busy-{i}")) for i in range(2)]
        await wait_for(lambda: self.line.in_use == 2, what="the slots to fill")
        nightly = [self.send("nightly-key", tagged(f"n-{i}")) for i in range(2)]
        await wait_for(lambda: len(self.line.waiting) == 2, what="two to queue")
        refused = self.send("nightly-key", tagged("n-3", stream=False))
        await refused.closed
        self.assertEqual(refused.status, 529)
        self.assertGreater(int(refused.header("retry-after")), 0)
        error = json.loads(refused.body_text())["error"]
        self.assertEqual(error["type"], "overloaded_error")
        self.assertIn("client nightly", error["message"])
        other = self.send("flood-key", tagged("other"))
        await wait_for(lambda: len(self.line.waiting) == 3, what="another client to queue")
        await self.drain([*busy, *nightly, other])
        self.assertNotIn("n-3", self.started())

    @async_test
    async def test_metrics_show_the_line_by_class_and_client_and_slot_time(self) -> None:
        await (self.send("chat-key", tagged("one"))).closed
        await wait_for(lambda: self.line.in_use == 0, what="the slot to be released")
        response = raw_request(self.port, "GET", "/metrics")
        await response.closed
        text = response.body_text()
        for line in (
            'homelab_gateway_queue_waiting_by_class{class="batch",upstream="vllm"} 0.0',
            'homelab_gateway_client_slot_seconds_total{client="frontend",upstream="vllm"}',
            'homelab_gateway_queue_wait_by_class_seconds_count{class="interactive",upstream="vllm"}',
        ):
            self.assertIn(line, text)


class Reload(FairLine):
    @async_test
    async def test_a_reload_changes_weights_and_caps_and_nobody_loses_a_place(self) -> None:
        busy = [self.send("flood-key", tagged(f"busy-{i}")) for i in range(2)]
        await wait_for(lambda: self.line.in_use == 2, what="the slots to fill")
        queued = [self.send("nightly-key", tagged(f"n-{i}")) for i in range(2)]
        await wait_for(lambda: len(self.line.waiting) == 2, what="two to queue")
        document = json.loads(json.dumps(self.document))
        document["clients"]["nightly"]["max_waiting"] = 0
        document["clients"]["flood"]["weight"] = 3
        document["queue"]["aging"] = 30
        changes = self.servers.gateway.reload(parse_config(document, environ=KEYS))
        self.assertIn("queue.aging: 600 -> 30", changes)
        self.assertEqual(len(self.line.waiting), 2, "a waiter lost its place")
        self.assertEqual(self.line.line.aging, 30.0)
        refused = self.send("nightly-key", tagged("n-late", stream=False))
        await refused.closed
        self.assertEqual(refused.status, 529)
        await self.drain([*busy, *queued])
        # Both get a slot in the same instant (the two busy ones end together), so the stub may
        # see them in either order; their places in line are what the reload had to keep.
        self.assertEqual(sorted(self.started()[2:]), ["n-0", "n-1"])
        places = [[d["position"] for n, d in r.frames() if n == "queue"] for r in queued]
        self.assertEqual([p[0] for p in places], [1, 2])
        self.assertEqual(sorted(places[1], reverse=True), places[1])


class Overtaking(FairLine):
    # Held long enough that the renumbering pass (1 s) runs before a slot frees.
    stub_settings = {**FairLine.stub_settings, "hold": 2.0}

    @async_test
    async def test_interactive_overtakes_waiting_normal_and_batch_whose_positions_go_up(
        self,
    ) -> None:
        busy = [self.send("flood-key", tagged(f"busy-{i}")) for i in range(2)]
        await wait_for(lambda: self.line.in_use == 2, what="the slots to fill")
        batch = self.send("nightly-key", tagged("batch"))
        normal = self.send("flood-key", tagged("normal"))
        await normal.until_text('"position":1')  # the fair share ranks it before batch
        await batch.until_text('"position":2')
        self.assertEqual(
            (await self.status())["waiting_by_class"], {"interactive": 0, "normal": 1, "batch": 1}
        )
        interactive = self.send("chat-key", tagged("interactive"))
        await interactive.until_text("event: queue")
        self.assertEqual(interactive.frames()[0][1]["position"], 1)
        await normal.until_text('"position":2')  # told within the staleness bound
        await self.drain([*busy, batch, normal, interactive])
        # The two busy requests end together, so interactive and normal get their slots in the
        # same instant and reach the stub in either order; batch waits for one of them to end.
        self.assertEqual(sorted(self.started()[2:4]), ["interactive", "normal"])
        self.assertEqual(self.started()[4:], ["batch"])
        positions = [d["position"] for n, d in normal.frames() if n == "queue"]
        self.assertEqual(positions[:2], [1, 2])
        self.assertEqual(check_stream([d for _, d in normal.frames()]), "complete")


class Aging(FairLine):
    aging = 1.0
    slots = 1

    @async_test
    async def test_batch_finishes_under_a_steady_stream_of_normal_requests(self) -> None:
        normals: list[Any] = []

        def keep_two_waiting() -> None:  # one normal request running, two more in line
            outstanding = sum(1 for r in normals if not r.closed.called)
            if outstanding < 3 and len(normals) < 200:
                normals.append(self.send("flood-key", tagged(f"normal-{len(normals)}")))

        normals.append(self.send("flood-key", tagged("normal-first")))
        await wait_for(lambda: self.line.in_use == 1, what="the slot to fill")
        batch = self.send("nightly-key", tagged("batch"))
        await batch.until_text("event: queue")

        def batch_started() -> bool:
            keep_two_waiting()
            return "batch" in self.started()

        await wait_for(batch_started, 30.0, "the batch request to start")
        self.assertGreaterEqual(self.line.line.waiting_for("flood"), 1, "the normal stream stopped")
        before = self.started()[: self.started().index("batch")]
        self.assertGreaterEqual(len(before), 3, "it overtook normal work before aging")
        await batch.closed
        self.assertEqual(check_stream([d for _, d in batch.frames()]), "complete")
        await self.drain(normals)


class ForwardPriority(FairLine):
    stub_settings = {**FairLine.stub_settings, "scheduling_policy": "priority"}
    upstream = {"forward_priority": True}

    @async_test
    async def test_the_class_goes_to_vllm_as_its_priority_field(self) -> None:
        for key, tag in (("chat-key", "i"), ("flood-key", "n"), ("nightly-key", "b")):
            response = self.send(key, tagged(tag, stream=tag != "n"))
            await response.closed
            self.assertEqual(response.status, 200, response.body_text())
        self.assertEqual(self.log.starts, [("i", -1), ("n", 0), ("b", 1)])


class NoForwardPriority(FairLine):
    @async_test
    async def test_without_the_option_no_priority_field_is_sent(self) -> None:
        response = self.send("chat-key", tagged("i"))
        await response.closed
        self.assertEqual(self.log.starts, [("i", None)])


class Identity(TestCase):
    """Who a client is without keys, and what a route's upstream may believe about it."""

    def start(self, server: dict[str, Any], auth: dict[str, Any] | None = None) -> None:
        self.servers = Servers(self)
        echo = self.servers.listen(Site(EchoHeaders()))
        stub_url, _, _ = self.servers.stub(hold=0.3, reasoning_tokens=0, content_tokens=1)
        document = gateway_document(
            stub_url,
            slots=1,
            server=server,
            routes=[{"prefix": "/echo/", "url": f"http://127.0.0.1:{echo}"}],
        )
        if auth is not None:
            document["auth"] = auth
        self.servers.start_gateway(document, environ={"GATEWAY_KEYS": "k1,k2"})
        self.port = self.servers.gateway_port

    async def echoed(self, headers: dict[str, str]) -> dict[str, list[str]]:
        response = raw_request(self.port, "GET", "/echo/x", headers=headers)
        await response.closed
        return dict(json.loads(response.body_text())["headers"])

    async def waiting_clients(self, headers: dict[str, str]) -> dict[str, int]:
        slots = self.servers.gateway.pools["vllm"].line
        busy = raw_request(self.port, "POST", "/llm/v1/messages", chat(), headers=headers)
        await wait_for(lambda: slots.in_use == 1, what="the slot to fill")
        queued = raw_request(self.port, "POST", "/llm/v1/messages", chat(), headers=headers)
        await wait_for(lambda: len(slots.waiting) == 1, what="one to queue")
        status = raw_request(self.port, "GET", "/llm/v1/status")
        await status.closed
        await busy.closed
        await queued.closed
        return dict(json.loads(status.body_text())["upstreams"]["vllm"]["waiting_by_client"])

    @async_test
    async def test_an_untrusted_peer_is_its_own_address_whatever_it_claims(self) -> None:
        self.start({})
        claims = {"X-Forwarded-For": "203.0.113.7", "X-Real-IP": "203.0.113.7"}
        self.assertEqual(await self.waiting_clients(claims), {"127.0.0.1": 1})

    @async_test
    async def test_behind_a_trusted_proxy_the_client_is_the_first_untrusted_hop(self) -> None:
        self.start({"trusted_proxies": ["127.0.0.1/32", "10.0.0.0/8"]})
        chain = {"X-Forwarded-For": "198.51.100.1, 203.0.113.7, 10.1.2.3"}
        self.assertEqual(await self.waiting_clients(chain), {"203.0.113.7": 1})

    @async_test
    async def test_a_trusted_proxy_keeps_its_forwarding_headers(self) -> None:
        self.start({"trusted_proxies": ["127.0.0.1/32"]})
        headers = await self.echoed(
            {
                "X-Forwarded-For": "203.0.113.7",
                "X-Forwarded-Proto": "https",
                "X-Real-IP": "203.0.113.7",
                "X-Forwarded-Prefix": "/gw",
                "Forwarded": "for=203.0.113.7;proto=https",
            }
        )
        self.assertEqual(headers["x-forwarded-for"], ["203.0.113.7, 127.0.0.1"])
        self.assertEqual(headers["x-forwarded-proto"], ["https"])
        self.assertEqual(headers["x-real-ip"], ["203.0.113.7"])
        self.assertEqual(headers["x-forwarded-prefix"], ["/gw"])
        self.assertEqual(headers["forwarded"], ["for=203.0.113.7;proto=https"])

    @async_test
    async def test_every_gateway_credential_header_is_removed(self) -> None:
        self.start({}, auth={"api_keys_env": "GATEWAY_KEYS"})
        headers = await self.echoed({"x-api-key": "k1", "Authorization": "Bearer k2"})
        self.assertNotIn("x-api-key", headers)
        self.assertNotIn("authorization", headers)
        # A Basic credential for the service behind the route is the client's own: it passes.
        headers = await self.echoed({"x-api-key": "k1", "Authorization": "Basic dTpw"})
        self.assertEqual(headers["authorization"], ["Basic dTpw"])

    @async_test
    async def test_auth_keys_are_named_by_their_digest_never_shown(self) -> None:
        self.start({}, auth={"api_keys_env": "GATEWAY_KEYS"})
        name = "key-" + hashlib.sha256(b"k1").hexdigest()[:8]
        self.assertEqual(await self.waiting_clients({"x-api-key": "k1"}), {name: 1})
