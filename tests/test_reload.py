"""Config reload: what changed, in words (sans-IO), and a Gateway applying it under load."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

from twisted.internet import reactor
from twisted.internet.defer import ensureDeferred
from twisted.logger import formatEvent
from twisted.trial.unittest import SynchronousTestCase, TestCase

from homelab_gateway.config import Config, load_config, parse_config
from homelab_gateway.core.reload import config_changes
from homelab_gateway.service import Gateway, GatewayService
from tests.surfaces.test_llm import LLMSurface
from tests.surfaces.test_proxy import async_test
from testsupport.helpers import capture_log, chat, gateway_document, raw_request, wait_for


def config(document: dict[str, Any], **environ: str) -> Config:
    return parse_config(document, source="<test>", environ=environ)


BASE: dict[str, Any] = {
    "upstreams": {"vllm": {"url": "http://a/v1", "slots": 2, "api_key_env": "K"}},
    "models": {"m": {"upstream": "vllm"}},
    "routes": [{"prefix": "/r/", "upstream": "vllm"}],
}


class Changes(SynchronousTestCase):
    def changes(self, new: dict[str, Any], **environ: str) -> list[str]:
        return config_changes(config(BASE, K="s1"), config(new, **{"K": "s1", **environ}))

    def test_nothing_changed(self) -> None:
        self.assertEqual(self.changes(BASE), [])

    def test_a_box_added_changed_or_removed_is_one_line(self) -> None:
        one = {**BASE, "boxes": {"gpu0": {"memory": 24}}}
        two = {**BASE, "boxes": {"gpu0": {"memory": 24, "min_resident": 5}, "gpu1": {"memory": 8}}}
        self.assertEqual(self.changes(one), ["box 'gpu0' added (memory 24)"])
        self.assertEqual(
            config_changes(config(one, K="s1"), config(two, K="s1")),
            ["box 'gpu1' added (memory 8)", "box 'gpu0': min_resident 30 -> 5"],
        )
        self.assertEqual(
            config_changes(config(one, K="s1"), config(BASE, K="s1")),
            ["box 'gpu0' removed: its upstreams are gone with it"],
        )

    def test_each_kind_of_change_is_one_line(self) -> None:
        new = json.loads(json.dumps(BASE))
        new["server"] = {"ping_interval": 5, "listen": "tcp:9000"}
        new["upstreams"]["vllm"]["slots"] = 4
        new["upstreams"]["ollama"] = {"url": "http://o/v1", "slots": 1}
        new["models"] = {"q": {"upstream": "ollama"}}
        new["routes"] = []
        self.assertEqual(
            self.changes(new),
            [
                "server.listen: 'tcp:8080:interface=127.0.0.1' -> 'tcp:9000' "
                "(applies at the next restart)",
                "server.ping_interval: 10 -> 5",
                "upstream 'ollama' added (slots 1, http://o/v1)",
                "upstream 'vllm': slots 2 -> 4",
                "model 'q' added (upstream ollama)",
                "model 'm' removed",
                "route '/r/' removed",
            ],
        )

    def test_joining_a_cluster_applies_at_the_next_restart(self) -> None:
        new = json.loads(json.dumps(BASE))
        new["cluster"] = {"redis_url": "redis://:secret@redis/0"}
        self.assertEqual(self.changes(new), ["cluster: changed (applies at the next restart)"])

    def test_clients_and_queue_changes_name_the_client_never_its_key(self) -> None:
        new = json.loads(json.dumps(BASE))
        new["clients"] = {"chat": {"key_env": "CHAT", "priority": "interactive"}}
        new["queue"] = {"aging": 60}
        self.assertEqual(
            self.changes(new, CHAT="chat-secret"),
            ["client 'chat' added (interactive, weight 1)", "queue.aging: 120 -> 60"],
        )
        old = config(new, K="s1", CHAT="chat-secret")
        newer = json.loads(json.dumps(new))
        newer["clients"]["chat"]["weight"] = 2
        changed = config_changes(old, config(newer, K="s1", CHAT="other-secret"))
        self.assertEqual(changed, ["client 'chat': key_sha256 changed, weight 1 -> 2"])

    def test_a_new_status_subscriber_cap_applies_at_once(self) -> None:
        new = {**BASE, "server": {"max_status_subscribers": 8}}
        self.assertEqual(self.changes(new), ["server.max_status_subscribers: 64 -> 8"])

    def test_removed_upstream_says_it_finishes_what_it_holds(self) -> None:
        new = {"upstreams": {"o": {"url": "http://o/v1", "slots": 1}}}
        self.assertIn(
            "upstream 'vllm' removed: takes no new requests, finishes what it holds",
            self.changes(new),
        )

    def test_secrets_never_appear(self) -> None:
        lines = self.changes(BASE, K="s2-secret")
        self.assertEqual(lines, ["upstream 'vllm': api_key changed"])
        keyed = {**BASE, "auth": {"api_keys_env": "G"}}
        lines = config_changes(config(BASE, K="s1"), config(keyed, K="s1", G="gw-secret,x"))
        self.assertEqual(lines, ["auth: API keys none (open) -> 2 configured"])
        self.assertNotIn("secret", " ".join(lines))


class FailedReload(TestCase):
    def test_the_logged_line_never_shows_a_url_password(self) -> None:
        folder = Path(tempfile.mkdtemp(prefix="hg-reload-"))
        self.addCleanup(shutil.rmtree, folder)
        path = folder / "gw.toml"
        path.write_text("[usage]\ndatabase = ':memory:'\n")
        running = load_config(path)
        service = GatewayService(running, reactor, config_path=str(path))
        service.gateway = gateway = Gateway(running, reactor)
        self.addCleanup(lambda: ensureDeferred(gateway.close()))
        path.write_text("[cluster]\nredis_url = 'redis://gw:hunter2@redis:99999/0'\n")
        logged = capture_log(self)
        service.reload("SIGHUP")
        lines = [formatEvent(event) for event in logged]
        self.assertIn(
            "homelab-gateway: reload failed, still running the previous config: "
            f"{path}: cluster.redis_url: has a bad port: 'redis://gw:***@redis:99999/0'",
            lines,
        )
        self.assertNotIn("hunter2", "\n".join(lines))
        self.assertIs(service.config, running)


class ReloadUnderLoad(LLMSurface):
    """A Gateway applies a new config while requests hold slots and wait in line."""

    stub_settings = {"hold": 0.3, "delay": 0.02}
    gateway_overrides = {"slots": 1}

    def reload(self, **changes: Any) -> list[str]:
        document = gateway_document(self.stub_url, **{"slots": 1, **changes})
        assert self.servers.gateway is not None
        return self.servers.gateway.reload(parse_config(document, environ={}))

    @async_test
    async def test_more_slots_go_to_the_waiters_in_their_order(self) -> None:
        running = raw_request(self.port, "POST", "/llm/v1/messages", chat())
        await wait_for(lambda: self.slots.in_use == 1, what="the slot")
        waiters = [raw_request(self.port, "POST", "/llm/v1/messages", chat()) for _ in range(3)]
        await wait_for(lambda: len(self.slots.waiting) == 3, what="three to queue")
        pool = self.servers.gateway.pools["vllm"]
        self.assertEqual(self.reload(slots=3), ["upstream 'vllm': slots 1 -> 3"])
        self.assertIs(self.servers.gateway.pools["vllm"], pool, "the pool carried over")
        self.assertEqual((self.slots.in_use, len(self.slots.waiting)), (3, 1))
        for response in [running, *waiters]:
            await response.closed
            self.assertEqual(response.events()[-1], "message_stop")
        await self.settled()

    @async_test
    async def test_fewer_slots_revoke_nothing(self) -> None:
        self.reload(slots=2)
        held = [raw_request(self.port, "POST", "/llm/v1/messages", chat()) for _ in range(2)]
        await wait_for(lambda: self.slots.in_use == 2, what="two slots")
        self.reload(slots=1)
        queued = raw_request(self.port, "POST", "/llm/v1/messages", chat())
        await wait_for(lambda: len(self.slots.waiting) == 1, what="one to queue")
        for response in [*held, queued]:
            await response.closed
            self.assertEqual(response.events()[-1], "message_stop")
        self.assertEqual(self.stub.stats.max_in_flight, 2)
        await self.settled()

    @async_test
    async def test_a_removed_model_answers_404_while_its_running_request_finishes(self) -> None:
        running = raw_request(self.port, "POST", "/llm/v1/messages", chat())
        await wait_for(lambda: self.slots.in_use == 1, what="the slot")
        document = gateway_document(self.stub_url, slots=1)
        document["models"] = {"renamed": {"upstream": "vllm", "upstream_model": "reasoning"}}
        document["routes"] = []
        lines = self.servers.gateway.reload(parse_config(document, environ={}))
        self.assertEqual(
            lines,
            [
                "model 'renamed' added (upstream vllm)",
                "model 'reasoning' removed",
                "route '/openai/' removed",
            ],
        )
        gone = await self.post(chat())
        self.assertEqual(gone.status, 404)
        renamed = await self.post(chat(model="renamed", stream=False))
        self.assertEqual(renamed.status, 200)
        no_route = await self.post({"model": "x"}, path="/openai/chat/completions")
        self.assertEqual(no_route.status, 404)
        await running.closed
        self.assertEqual(running.events()[-1], "message_stop")
        await self.settled()

    @async_test
    async def test_a_removed_upstream_finishes_what_it_holds_and_its_queue(self) -> None:
        running = raw_request(self.port, "POST", "/llm/v1/messages", chat())
        await wait_for(lambda: self.slots.in_use == 1, what="the slot")
        queued = raw_request(self.port, "POST", "/llm/v1/messages", chat())
        await wait_for(lambda: len(self.slots.waiting) == 1, what="one to queue")
        old = self.slots
        other_url, _, _ = self.servers.stub()
        document = {
            "upstreams": {"other": {"url": other_url, "slots": 1}},
            "models": {"reasoning": {"upstream": "other"}},
        }
        lines = self.servers.gateway.reload(parse_config(document, environ={}))
        self.assertIn("upstream 'other' added (slots 1, " + other_url + ")", lines)
        self.assertNotIn("vllm", self.servers.gateway.pools)
        for response in (running, queued):
            await response.closed
            self.assertEqual(response.events()[-1], "message_stop")
        self.assertEqual(self.stub.stats.requests, 2, "both ran on the removed upstream")
        await wait_for(lambda: old.in_use == 0, what="the old slots to be free")

    def test_the_status_streams_cap_and_stall_timeout_apply_to_the_next_subscriber(
        self,
    ) -> None:
        page = self.servers.gateway.app.status_page
        self.assertEqual((page.max_subscribers, page.stall_timeout), (64, 120.0))
        server = {"ping_interval": 10, "max_status_subscribers": 1, "write_stall_timeout": 5}
        self.assertEqual(
            self.reload(server=server),
            ["server.write_stall_timeout: 120 -> 5", "server.max_status_subscribers: 64 -> 1"],
        )
        self.assertEqual((page.max_subscribers, page.stall_timeout), (1, 5.0))

    @async_test
    async def test_new_api_keys_apply_to_the_next_request(self) -> None:
        document = gateway_document(self.stub_url, slots=1)
        document["auth"] = {"api_keys_env": "KEYS"}
        lines = self.servers.gateway.reload(parse_config(document, environ={"KEYS": "k1"}))
        self.assertEqual(lines, ["auth: API keys none (open) -> 1 configured"])
        refused = await self.post(chat(stream=False))
        self.assertEqual(refused.status, 401)
        allowed = await self.post(chat(stream=False), headers={"x-api-key": "k1"})
        self.assertEqual(allowed.status, 200)

    @async_test
    async def test_an_added_upstream_is_probed_for_readiness_at_once(self) -> None:
        gateway = self.servers.gateway
        gateway.readiness.interval = 60  # no second round on its own within the test
        gateway.start()
        self.addCleanup(gateway.readiness.stop)
        await wait_for(lambda: gateway.readiness.report()[0], what="the first probe")
        other_url, _, _ = self.servers.stub()
        document = gateway_document(self.stub_url, slots=1, server={"probe_interval": 60})
        document["upstreams"]["other"] = {"url": other_url, "slots": 1}
        gateway.reload(parse_config(document, environ={}))
        self.assertEqual(
            gateway.readiness.report()[1]["other"], {"ready": False, "detail": "not probed yet"}
        )
        await wait_for(lambda: gateway.readiness.report()[0], what="the new upstream's probe")
