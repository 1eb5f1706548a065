"""The stub's tool scenarios end an agent's loop: a chat whose last message is a tool result is
answered with content, as a model answers its tools' output, not with another call."""

from __future__ import annotations

import json
from typing import Any

from tests.dev.test_stub_openai import StubCase, events
from tests.surfaces.test_proxy import async_test

WEATHER = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]


def chat(messages: list[dict[str, Any]], *, stream: bool) -> dict[str, Any]:
    return {"model": "m", "stream": stream, "messages": messages, "tools": WEATHER}


def streamed(chunks: list[Any]) -> tuple[str, list[str], str | None]:
    """A stream's content, the names of its tool calls, and its finish reason."""
    choices = [c["choices"][0] for c in chunks if isinstance(c, dict) and c["choices"]]
    content = "".join(c["delta"].get("content") or "" for c in choices)
    calls = [
        call["function"]["name"]
        for c in choices
        for call in c["delta"].get("tool_calls", [])
        if "name" in call["function"]
    ]
    return content, calls, choices[-1]["finish_reason"]


def answered(body: str) -> tuple[str, list[str], str | None]:
    """The same of a whole chat.completion."""
    choice = json.loads(body)["choices"][0]
    calls = [call["function"]["name"] for call in choice["message"]["tool_calls"]]
    return choice["message"]["content"], calls, choice["finish_reason"]


class ToolResults(StubCase):
    async def turn(self, messages: list[dict[str, Any]], stream: bool) -> tuple[Any, ...]:
        response = await self.post("/v1/chat/completions", chat(messages, stream=stream))
        self.assertEqual(response.status, 200)
        if stream:
            return streamed(events(response))
        return answered(response.body_text())

    @async_test
    async def test_a_tool_result_is_answered_with_content_and_a_new_question_calls_again(
        self,
    ) -> None:
        self.serve(content_tokens=3)
        for word, count in (("tool", 1), ("parallel-tools", 2)):
            for stream in (True, False):
                where = (word, stream)
                ask = [{"role": "user", "content": f"use a {word} please"}]
                content, calls, finish = await self.turn(ask, stream)
                self.assertEqual(calls, ["get_weather"] * count, where)
                self.assertEqual(finish, "tool_calls", where)
                results = [
                    {"role": "tool", "tool_call_id": f"call_{i}", "content": "18C"}
                    for i in range(count)
                ]
                assistant = {
                    "role": "assistant",
                    "content": content,
                    "tool_calls": [
                        {
                            "id": f"call_{i}",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": "{}"},
                        }
                        for i in range(count)
                    ],
                }
                after = [*ask, assistant, *results]
                # the word is still in the last user message, but the last message is the
                # tools' output: the answer is content-only's, with no reasoning and no call
                self.assertEqual(
                    await self.turn(after, stream),
                    ("Hello! I am ", [], "stop"),
                    where,
                )
                # a new question after the answer asks for a tool again
                again = [*after, {"role": "assistant", "content": "done"}, *ask]
                self.assertEqual(
                    (await self.turn(again, stream))[1:],
                    (["get_weather"] * count, "tool_calls"),
                    where,
                )
        self.assertEqual(
            [fields["scenario"] for _, _, fields in self.log.events("start")],
            ["tool", "content-only", "tool"] * 2
            + ["parallel-tools", "content-only", "parallel-tools"] * 2,
        )

    @async_test
    async def test_other_scenarios_are_unchanged_after_a_tool_result(self) -> None:
        self.serve(content_tokens=2)
        result = [
            {"role": "user", "content": "fail"},
            {"role": "tool", "tool_call_id": "call_0", "content": "18C"},
        ]
        response = await self.post("/v1/chat/completions", chat(result, stream=True))
        self.assertEqual(events(response)[-2]["error"]["message"], "stub: the engine died")
        self.assertEqual(self.log.events("start")[0][2]["scenario"], "fail")
