"""A client's own limits through the real gateway and stub: `max_in_flight` (slots held at once)
and `tokens_per_day` (tokens in a rolling day), on every surface."""

from __future__ import annotations

import copy
import json
import time
from typing import Any

from homelab_gateway.config import parse_config
from tests.surfaces.test_proxy import async_test
from tests.test_fairness import KEYS, FairLine, StartLog, tagged
from testsupport.helpers import raw_request, wait_for


class Concurrency(StartLog):
    """The most requests of each tag prefix the stub ran at once, from its own log."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: dict[str, str] = {}
        self.running: dict[str, int] = {}
        self.most: dict[str, int] = {}

    def write(self, event: str, request_id: str, **fields: Any) -> None:
        super().write(event, request_id, **fields)
        if event == "start":
            tag = (fields.get("user") or "").split("-")[0]
            self.tags[request_id] = tag
            self.running[tag] = self.running.get(tag, 0) + 1
            self.most[tag] = max(self.most.get(tag, 0), self.running[tag])
        elif request_id in self.tags and event in ("complete", "cancelled", "failed"):
            self.running[self.tags.pop(request_id)] -= 1


class MaxInFlight(FairLine):
    slots = 3
    limits = {"flood": {"max_in_flight": 1}}
    stub_settings = {**FairLine.stub_settings, "hold": 0.2}

    def make_log(self) -> StartLog:
        return Concurrency()

    @async_test
    async def test_a_capped_client_holds_one_slot_while_others_pass_and_runs_alone(
        self,
    ) -> None:
        flood = [self.send("flood-key", tagged(f"flood-{i}")) for i in range(4)]
        await wait_for(
            lambda: self.line.in_use == 1 and len(self.line.waiting) == 3,
            what="one flood request to run and three to wait, though two slots are free",
        )
        status = await raw_status(self.port)
        self.assertEqual(status["clients"]["flood"], {"max_in_flight": 1, "in_flight": {"vllm": 1}})
        chat = [self.send("chat-key", tagged(f"chat-{i}")) for i in range(2)]
        for response in chat:
            await response.closed
        positions = [data["position"] for event, data in flood[-1].frames() if event == "queue"]
        self.assertEqual(positions[0], 3, "behind its own two")
        await self.drain(flood)
        assert isinstance(self.log, Concurrency)
        self.assertEqual(self.log.most, {"flood": 1, "chat": 2})
        self.assertEqual(self.started()[-1].split("-")[0], "flood", "it ran alone at the end")


class TokensPerDay(FairLine):
    slots = 2
    limits = {"frontend": {"tokens_per_day": 30}}

    def ask(self, path: str, body: dict[str, Any]) -> Any:
        return raw_request(
            self.port, "POST", path, body, headers={"authorization": "Bearer chat-key"}
        )

    @async_test
    async def test_a_client_over_its_quota_gets_429_with_the_seconds_left_on_every_surface(
        self,
    ) -> None:
        first = self.ask("/llm/v1/messages", tagged("first", stream=False, content="x " * 40))
        await first.closed
        self.assertEqual(first.status, 200)
        usage = json.loads(first.body_text())["usage"]
        spent = usage["input_tokens"] + usage["output_tokens"]
        self.assertGreaterEqual(spent, 30, "one answer spends the quota")
        ended = time.time()
        bodies = {
            "/llm/v1/messages": tagged("again", stream=True),
            "/llm/v1/chat/completions": {
                "model": "reasoning",
                "stream": True,
                "messages": [{"role": "user", "content": "hi"}],
            },
            "/llm/v1/responses": {"model": "reasoning", "input": "hi", "stream": True},
        }
        for path, body in bodies.items():
            refused = self.ask(path, body)
            await refused.closed
            self.assertEqual(refused.status, 429, path)
            wait = int(refused.header("retry-after"))
            left = 86_400 - (time.time() - ended)
            self.assertLessEqual(abs(wait - left), 2, (path, wait, left))
            error = json.loads(refused.body_text())
            if path == "/llm/v1/messages":
                self.assertEqual(error["error"]["type"], "rate_limit_error")
            else:
                self.assertEqual(error["error"]["code"], "rate_limit_exceeded")
            self.assertIn(f"try again in {wait}s", error["error"]["message"])
        other = self.send("flood-key", tagged("other", stream=False))
        await other.closed
        self.assertEqual(other.status, 200, "another client is not limited")
        status = await raw_status(self.port)
        self.assertEqual(
            status["clients"]["frontend"], {"tokens_per_day": 30, "tokens_used": spent}
        )
        self.assertEqual(self.started(), ["first", "other"])


async def raw_status(port: int) -> dict[str, Any]:
    response = raw_request(port, "GET", "/llm/v1/status")
    await response.closed
    return dict(json.loads(response.body_text()))


class AtOnce(FairLine):
    """Requests sent together are each checked again when granted a slot."""

    slots = 2
    limits = {"frontend": {"tokens_per_day": 40}}

    @async_test
    async def test_twelve_requests_at_once_overrun_the_day_by_at_most_two_slots_worth(
        self,
    ) -> None:
        sent = [
            raw_request(
                self.port,
                "POST",
                "/llm/v1/messages",
                tagged(f"burst-{i}", stream=False, max_tokens=8),
                headers={"authorization": "Bearer chat-key"},
            )
            for i in range(12)
        ]
        spent = []
        for response in sent:
            await response.closed
            if response.status == 200:
                usage = json.loads(response.body_text())["usage"]
                spent.append(usage["input_tokens"] + usage["output_tokens"])
            else:
                self.assertEqual(response.status, 429, response.body_text())
        self.assertLess(len(spent), 12)
        self.assertLessEqual(sum(spent), 40 + 2 * max(spent), spent)
        status = await raw_status(self.port)
        self.assertEqual(status["clients"]["frontend"]["tokens_used"], sum(spent))


class LiftedAndRestored(FairLine):
    limits = {"frontend": {"tokens_per_day": 1000}}

    async def spend(self) -> int:
        answer = raw_request(
            self.port,
            "POST",
            "/llm/v1/messages",
            tagged("t", stream=False),
            headers={"authorization": "Bearer chat-key"},
        )
        await answer.closed
        usage = json.loads(answer.body_text())["usage"]
        return int(usage["input_tokens"] + usage["output_tokens"])

    def used(self) -> int | None:
        return self.servers.gateway.quotas.status().get("frontend", {}).get("tokens_used")

    @async_test
    async def test_after_a_reload_that_lifts_and_restores_the_limit_the_day_is_the_ledgers(
        self,
    ) -> None:
        first = await self.spend()
        self.assertEqual(self.used(), first)
        lifted = copy.deepcopy(self.document)
        del lifted["clients"]["frontend"]["tokens_per_day"]
        self.servers.gateway.reload(parse_config(lifted, environ=KEYS))
        second = await self.spend()  # not limited: counted by the ledger alone
        self.servers.gateway.reload(parse_config(self.document, environ=KEYS))
        await wait_for(lambda: self.used() != first, what="the day read back")
        self.assertEqual(self.used(), first + second)


class RefusedRequests(FairLine):
    """A prompt the upstream refuses (past its window) produced no token: it costs nothing."""

    limits = {"frontend": {"tokens_per_day": 1000}}
    stub_settings = {**FairLine.stub_settings, "max_model_len": 64}

    @async_test
    async def test_a_prompt_the_upstream_refuses_is_charged_nothing_on_every_surface(
        self,
    ) -> None:
        long = "many words " * 400
        bodies = {
            "/llm/v1/messages": tagged("long", stream=False, content=long),
            "/llm/v1/chat/completions": {
                "model": "reasoning",
                "messages": [{"role": "user", "content": long}],
            },
            "/llm/v1/responses": {"model": "reasoning", "input": long},
        }
        for path, body in bodies.items():
            refused = raw_request(
                self.port, "POST", path, body, headers={"authorization": "Bearer chat-key"}
            )
            await refused.closed
            self.assertEqual(refused.status, 400, (path, refused.body_text()))
        status = await raw_status(self.port)
        self.assertEqual(status["clients"]["frontend"]["tokens_used"], 0)
        usage = raw_request(
            self.port, "GET", "/llm/v1/usage?by=client,surface", headers={"x-api-key": "chat-key"}
        )
        await usage.closed
        rows = json.loads(usage.body_text())["rows"]
        self.assertEqual(
            [(r["surface"], r["requests"], r["input_tokens"], r["output_tokens"]) for r in rows],
            [("chat", 1, 0, 0), ("messages", 1, 0, 0), ("responses", 1, 0, 0)],
        )
