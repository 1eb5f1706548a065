"""`GET /llm/v1/usage` on the real gateway and stub in-process: protected like /metrics, JSON
and CSV, a bad parameter named in its 400."""

from __future__ import annotations

import csv
import hashlib
import io
import json
from typing import Any

from twisted.trial.unittest import TestCase
from twisted.web.test.requesthelper import DummyRequest

from homelab_gateway.config import ClientConfig, auth_key_name
from homelab_gateway.web.access import AccessPolicy
from tests.surfaces.test_proxy import async_test
from testsupport.helpers import RawResponse, Servers, chat, gateway_document, raw_request

KEY = "usage-key"


class UsageEndpoint(TestCase):
    def start(self, **document: Any) -> None:
        self.servers = Servers(self)
        stub_url, _, _ = self.servers.stub(prompt_tokens_details=True)
        self.servers.start_gateway(
            {**gateway_document(stub_url), **document}, environ={"GATEWAY_KEYS": KEY}
        )
        self.port = self.servers.gateway_port

    async def get(self, path: str, **headers: str) -> RawResponse:
        response = raw_request(self.port, "GET", path, headers=headers)
        await response.closed
        return response

    @async_test
    async def test_protected_like_metrics_and_it_counts_the_request_just_answered(self) -> None:
        self.start(auth={"api_keys_env": "GATEWAY_KEYS", "protect_metrics": True})
        self.assertEqual((await self.get("/llm/v1/usage")).status, 401)
        told = {"input_tokens": 0, "output_tokens": 0, "cached_tokens": 0}
        for _ in range(2):  # the same long prompt again: the stub's prefix cache reads it
            body = chat(content="a long prompt " * 40, stream=False)
            answer = raw_request(self.port, "POST", "/llm/v1/messages", body, {"x-api-key": KEY})
            await answer.closed
            usage = json.loads(answer.body_text())["usage"]
            told["input_tokens"] += (
                usage["input_tokens"]
                + usage["cache_creation_input_tokens"]
                + usage["cache_read_input_tokens"]
            )
            told["output_tokens"] += usage["output_tokens"]
            told["cached_tokens"] += usage["cache_read_input_tokens"]
        self.assertGreater(told["cached_tokens"], 0)
        response = await self.get("/llm/v1/usage?by=client,model,surface", **{"x-api-key": KEY})
        self.assertEqual(response.status, 200, response.body_text())
        self.assertEqual(response.header("content-type"), "application/json")
        (row,) = json.loads(response.body_text())["rows"]
        self.assertEqual(
            {k: row[k] for k in ("client", "model", "surface", "requests", *told)},
            {
                "client": auth_key_name(KEY),
                "model": "reasoning",
                "surface": "messages",
                "requests": 2,
                **told,
            },
        )

    @async_test
    async def test_csv_and_a_bad_parameter(self) -> None:
        self.start()
        response = await self.get("/llm/v1/usage?format=csv&by=hour,model")
        self.assertEqual(response.status, 200)
        self.assertEqual(response.header("content-type"), "text/csv; charset=utf-8")
        header, *rows = csv.reader(io.StringIO(response.body_text()))
        self.assertEqual(header[:3], ["model", "hour", "requests"])
        self.assertEqual(rows, [])
        refused = await self.get("/llm/v1/usage?by=outcome")
        self.assertEqual(refused.status, 400)
        error = json.loads(refused.body_text())["error"]
        self.assertTrue(error["message"].startswith("by: "), error)


CLIENTS = {"alice": {"key_env": "ALICE_KEY"}, "bob": {"key_env": "BOB_KEY"}}
CLIENT_KEYS = {"ALICE_KEY": "alice-key", "BOB_KEY": "bob-key"}


