"""/llm/v1/responses end to end against the real stub, over raw HTTP like curl: the exact event
order, each event checked against the Open Responses schemas, the same line as every surface,
and errors in OpenAI's shape, as an HTTP error or, once events went out, `response.failed`."""

from __future__ import annotations

import json
from typing import Any

from homelab_gateway.core.errors import GatewayError, upstream_http_error
from homelab_gateway.core.instructions import marked
from homelab_gateway.surfaces.responses import failure_code
from tests.core.test_instructions import render
from tests.surfaces.test_openai import OpenAISurface
from tests.surfaces.test_proxy import async_test
from testsupport.helpers import raw_request, wait_for
from testsupport.openresponses import check_response, check_stream

RESPONSES = "/llm/v1/responses"


def ask(text: str = "hi", *, stream: bool = True, **extra: Any) -> dict[str, Any]:
    return {"model": "reasoning", "stream": stream, "input": text, **extra}


def events_of(text: str) -> list[dict[str, Any]]:
    """The stream's events, asserting each is an `event:` line naming the `data:` line's type."""
    out = []
    for block in text.split("\n\n"):
        if not block or block.startswith(":"):
            continue
        name, data = block.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert name == "event: " + event["type"], block
        out.append(event)
    return out


class Responses(OpenAISurface):
    async def stream(self, body: dict[str, Any]) -> list[dict[str, Any]]:
        response = await self.post(body, RESPONSES)
        self.assertEqual(response.status, 200, response.body_text())
        self.assertEqual(response.header("content-type"), "text/event-stream; charset=utf-8")
        return events_of(response.body_text())


class Streaming(Responses):
    @async_test
    async def test_reasoning_then_text_in_exact_order(self) -> None:
        events = await self.stream(ask(reasoning={"effort": "low"}))
        self.assertEqual(check_stream(events), "response.completed")
        kinds = [e["type"] for e in events]
        self.assertEqual(
            kinds[:4],
            [
                "response.created",
                "response.in_progress",
                "response.output_item.added",
                "response.content_part.added",
            ],
        )
        self.assertEqual(events[2]["item"]["type"], "reasoning")
        items = events[-1]["response"]["output"]
        self.assertEqual([i["type"] for i in items], ["reasoning", "message"])
        streamed = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
        self.assertEqual(items[1]["content"][0]["text"], streamed)
        self.assertEqual(events[-1]["response"]["model"], "reasoning")
        usage = events[-1]["response"]["usage"]
        self.assertEqual(usage["total_tokens"], usage["input_tokens"] + usage["output_tokens"])
        sent = self.bodies[-1]
        self.assertEqual((sent["model"], sent["stream"]), ("Qwen/QwQ-32B", True))
        await self.settled()

    @async_test
    async def test_a_tool_call_round_trip(self) -> None:
        tools = [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}]
        events = await self.stream(ask("tool", tools=tools))
        self.assertEqual(check_stream(events), "response.completed")
        call = events[-1]["response"]["output"][-1]
        self.assertEqual((call["type"], call["name"]), ("function_call", "get_weather"))
        json.loads(call["arguments"])
        turn = [
            {"role": "user", "content": "tool"},
            {
                "type": "function_call",
                "call_id": call["call_id"],
                "name": call["name"],
                "arguments": call["arguments"],
            },
            {"type": "function_call_output", "call_id": call["call_id"], "output": "sunny"},
        ]
        events = await self.stream(ask(turn, tools=tools))  # type: ignore[arg-type]
        check_stream(events)
        sent = self.bodies[-1]["messages"]
        self.assertEqual(sent[1]["tool_calls"][0]["id"], call["call_id"])
        self.assertEqual(
            sent[2], {"role": "tool", "tool_call_id": call["call_id"], "content": "sunny"}
        )

    @async_test
    async def test_a_failure_mid_stream_is_response_failed(self) -> None:
        for prompt in ("fail", "reset", "truncate"):
            events = await self.stream(ask(prompt))
            self.assertEqual(check_stream(events), "response.failed", prompt)
            self.assertEqual(events[-1]["response"]["error"]["code"], "server_error")
        await self.settled()

    @async_test
    async def test_the_output_limit_is_response_incomplete(self) -> None:
        events = await self.stream(ask(max_output_tokens=3))
        self.assertEqual(check_stream(events), "response.incomplete")
        self.assertEqual(self.bodies[-1]["max_tokens"], 3)

    @async_test
    async def test_a_client_that_leaves_cancels_the_upstream(self) -> None:
        response = raw_request(self.port, "POST", RESPONSES, ask("long"))
        await response.until_text("response.output_text.delta")
        response.disconnect()
        await wait_for(lambda: self.log.events("cancelled"), what="the upstream to be cancelled")
        await self.settled()

    @async_test
    async def test_a_whole_answer_is_the_final_response_object(self) -> None:
        response = await self.post(ask(stream=False, metadata={"k": "v"}), RESPONSES)
        self.assertEqual(response.status, 200, response.body_text())
        self.assertEqual(response.header("content-type"), "application/json")
        document = json.loads(response.body_text())
        check_response(document)
        self.assertEqual((document["status"], document["metadata"]), ("completed", {"k": "v"}))
        self.assertEqual(document["output"][-1]["type"], "message")


