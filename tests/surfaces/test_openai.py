"""The OpenAI surfaces end to end against the real stub, over raw HTTP like curl: the exact
bytes (renamed model, `[DONE]`, no usage chunk unless asked, queue comments), the same line as
/llm/v1/messages, and every error in OpenAI's shape."""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

import pytest
from twisted.trial.unittest import TestCase

from homelab_gateway.core.errors import GatewayError
from homelab_gateway.core.instructions import marked
from homelab_gateway.core.openai import StreamRelay
from homelab_gateway.surfaces.openai import early_failure
from homelab_gateway.web.access import AccessPolicy
from homelab_gateway.web.channel import WireLimits
from tests.core.test_instructions import render
from tests.surfaces.test_proxy import async_test
from testsupport.helpers import (
    Servers,
    capture_request_log,
    gateway_document,
    raw_request,
    wait_for,
)

CHAT = "/llm/v1/chat/completions"


def chat(content: str = "hi", *, stream: bool = True, **extra: Any) -> dict[str, Any]:
    return {
        "model": "reasoning",
        "stream": stream,
        "messages": [{"role": "user", "content": content}],
        **extra,
    }


def data_lines(text: str) -> list[str]:
    """The stream's events, asserting each is one `data:` line (comments aside)."""
    out = []
    for block in text.split("\n\n"):
        if not block:
            continue
        if block.startswith(":"):
            continue
        assert block.startswith("data: ") and "\n" not in block, block
        out.append(block[len("data: ") :])
    return out


def chunks(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in data_lines(text) if line != "[DONE]"]


class OpenAISurface(TestCase):
    stub_settings: dict[str, Any] = {"delay": 0.005}
    gateway_overrides: dict[str, Any] = {}

    def setUp(self) -> None:
        self.servers = Servers(self)
        self.stub_url, self.stub, self.log = self.servers.stub(**self.stub_settings)
        document = gateway_document(self.stub_url, **self.gateway_overrides)
        document["models"]["reasoning"]["upstream_model"] = "Qwen/QwQ-32B"
        self.servers.start_gateway(document)
        self.port = self.servers.gateway_port
        self.bodies: list[dict[str, Any]] = []  # what the stub was sent
        render = self.stub.render_POST

        def capture(request: Any) -> Any:
            self.bodies.append(json.loads(request.content.getvalue()))
            request.content.seek(0)
            return render(request)

        self.stub.render_POST = capture  # type: ignore[method-assign]

    @property
    def line(self) -> Any:
        return self.servers.gateway.pools["vllm"].line

    async def post(self, body: Any, path: str = CHAT, **kw: Any) -> Any:
        response = raw_request(self.port, "POST", path, body, **kw)
        await response.closed
        return response

    async def error(self, body: Any, status: int, **kw: Any) -> dict[str, Any]:
        response = await self.post(body, **kw)
        self.assertEqual(response.status, status, response.body_text())
        self.assertEqual(response.header("content-type"), "application/json")
        document = json.loads(response.body_text())
        self.assertEqual(set(document), {"error"})
        self.assertLessEqual({"message", "type", "param", "code"}, set(document["error"]))
        return dict(document["error"])

    async def settled(self) -> None:
        await wait_for(
            lambda: self.line.in_use == 0 and not self.line.waiting, what="slots to be free"
        )

    async def direct(self, body: dict[str, Any]) -> str:
        """The stub's own answer to `body` (for the upstream's model), as a client of it."""
        port = int(self.stub_url.rsplit(":", 1)[1].split("/")[0])
        response = raw_request(port, "POST", "/v1/chat/completions", body)
        await response.closed
        return str(response.body_text())


def same_but_ids(text: str) -> str:
    """Streams of two runs differ in their ids and timestamps only."""
    text = re.sub(r'"created":( ?)\d+', r'"created":\g<1>0', text)
    text = re.sub(r'"id":( ?)"cmpl-\d+"', r'"id":\g<1>"cmpl"', text)
    text = re.sub(r'"id":( ?)"chatcmpl-tool-[0-9a-f]+"', r'"id":\g<1>"tool"', text)
    return re.sub(r'"id":( ?)"chatcmpl-\d+"', r'"id":\g<1>"chatcmpl"', text)