class WhoReadsWhat(TestCase):
    """Wherever keys exist, `/llm/v1/usage` takes one: a `[clients]` key reads its own rows,
    an operator's key (`[auth]`) every client's; `protect_metrics` opens to any key."""

    def start(self, protect_metrics: bool) -> None:
        self.servers = Servers(self)
        stub_url, _, _ = self.servers.stub()
        document = {
            **gateway_document(stub_url),
            "auth": {"api_keys_env": "GATEWAY_KEYS", "protect_metrics": protect_metrics},
            "clients": CLIENTS,
        }
        self.servers.start_gateway(document, environ={"GATEWAY_KEYS": KEY, **CLIENT_KEYS})
        self.port = self.servers.gateway_port

    async def get(self, path: str, key: str | None = None) -> RawResponse:
        headers = {} if key is None else {"x-api-key": key}
        response = raw_request(self.port, "GET", path, headers=headers)
        await response.closed
        return response

    async def clients_read(self, path: str, key: str) -> list[str]:
        response = await self.get(path, key)
        self.assertEqual(response.status, 200, response.body_text())
        return [row["client"] for row in json.loads(response.body_text())["rows"]]

    @async_test
    async def test_a_client_key_reads_its_own_rows_and_an_operator_key_all(self) -> None:
        self.start(protect_metrics=False)
        for key in ("alice-key", "bob-key"):
            answer = raw_request(
                self.port, "POST", "/llm/v1/messages", chat(stream=False), {"x-api-key": key}
            )
            await answer.closed
            self.assertEqual(answer.status, 200)
        self.assertEqual((await self.get("/llm/v1/usage")).status, 401)
        self.assertEqual(await self.clients_read("/llm/v1/usage", "alice-key"), ["alice"])
        self.assertEqual(
            await self.clients_read("/llm/v1/usage?client=alice", "alice-key"), ["alice"]
        )
        other = await self.get("/llm/v1/usage?client=bob", "alice-key")
        self.assertEqual(other.status, 403, other.body_text())
        self.assertEqual(json.loads(other.body_text())["error"]["type"], "permission_error")
        self.assertEqual(await self.clients_read("/llm/v1/usage", KEY), ["alice", "bob"])
        self.assertEqual(await self.clients_read("/llm/v1/usage?client=bob", KEY), ["bob"])

    @async_test
    async def test_with_protect_metrics_any_configured_key_opens_metrics_and_status(self) -> None:
        self.start(protect_metrics=True)
        for path in ("/metrics", "/llm/v1/status"):
            self.assertEqual((await self.get(path)).status, 401, path)
            for key in (KEY, "alice-key"):
                self.assertEqual((await self.get(path, key)).status, 200, (path, key))

    @async_test
    async def test_a_moment_past_what_a_date_can_say_is_a_400(self) -> None:
        self.start(protect_metrics=False)
        for asked in ("since=1e19", "until=1e19", "since=-1e19", "since=1e300"):
            response = await self.get(f"/llm/v1/usage?{asked}", KEY)
            self.assertEqual(response.status, 400, (asked, response.body_text()))
            error = json.loads(response.body_text())["error"]
            self.assertTrue(error["message"].startswith(asked.split("=")[0] + ": "), error)


def test_with_only_client_keys_protect_metrics_takes_a_client_key() -> None:
    """What `/metrics` and `/llm/v1/status` ask of a request (`refusal`, `protected` as
    `protect_metrics` says), with `[clients]` keys and no operator's."""
    digest = hashlib.sha256(b"alice-key").digest()
    policy = AccessPolicy(
        None,
        protect_metrics=True,
        cors_origins=(),
        clients={"alice": ClientConfig(name="alice", key_sha256=digest)},
    )

    def asking(key: str | None) -> DummyRequest:
        request = DummyRequest([b""])
        if key is not None:
            request.requestHeaders.setRawHeaders(b"x-api-key", [key.encode()])
        return request

    assert policy.refusal(asking(None), protected=policy.protect_metrics, draining=False)
    assert policy.refusal(asking("nope"), protected=policy.protect_metrics, draining=False)
    assert policy.refusal(asking("alice-key"), protected=True, draining=False) is None
    assert policy.client_key(asking("alice-key")) == "alice"