class MidConversationInstructions(Responses):
    @async_test
    async def test_a_later_developer_item_reaches_the_upstream_folded(self) -> None:
        """As Codex sends it: a developer item after the user's turn, which Qwen3.5's template
        refuses in place; the upstream gets one system message, first, and the text."""
        turn = [
            {"role": "developer", "content": "be kind"},
            {"role": "user", "content": "hi"},
            {"role": "developer", "content": [{"type": "input_text", "text": "mind the time"}]},
        ]
        events = await self.stream(ask(turn, instructions="rules"))  # type: ignore[arg-type]
        self.assertEqual(check_stream(events), "response.completed")
        self.assertEqual(
            self.bodies[-1]["messages"],
            [
                {"role": "system", "content": "rules\n\nbe kind"},
                {"role": "user", "content": "hi\n\n" + marked("mind the time")},
            ],
        )
        render(self.bodies[-1]["messages"])  # the strict template takes it


class Errors(Responses):
    stub_settings = {"delay": 0.005, "max_model_len": 64}

    @async_test
    async def test_mistakes_and_stored_things_are_400s_naming_their_field(self) -> None:
        for body, param in (
            (ask(previous_response_id="resp_1"), "previous_response_id"),
            (ask(input=[{"role": "robot", "content": "x"}]), "input.0.role"),
            (ask(max_output_tokens="many"), "max_output_tokens"),
            ({"input": "hi"}, "model"),
        ):
            error = await self.error(body, 400, path=RESPONSES)
            self.assertEqual(error["param"], param, error)
            self.assertEqual(error["type"], "invalid_request_error")
        error = await self.error({**ask(), "model": "gpt-9"}, 404, path=RESPONSES)
        self.assertEqual(error["code"], "model_not_found")

    @async_test
    async def test_a_stored_response_is_never_found(self) -> None:
        response = raw_request(self.port, "GET", RESPONSES + "/resp_123")
        await response.closed
        self.assertEqual(response.status, 404)
        self.assertEqual(json.loads(response.body_text())["error"]["code"], "not_found")

    @async_test
    async def test_the_upstreams_context_refusal_is_context_length_exceeded(self) -> None:
        for stream in (True, False):
            error = await self.error(ask("word " * 100, stream=stream), 400, path=RESPONSES)
            self.assertEqual((error["code"], error["param"]), ("context_length_exceeded", "input"))


class TheLine(Responses):
    gateway_overrides = {"slots": 1}

    async def hold_the_slot(self) -> Any:
        busy = raw_request(self.port, "POST", RESPONSES, ask("long"))
        await busy.until_text("response.output_text.delta")
        return busy

    @async_test
    async def test_a_waiting_stream_is_queued_then_in_progress(self) -> None:
        busy = await self.hold_the_slot()
        waiting = raw_request(self.port, "POST", RESPONSES, ask())
        await waiting.until_text("event: response.queued")
        self.assertEqual(waiting.status, 200)
        busy.disconnect()
        await waiting.closed
        events = events_of(waiting.body_text())
        self.assertEqual(check_stream(events), "response.completed")
        kinds = [e["type"] for e in events]
        self.assertEqual(kinds[:3], ["response.created", "response.queued", "response.in_progress"])
        self.assertEqual(events[0]["response"]["status"], "queued")
        self.assertEqual(events[1]["queue"], {"type": "queue", "position": 1})
        self.assertNotIn("response.queued", kinds[2:])
        await self.settled()

    @async_test
    async def test_a_wait_too_long_is_response_failed_rate_limit_exceeded(self) -> None:
        self.servers.gateway.pools["vllm"].queue_timeout = 0.3
        busy = await self.hold_the_slot()
        events = events_of((await self.post(ask(), RESPONSES)).body_text())
        self.assertEqual(check_stream(events), "response.failed")
        error = events[-1]["response"]["error"]
        self.assertEqual(error["code"], "rate_limit_exceeded")
        self.assertIn("try again in 5s", error["message"])
        busy.disconnect()
        await self.settled()

    @async_test
    async def test_the_upstreams_refusal_of_a_queued_request_is_response_failed(self) -> None:
        busy = await self.hold_the_slot()
        waiting = raw_request(self.port, "POST", RESPONSES, ask("error400"))
        await waiting.until_text("event: response.queued")
        busy.disconnect()
        await waiting.closed
        events = events_of(waiting.body_text())
        self.assertEqual(check_stream(events), "response.failed")
        # A refusal that is no context overflow the gateway knows: final, never retried.
        self.assertEqual(events[-1]["response"]["error"]["code"], "invalid_prompt")
        await self.settled()


def test_a_refusal_after_events_is_final_and_a_fault_is_retried() -> None:
    """Codex retries a `response.failed` unless its code says that would not help."""
    refused = upstream_http_error(400, b'{"error": {"message": "bad template"}}', None)
    assert failure_code(refused) == "invalid_prompt"
    assert failure_code(upstream_http_error(500, b"oops", None)) == "server_error"
    assert failure_code(GatewayError(529, "full", outcome="queue_timeout")) == "rate_limit_exceeded"
    assert failure_code(GatewayError(503, "redis away")) == "server_error"