class Streaming(OpenAISurface):
    @async_test
    async def test_a_stream_is_the_upstreams_bytes_but_the_models_name(self) -> None:
        for prompt in ("hi", "tool", "content-only"):
            response = await self.post(chat(prompt, max_tokens=40, tools=[]))
            self.assertEqual(response.status, 200)
            self.assertEqual(response.header("content-type"), "text/event-stream; charset=utf-8")
            text = response.body_text()
            self.assertTrue(text.endswith("data: [DONE]\n\n"), text[-200:])
            self.assertEqual({c["model"] for c in chunks(text)}, {"reasoning"})
            theirs = await self.direct(
                {**chat(prompt, max_tokens=40, tools=[]), "model": "Qwen/QwQ-32B"}
            )
            self.assertEqual(
                same_but_ids(text),
                same_but_ids(theirs.replace('"model":"Qwen/QwQ-32B"', '"model":"reasoning"')),
            )
        await self.settled()

    @async_test
    async def test_the_usage_chunk_reaches_only_a_client_that_asked(self) -> None:
        response = await self.post(chat())
        self.assertNotIn([], [c["choices"] for c in chunks(response.body_text())])
        self.assertEqual(self.bodies[-1]["stream_options"], {"include_usage": True})
        response = await self.post(chat(stream_options={"include_usage": True}))
        last = chunks(response.body_text())[-1]
        self.assertEqual(last["choices"], [])
        self.assertEqual(last["usage"]["prompt_tokens"], 5)
        self.assertEqual(last["model"], "reasoning")

    @async_test
    async def test_unknown_fields_pass_and_the_models_limits_apply(self) -> None:
        models = self.servers.gateway.models
        models["reasoning"] = dataclasses.replace(
            models["reasoning"], max_tokens=32, params={"top_k": 5, "temperature": 0.1}
        )
        extras = {"chat_template_kwargs": {"enable_thinking": False}, "guided_json": {}}
        await self.post(chat(max_tokens=1000, temperature=0.7, **extras))
        sent = self.bodies[-1]
        self.assertEqual(sent["model"], "Qwen/QwQ-32B")
        self.assertEqual(sent["max_tokens"], 32)
        self.assertEqual((sent["top_k"], sent["temperature"]), (5, 0.7))
        self.assertEqual(sent["chat_template_kwargs"], extras["chat_template_kwargs"])
        self.assertEqual(sent["guided_json"], {})
        await self.post(chat(max_completion_tokens=8))
        self.assertEqual(self.bodies[-1]["max_completion_tokens"], 8)
        self.assertNotIn("max_tokens", self.bodies[-1])
        await self.post(chat())
        self.assertEqual(self.bodies[-1]["max_tokens"], 32)  # a chat that sets none gets it

    @async_test
    async def test_a_failure_mid_stream_ends_with_an_error_line_and_no_done(self) -> None:
        for prompt in ("fail", "garbage", "reset", "truncate"):
            response = await self.post(chat(prompt))
            self.assertEqual(response.status, 200, prompt)
            lines = data_lines(response.body_text())
            self.assertNotIn("[DONE]", lines, prompt)
            error = json.loads(lines[-1])
            self.assertEqual(set(error), {"error"}, prompt)
            self.assertIsInstance(error["error"]["message"], str, prompt)
            self.assertTrue(all("choices" in json.loads(line) for line in lines[:-1]), prompt)
        await self.settled()

    @async_test
    async def test_a_client_that_leaves_cancels_the_upstream(self) -> None:
        response = raw_request(self.port, "POST", CHAT, chat("long"))
        await response.until_text('"content":"')
        response.disconnect()
        await wait_for(lambda: self.log.events("cancelled"), what="the upstream to be cancelled")
        await self.settled()

    @async_test
    async def test_the_request_log_and_metrics_name_the_surface(self) -> None:
        logged = capture_request_log(self)
        await self.post(chat())
        await wait_for(lambda: logged, what="the request's log line")
        self.assertEqual(logged[-1]["surface"], "chat")
        metrics = raw_request(self.port, "GET", "/metrics")
        await metrics.closed
        self.assertIn('surface="chat"', metrics.body_text())


LATE_SYSTEM = [
    {"role": "system", "content": "be kind"},
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": "hello"},
    {"role": "developer", "content": "mind the time"},
]


class SystemMessagesAsSent(OpenAISurface):
    @async_test
    async def test_a_chats_messages_reach_the_upstream_as_the_client_wrote_them(self) -> None:
        response = await self.post(chat(messages=LATE_SYSTEM))
        self.assertEqual(response.status, 200, response.body_text())
        self.assertEqual(self.bodies[-1]["messages"], LATE_SYSTEM)


