"""What a hostile client or a careless operator found at the edges: numbers that are not
JSON, model names that are not labels, paths and headers the router never expected, and
connections that never say anything."""

from __future__ import annotations

import json
from typing import Any

from twisted.logger import formatEvent, globalLogPublisher

from homelab_gateway.telemetry import loggable
from tests.helpers import chat, raw_request, wait_for
from tests.test_llm import LLMSurface
from tests.test_operations import metric
from tests.test_proxy import async_test


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
        self.logged: list[dict[str, Any]] = []

        def observe(event: dict[str, Any]) -> None:
            if event.get("log_namespace") == "homelab_gateway.requests":
                self.logged.append(event)

        globalLogPublisher.addObserver(observe)
        self.addCleanup(globalLogPublisher.removeObserver, observe)

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
        await wait_for(lambda: len(self.logged) == 1, 2.0, "the log event")
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
        await wait_for(lambda: len(self.logged) == 20, 2.0, "the log events")
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