class SystemMessagesFirst(OpenAISurface):
    gateway_overrides = {"model": {"system_messages": "first"}}

    @async_test
    async def test_a_later_system_message_reaches_the_upstream_folded(self) -> None:
        """For a model whose template refuses a system message in place (Qwen3.5's): one
        system message, first, and the later one's text as a user turn of its own, since an
        assistant turn comes before it."""
        response = await self.post(chat(messages=LATE_SYSTEM))
        self.assertEqual(response.status, 200, response.body_text())
        self.assertEqual(
            self.bodies[-1]["messages"],
            [*LATE_SYSTEM[:3], {"role": "user", "content": marked("mind the time")}],
        )
        render(self.bodies[-1]["messages"])  # the strict template takes it


class Whole(OpenAISurface):
    @async_test
    async def test_a_whole_answer_is_the_upstreams_body_renamed(self) -> None:
        response = await self.post(chat(stream=False))
        self.assertEqual(response.status, 200)
        self.assertEqual(response.header("content-type"), "application/json")
        answer = json.loads(response.body_text())
        self.assertEqual(answer["model"], "reasoning")
        self.assertEqual(answer["object"], "chat.completion")
        self.assertEqual(answer["usage"]["prompt_tokens"], 5)
        self.assertFalse(self.bodies[-1]["stream"])
        self.assertNotIn("stream_options", self.bodies[-1])
        theirs = await self.direct({**chat(stream=False), "model": "Qwen/QwQ-32B"})
        self.assertIn('"model": "Qwen/QwQ-32B"', theirs)  # as the stub writes it, spaced
        self.assertEqual(
            same_but_ids(response.body_text()),
            same_but_ids(theirs.replace('"model": "Qwen/QwQ-32B"', '"model": "reasoning"')),
        )


class Errors(OpenAISurface):
    stub_settings = {"delay": 0.005, "max_model_len": 64}

    @async_test
    async def test_each_mistake_is_a_400_naming_its_field(self) -> None:
        cases = [
            (b"{not json", None),
            ({"messages": [{"role": "user", "content": "hi"}]}, "model"),
            ({"model": "reasoning"}, "messages"),
            ({"model": "reasoning", "messages": []}, "messages"),
            ({"model": "reasoning", "messages": ["hi"]}, "messages.0"),
            (chat(max_tokens="many"), "max_tokens"),
            (chat(max_completion_tokens=0), "max_completion_tokens"),
            (chat(stream="yes"), "stream"),
        ]
        for body, param in cases:
            error = await self.error(body, 400)
            self.assertEqual(error["type"], "invalid_request_error", body)
            self.assertEqual(error["param"], param, body)
            if param is not None:
                self.assertIn(param, error["message"], body)
        self.assertEqual(self.bodies, [])

    @async_test
    async def test_an_unknown_model_is_a_404_model_not_found(self) -> None:
        error = await self.error({**chat(), "model": "gpt-9"}, 404)
        self.assertEqual((error["code"], error["param"]), ("model_not_found", "model"))

    @async_test
    async def test_the_upstreams_context_refusal_is_context_length_exceeded(self) -> None:
        for stream in (True, False):
            error = await self.error(chat("word " * 100, stream=stream, max_tokens=8), 400)
            self.assertEqual(error["code"], "context_length_exceeded")
            self.assertEqual(error["param"], "messages")
            self.assertIn("maximum context length is 64 tokens", error["message"])

    @async_test
    async def test_an_upstreams_own_error_passes_with_its_status_and_body(self) -> None:
        response = await self.post(chat("error500"))
        self.assertEqual(response.status, 500)
        self.assertEqual(
            json.loads(response.body_text())["error"]["message"],
            "stub: internal error before the stream",
        )

    @async_test
    async def test_a_body_over_the_limit_is_a_413_in_openais_shape(self) -> None:
        site = self.servers.gateway.site
        site.limits = WireLimits(max_body_bytes=1000, max_header_bytes=16384, request_timeout=60)
        error = await self.error(chat("x" * 2000), 413)
        self.assertEqual(error["type"], "invalid_request_error")

    @async_test
    async def test_a_missing_key_is_a_401_invalid_api_key(self) -> None:
        self.servers.gateway.app.access = AccessPolicy(
            ["sekrit"], protect_metrics=False, cors_origins=()
        )
        error = await self.error(chat(), 401)
        self.assertEqual(
            (error["type"], error["code"]), ("authentication_error", "invalid_api_key")
        )
        response = await self.post(chat(), headers={"Authorization": "Bearer sekrit"})
        self.assertEqual(response.status, 200)

    @async_test
    async def test_get_is_a_405(self) -> None:
        response = raw_request(self.port, "GET", CHAT)
        await response.closed
        self.assertEqual(response.status, 405)
        self.assertEqual(json.loads(response.body_text())["error"]["type"], "invalid_request_error")


class SlowWholeAnswers(OpenAISurface):
    stub_settings = {"hold": 2.0}
    gateway_overrides = {"upstream": {"connect_timeout": 0.2, "idle_timeout": 0.5}}

    @async_test
    async def test_a_whole_answer_past_idle_timeout_is_a_504_and_no_fault_of_the_replicas(
        self,
    ) -> None:
        error = await self.error(chat(stream=False), 504)
        self.assertIn("stream it", error["message"])
        self.assertEqual(self.servers.gateway.pools["vllm"].replica.circuit.state, "up")
        await wait_for(lambda: self.log.events("cancelled"), what="the upstream to be cancelled")
        await self.settled()


class TheLine(OpenAISurface):
    gateway_overrides = {"slots": 1}

    async def hold_the_slot(self) -> Any:
        """A Messages stream that holds the one slot until it is cut off."""
        busy = raw_request(
            self.port,
            "POST",
            "/llm/v1/messages",
            {
                "model": "reasoning",
                "max_tokens": 4000,
                "stream": True,
                "messages": [{"role": "user", "content": "long"}],
            },
        )
        await busy.until_text("content_block_delta")
        return busy

    @async_test
    async def test_a_waiting_stream_hears_its_place_in_comments_then_the_answer(self) -> None:
        busy = await self.hold_the_slot()
        waiting = raw_request(self.port, "POST", CHAT, chat())
        await waiting.until_text(": queue ")
        self.assertEqual(waiting.status, 200)
        text = waiting.body_text()
        self.assertTrue(text.startswith(': queue {"type":"queue","position":1'), text)
        busy.disconnect()
        await waiting.closed
        text = waiting.body_text()
        first_data = text.index("data: ")
        self.assertNotIn("\n: ", text[first_data:])  # no comment after the first data line
        self.assertTrue(text.endswith("data: [DONE]\n\n"))
        await self.settled()

    @async_test
    async def test_the_status_counts_requests_by_surface(self) -> None:
        busy = await self.hold_the_slot()
        waiting = raw_request(self.port, "POST", CHAT, chat())
        await waiting.until_text(": queue ")
        status = raw_request(self.port, "GET", "/llm/v1/status")
        await status.closed
        surfaces = json.loads(status.body_text())["surfaces"]
        self.assertEqual(surfaces, {"chat": {"in_flight": 1}, "messages": {"in_flight": 1}})
        busy.disconnect()
        await waiting.closed
        await self.settled()

    @async_test
    async def test_a_wait_too_long_is_an_error_line_after_the_comments(self) -> None:
        self.servers.gateway.pools["vllm"].queue_timeout = 0.3
        busy = await self.hold_the_slot()
        response = await self.post(chat())
        text = response.body_text()
        self.assertTrue(text.startswith(": queue "), text)
        self.assertEqual(len(data_lines(text)), 1, text)
        error = json.loads(data_lines(text)[0])["error"]
        self.assertEqual(
            (error["type"], error["code"]), ("rate_limit_error", "rate_limit_exceeded")
        )
        # Not streamed: a 429 with retry-after, which OpenAI's SDKs retry.
        response = await self.post(chat(stream=False))
        self.assertEqual(response.status, 429)
        self.assertEqual(response.header("retry-after"), "5")
        busy.disconnect()
        await self.settled()

    @async_test
    async def test_a_full_line_is_a_429_with_retry_after(self) -> None:
        busy = await self.hold_the_slot()
        self.line.queue_limit = 0
        error = await self.error(chat(), 429)
        self.assertEqual(error["code"], "rate_limit_exceeded")
        busy.disconnect()
        await self.settled()


class CompletionsAndEmbeddings(OpenAISurface):
    gateway_overrides = {"slots": 1}

    async def direct_to(self, path: str, body: dict[str, Any]) -> Any:
        port = int(self.stub_url.rsplit(":", 1)[1].split("/")[0])
        response = raw_request(port, "POST", "/v1" + path, {**body, "model": "Qwen/QwQ-32B"})
        await response.closed
        return response

    @async_test
    async def test_completions_stream_and_answer_whole_as_the_upstream_does(self) -> None:
        for stream in (True, False):
            body = {"model": "reasoning", "prompt": "once upon", "max_tokens": 8, "stream": stream}
            response = await self.post(body, path="/llm/v1/completions")
            self.assertEqual(response.status, 200, response.body_text())
            theirs = await self.direct_to("/completions", body)
            text = same_but_ids(response.body_text())
            expected = theirs.body_text().replace('"Qwen/QwQ-32B"', '"reasoning"')
            self.assertEqual(text, same_but_ids(expected))
            if stream:
                self.assertTrue(text.endswith("data: [DONE]\n\n"))
                self.assertNotIn([], [c["choices"] for c in chunks(text)])
        self.assertEqual(self.bodies[-1]["model"], "Qwen/QwQ-32B")

    @async_test
    async def test_embeddings_in_every_format_are_the_upstreams_bytes_renamed(self) -> None:
        for encoding in ("float", "base64", "bytes", "bytes_only"):
            body = {"model": "reasoning", "input": ["a", "b"], "encoding_format": encoding}
            response = await self.post(body, path="/llm/v1/embeddings")
            self.assertEqual(response.status, 200, encoding)
            theirs = await self.direct_to("/embeddings", body)
            self.assertEqual(response.header("content-type"), theirs.header("content-type"))
            if encoding.startswith("bytes"):
                self.assertEqual(response.body_bytes(), theirs.body_bytes(), encoding)
                metadata = response.header("metadata")
                if encoding == "bytes":
                    self.assertEqual(json.loads(metadata)["model"], "reasoning")
                    self.assertEqual(
                        re.sub(r'"(id|created)": [^,]+', "", metadata),
                        re.sub(
                            r'"(id|created)": [^,]+',
                            "",
                            theirs.header("metadata").replace("Qwen/QwQ-32B", "reasoning"),
                        ),
                    )
                else:
                    self.assertIsNone(metadata)
                continue
            mine = json.loads(response.body_text())
            expected = json.loads(theirs.body_text())
            self.assertEqual(mine["model"], "reasoning", encoding)
            self.assertEqual(mine["data"], expected["data"], encoding)
            self.assertEqual(mine["usage"], expected["usage"], encoding)

    @async_test
    async def test_an_embedding_waits_in_the_line_like_any_request(self) -> None:
        busy = raw_request(self.port, "POST", CHAT, chat("long"))
        await busy.until_text('"content":"')
        waiting = raw_request(
            self.port, "POST", "/llm/v1/embeddings", {"model": "reasoning", "input": "x"}
        )
        await wait_for(lambda: len(self.line.waiting) == 1, what="the embedding to wait")
        self.assertEqual(waiting.raw, b"")  # a whole answer says nothing while it waits
        busy.disconnect()
        await waiting.closed
        self.assertEqual(waiting.status, 200)
        await self.settled()

    @async_test
    async def test_a_bad_input_names_its_field(self) -> None:
        error = await self.error(
            {"model": "reasoning", "input": []}, 400, path="/llm/v1/embeddings"
        )
        self.assertEqual(error["param"], "input")
        error = await self.error({"model": "reasoning"}, 400, path="/llm/v1/completions")
        self.assertEqual(error["param"], "prompt")


class _Stream:
    started = False


def test_a_stream_that_fails_before_any_byte_went_out_is_an_http_error() -> None:
    relay = StreamRelay("mine", include_usage=False)
    out = relay.feed(b'data: {"error": {"message": "grammar failed", "code": 400}}\n\n')
    with pytest.raises(GatewayError) as caught:
        early_failure(relay, _Stream(), out)  # type: ignore[arg-type]
    assert (caught.value.status, caught.value.upstream_status) == (400, 400)
    assert json.loads(caught.value.upstream_body or b"")["error"]["message"] == "grammar failed"
    broken = StreamRelay("mine", include_usage=False)
    out = broken.eof("vllm")
    with pytest.raises(GatewayError) as caught:
        early_failure(broken, _Stream(), out)  # type: ignore[arg-type]
    assert caught.value.status == 502
    started = _Stream()
    started.started = True
    early_failure(broken, started, out)  # type: ignore[arg-type]  # too late: the line says it
    # chunks before the error in the same read reach the client, and the error line after them
    mixed = StreamRelay("mine", include_usage=False)
    out = mixed.feed(
        b'data: {"model":"m","choices":[{"delta":{"content":"a"}}]}\n\n'
        b'data: {"error": {"message": "boom", "code": 500}}\n\n'
    )
    early_failure(mixed, _Stream(), out)  # type: ignore[arg-type]
