"""The Responses surface's sans-IO core: requests mapped to chat, and the translator's blocks
made Responses events, each checked against the Open Responses schemas."""

from __future__ import annotations

import json
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from homelab_gateway.config import ModelConfig
from homelab_gateway.core.fields import InvalidRequest
from homelab_gateway.core.instructions import marked
from homelab_gateway.core.response_stream import ResponseStream
from homelab_gateway.core.response_tools import INPUT_SCHEMA, Offered
from homelab_gateway.core.responses import ResponsesRequest, map_responses
from homelab_gateway.core.sse import encode_event
from homelab_gateway.core.translator import StreamTranslator, UpstreamDecoder
from tests.core.test_translator import chunk, chunks, tool_args, tool_head, upstream_frames
from testsupport.openresponses import check_response, check_stream

MODEL = ModelConfig(name="local", upstream="vllm", upstream_model="Qwen/Qwen3-32B")


def usage(prompt: int, completion: int) -> dict[str, Any]:
    """vLLM's last chunk: the usage, and no choices."""
    return {
        "id": "chatcmpl-1",
        "choices": [],
        "usage": {"prompt_tokens": prompt, "completion_tokens": completion},
    }


def upstream(body: dict[str, Any], model: ModelConfig = MODEL) -> dict[str, Any]:
    """The chat request `body` becomes upstream."""
    return json.loads(map_responses(body, model).packed.body(model="Qwen/Qwen3-32B"))


def refusal(body: dict[str, Any]) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as caught:
        map_responses(body, MODEL)
    return caught.value


def test_a_string_input_is_one_user_message_streamed_upstream_with_usage() -> None:
    out = upstream({"model": "m", "input": "hi"})
    assert out["messages"] == [{"role": "user", "content": "hi"}]
    assert out["stream"] is True
    assert out["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    assert out["model"] == "Qwen/Qwen3-32B"


def test_instructions_and_the_opening_developer_messages_become_one_system_message() -> None:
    out = upstream(
        {
            "model": "m",
            "instructions": "Be brief.",
            "input": [
                {"type": "message", "role": "developer", "content": "Use tools."},
                {"role": "system", "content": [{"type": "input_text", "text": "Sys."}]},
                {"role": "user", "content": "hi"},
                {"role": "developer", "content": "Later."},
            ],
        }
    )
    assert out["messages"] == [
        {"role": "system", "content": "Be brief.\n\nUse tools.\n\nSys."},
        {"role": "user", "content": "hi\n\n" + marked("Later.")},
    ]


def test_a_later_developer_message_is_folded_never_between_a_call_and_its_outputs() -> None:
    """Codex's developer items mid-conversation: templates refuse a system message in place,
    so the text joins the turn beside it; the calls on either side stay one message."""
    out = upstream(
        {
            "model": "m",
            "input": [
                {"role": "user", "content": "go"},
                {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                {"role": "developer", "content": "mind the time"},
                {"type": "function_call", "call_id": "c2", "name": "f", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "one"},
                {"type": "function_call_output", "call_id": "c2", "output": "two"},
                {"role": "assistant", "content": "done"},
                {"role": "system", "content": "be brief"},
            ],
        }
    )
    assert [m["role"] for m in out["messages"]] == [
        "user",
        "assistant",
        "tool",
        "tool",
        "assistant",
        "user",
    ]
    assert [c["id"] for c in out["messages"][1]["tool_calls"]] == ["c1", "c2"]
    assert out["messages"][3]["content"] == "two\n\n" + marked("mind the time")
    assert out["messages"][5] == {"role": "user", "content": marked("be brief")}


def test_a_codex_turn_maps_calls_outputs_and_drops_reasoning() -> None:
    out = upstream(
        {
            "model": "m",
            "input": [
                {
                    "type": "message",
                    "role": "user",
                    "content": [{"type": "input_text", "text": "ls"}],
                },
                {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": None},
                {
                    "type": "message",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": "Running."}],
                },
                {
                    "type": "function_call",
                    "call_id": "c1",
                    "name": "exec_command",
                    "arguments": '{"cmd":"ls"}',
                },
                {"type": "reasoning", "id": "rs_2", "summary": []},
                {
                    "type": "function_call",
                    "call_id": "c2",
                    "name": "exec_command",
                    "arguments": "{}",
                },
                {"type": "function_call_output", "call_id": "c1", "output": "a.txt"},
                {
                    "type": "function_call_output",
                    "call_id": "c2",
                    "output": [{"type": "input_text", "text": "b.txt"}],
                },
                {"type": "web_search_call", "id": "ws_1", "status": "completed"},
            ],
        }
    )
    calls = [
        {
            "id": "c1",
            "type": "function",
            "function": {"name": "exec_command", "arguments": '{"cmd":"ls"}'},
        },
        {"id": "c2", "type": "function", "function": {"name": "exec_command", "arguments": "{}"}},
    ]
    assert out["messages"] == [
        {"role": "user", "content": "ls"},
        {"role": "assistant", "content": "Running.", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "c1", "content": "a.txt"},
        {"role": "tool", "tool_call_id": "c2", "content": "b.txt"},
    ]


def test_calls_with_no_assistant_text_have_null_content_and_images_follow_tool_output() -> None:
    image = "data:image/png;base64,iVBORw0KGgo="
    out = upstream(
        {
            "model": "m",
            "input": [
                {"role": "user", "content": "look"},
                {"type": "function_call", "call_id": "c1", "name": "shot", "arguments": ""},
                {
                    "type": "function_call_output",
                    "call_id": "c1",
                    "output": [
                        {"type": "input_text", "text": "here"},
                        {"type": "input_image", "image_url": image, "detail": "low"},
                    ],
                },
            ],
        }
    )
    assert out["messages"][1] == {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "shot", "arguments": "{}"}}
        ],
    }
    assert out["messages"][2:] == [
        {"role": "tool", "tool_call_id": "c1", "content": "here"},
        {
            "role": "user",
            "content": [{"type": "image_url", "image_url": {"url": image, "detail": "low"}}],
        },
    ]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"background": True}, "background"),
        ({"input": 3}, "input"),
        (
            {"input": [{"role": "user", "content": "x"}, {"type": "item_reference", "id": "x"}]},
            "input.1.type",
        ),
        (
            {"input": [{"type": "function_call_output", "call_id": "nope", "output": "x"}]},
            "input.0.call_id",
        ),
        ({"input": [{"role": "robot", "content": "x"}]}, "input.0.role"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
            "input.0.content.0.type",
        ),
        (
            {
                "input": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "input_image", "image_url": "data:image/png;base64,@@"}
                        ],
                    }
                ]
            },
            "input.0.content.0.image_url",
        ),
        ({"input": [{"role": "developer", "content": "only"}]}, "input"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"temperature": "hot"}, "temperature"),
        ({"tools": [{"type": "function"}]}, "tools.0.name"),
        ({"tools": [{"type": "wormhole"}]}, "tools.0.type"),
        (
            {
                "tools": [{"type": "function", "name": "f"}],
                "tool_choice": {"type": "function", "name": "g"},
            },
            "tool_choice.name",
        ),
        ({"reasoning": {"effort": "huge"}}, "reasoning.effort"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
        ({"top_logprobs": 3}, "top_logprobs"),
    ],
)
def test_a_mistake_is_refused_naming_its_field(body: dict[str, Any], param: str) -> None:
    error = refusal({"model": "m", "input": "hi", **body})
    assert error.param == param
    assert str(error).startswith(param.split(".")[0])


def test_tools_are_offered_flat_namespaced_ones_under_one_name_and_hosted_ones_dropped() -> None:
    body = {
        "model": "m",
        "input": "hi",
        "tools": [
            {
                "type": "function",
                "name": "exec_command",
                "description": "Run",
                "strict": False,
                "parameters": {"type": "object"},
            },
            {"type": "web_search", "external_web_access": False},
            {
                "type": "namespace",
                "name": "multi_agent_v1",
                "description": "Agents",
                "tools": [{"type": "function", "name": "spawn", "parameters": {"type": "object"}}],
            },
        ],
        "tool_choice": "auto",
        "parallel_tool_calls": True,
    }
    out = upstream(body)
    assert [t["function"]["name"] for t in out["tools"]] == [
        "exec_command",
        "multi_agent_v1__spawn",
    ]
    assert out["tools"][0] == {
        "type": "function",
        "function": {
            "name": "exec_command",
            "parameters": {"type": "object"},
            "description": "Run",
            "strict": False,
        },
    }
    assert out["tool_choice"] == "auto"
    assert out["parallel_tool_calls"] is True
    mapped = map_responses(body, MODEL)
    assert mapped.names["multi_agent_v1__spawn"] == Offered("multi_agent_v1", "spawn")


def test_only_hosted_tools_means_no_tools_upstream() -> None:
    out = upstream(
        {"model": "m", "input": "hi", "tools": [{"type": "web_search"}], "tool_choice": "required"}
    )
    assert "tools" not in out and "tool_choice" not in out


def test_a_named_tool_choice_and_allowed_tools() -> None:
    tools = [{"type": "function", "name": n} for n in ("a", "b", "c")]
    named = upstream(
        {
            "model": "m",
            "input": "hi",
            "tools": tools,
            "tool_choice": {"type": "function", "name": "b"},
        }
    )
    assert named["tool_choice"] == {"type": "function", "function": {"name": "b"}}
    allowed = upstream(
        {
            "model": "m",
            "input": "hi",
            "tools": tools,
            "tool_choice": {
                "type": "allowed_tools",
                "mode": "required",
                "tools": [{"type": "function", "name": "c"}],
            },
        }
    )
    assert allowed["tool_choice"] == "required"
    assert [t["function"]["name"] for t in allowed["tools"]] == ["c"]


def test_output_limit_sampling_effort_and_format_carry_upstream() -> None:
    model = ModelConfig(
        name="local",
        upstream="vllm",
        upstream_model="q",
        max_tokens=100,
        map_effort=True,
        params={"temperature": 0.6},
    )
    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    out = upstream(
        {
            "model": "m",
            "input": "hi",
            "max_output_tokens": 5000,
            "top_p": 0.9,
            "reasoning": {"effort": "xhigh", "summary": "auto"},
            "text": {
                "format": {
                    "type": "json_schema",
                    "name": "answer",
                    "schema": schema,
                    "strict": True,
                }
            },
        },
        model,
    )
    assert out["max_tokens"] == 100
    assert out["temperature"] == 0.6 and out["top_p"] == 0.9
    assert out["reasoning_effort"] == "high"
    assert out["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "answer", "schema": schema, "strict": True},
    }
    assert upstream({"model": "m", "input": "hi"}, model)["max_tokens"] == 100


def test_effort_none_turns_thinking_off_where_the_model_maps_it() -> None:
    model = ModelConfig(name="local", upstream="vllm", upstream_model="q", map_thinking=True)
    out = upstream({"model": "m", "input": "hi", "reasoning": {"effort": "none"}}, model)
    assert out["chat_template_kwargs"] == {"enable_thinking": False}


def test_the_session_is_the_prompt_cache_key_then_the_safety_identifier_then_user() -> None:
    assert (
        map_responses(
            {"model": "m", "input": "x", "user": "u", "prompt_cache_key": "k"}, MODEL
        ).session
        == "k"
    )
    assert (
        map_responses(
            {"model": "m", "input": "x", "user": "u", "safety_identifier": "s"}, MODEL
        ).session
        == "s"
    )
    assert map_responses({"model": "m", "input": "x", "user": "u"}, MODEL).session == "u"


def test_the_codex_request_maps() -> None:
    """Codex CLI's first request, as it sent it to a local server."""
    from pathlib import Path

    body = json.loads(
        (Path(__file__).parents[1] / "fixtures" / "codex_0.171.0_request.json").read_text()
    )
    mapped = map_responses(body, MODEL)
    out = json.loads(mapped.packed.body(model="q"))
    assert out["messages"][0]["role"] == "system"
    assert [m["role"] for m in out["messages"]].count("system") >= 1
    assert "exec_command" in [t["function"]["name"] for t in out["tools"]]
    assert mapped.session == body["prompt_cache_key"]


# The answer side.
def stream_of(
    body: dict[str, Any] | None = None, call_ids: frozenset[str] = frozenset()
) -> tuple[ResponseStream, StreamTranslator]:
    mapped = map_responses(body or {"model": "client-model", "input": "hi"}, MODEL)
    if call_ids:
        mapped = ResponsesRequest(mapped.packed, mapped.echo, mapped.names, call_ids, None)
    response = ResponseStream(mapped, response_id="resp_1", now=lambda: 1764547200.5)
    translator = StreamTranslator(model="client-model", input_tokens=3, tool_id=response.call_id)
    return response, translator


def run(
    chunks_in: list[dict[str, Any]], **kwargs: Any
) -> tuple[list[dict[str, Any]], ResponseStream]:
    response, translator = stream_of(**kwargs)
    events: list[dict[str, Any]] = []
    for c in chunks_in:
        events += response.feed(translator.feed(c))
    events += response.feed(translator.end())
    return [orjson.loads(orjson.dumps(e)) for e in events], response


def test_reasoning_text_and_a_tool_call_are_three_items_in_order() -> None:
    events, response = run(
        [
            chunk({"role": "assistant", "content": ""}),
            chunk({"reasoning": "Think"}),
            chunk({"reasoning": "ing."}),
            chunk({"content": "Hel"}),
            chunk({"content": "lo"}),
            tool_head(0, "get_weather"),
            tool_args(0, '{"city":'),
            tool_args(0, '"Paris"}'),
            chunk({}, "tool_calls"),
            usage(7, 9),
        ]
    )
    assert check_stream(events) == "response.completed"
    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    final = events[-1]["response"]
    assert final["model"] == "client-model"
    assert final["completed_at"] == 1764547200
    reasoning, message, call = final["output"]
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "Thinking."}]
    assert message["content"][0]["text"] == "Hello" and message["status"] == "completed"
    assert call["name"] == "get_weather" and call["arguments"] == '{"city":"Paris"}'
    assert call["call_id"] == "chatcmpl-tool-0"  # the upstream's own id
    assert final["usage"] == {
        "input_tokens": 7,
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": 9,
        "output_tokens_details": {"reasoning_tokens": 2},
        "total_tokens": 16,
    }
    assert orjson.loads(response.response()) == final


def test_a_call_id_the_conversation_already_used_is_replaced() -> None:
    events, _ = run(
        [tool_head(0, "f"), tool_args(0, "{}"), tool_head(1, "f"), chunk({}, "tool_calls")],
        call_ids=frozenset({"chatcmpl-tool-0"}),
    )
    ids = [e["item"]["call_id"] for e in events if e["type"] == "response.output_item.done"]
    assert ids[0].startswith("call_") and ids[1] == "chatcmpl-tool-1"


def test_a_namespaced_call_comes_back_under_its_own_name_and_namespace() -> None:
    body = {
        "model": "m",
        "input": "hi",
        "tools": [
            {"type": "namespace", "name": "ns", "tools": [{"type": "function", "name": "spawn"}]}
        ],
    }
    response, translator = stream_of(body)
    events = response.feed(translator.feed(tool_head(0, "ns__spawn")))
    events += response.feed(translator.feed(chunk({}, "tool_calls")) + translator.end())
    item = next(e["item"] for e in events if e["type"] == "response.output_item.done")
    assert (item["name"], item["namespace"]) == ("spawn", "ns")


APPLY_PATCH = {
    "type": "custom",
    "name": "apply_patch",
    "description": "Edit files.",
    "format": {"type": "grammar", "syntax": "lark", "definition": 'start: "*** Begin Patch"'},
}


def test_a_custom_tool_is_offered_as_a_function_of_its_input_and_called_back_as_one() -> None:
    """Codex's freeform `apply_patch`: offered as a function of one string, its history
    items carried as calls of it, its call answered as OpenAI answers one."""
    body = {
        "model": "m",
        "input": [
            {"role": "user", "content": "edit"},
            {
                "type": "custom_tool_call",
                "call_id": "p1",
                "name": "apply_patch",
                "input": "*** Begin Patch",
            },
            {"type": "custom_tool_call_output", "call_id": "p1", "output": "Success."},
        ],
        "tools": [APPLY_PATCH],
    }
    out = upstream(body)
    function = out["tools"][0]["function"]
    assert function["parameters"] == INPUT_SCHEMA
    assert (
        function["description"]
        == 'Edit files.\n\nThe input follows this lark grammar:\nstart: "*** Begin Patch"'
    )
    assert (
        out["messages"][1]["tool_calls"][0]["function"]["arguments"]
        == '{"input":"*** Begin Patch"}'
    )
    assert out["messages"][2] == {"role": "tool", "tool_call_id": "p1", "content": "Success."}
    response, translator = stream_of(body, call_ids=frozenset({"p1"}))
    events = response.feed(translator.feed(tool_head(0, "apply_patch")))
    events += response.feed(translator.feed(tool_args(0, '{"input": "*** Begin')))
    events += response.feed(translator.feed(tool_args(0, ' Patch\\n"}')))
    events += response.feed(translator.feed(chunk({}, "tool_calls")) + translator.end())
    kinds = [e["type"] for e in events]
    assert "response.function_call_arguments.delta" not in kinds
    done = next(e for e in events if e["type"] == "response.custom_tool_call_input.done")
    assert done["input"] == "*** Begin Patch\n"
    item = next(e["item"] for e in events if e["type"] == "response.output_item.done")
    assert (item["type"], item["name"], item["input"]) == (
        "custom_tool_call",
        "apply_patch",
        "*** Begin Patch\n",
    )
    assert item["id"].startswith("ctc_")


def test_the_output_limit_leaves_the_last_item_and_the_response_incomplete() -> None:
    events, _ = run([chunk({"content": "Hel"}), chunk({"content": "lo"}, "length")])
    assert check_stream(events) == "response.incomplete"
    final = events[-1]["response"]
    assert final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["output"][0]["status"] == "incomplete"
    done = [e for e in events if e["type"] == "response.output_item.done"]
    assert done[0]["item"]["status"] == "incomplete"


def test_an_upstream_failure_mid_stream_is_response_failed_never_completed() -> None:
    response, translator = stream_of()
    events = response.feed(translator.feed(chunk({"content": "Hel"})))
    events += response.feed(translator.feed({"error": {"message": "boom", "code": 500}}))
    events += response.feed(translator.end())
    events = [orjson.loads(orjson.dumps(e)) for e in events]
    assert check_stream(events) == "response.failed"
    final = events[-1]["response"]
    assert final["error"] == {"code": "server_error", "message": "upstream error: boom"}
    assert final["output"][0]["status"] == "incomplete"
    assert final["output"][0]["content"][0]["text"] == "Hel"


def test_a_waiting_stream_is_created_queued_then_told_its_place_then_in_progress() -> None:
    response, translator = stream_of()
    frames = response.queue_frame(3, None) + response.queue_frame(2, 4.25)
    events = [
        json.loads(line[6:]) for line in frames.decode().splitlines() if line.startswith("data: ")
    ]
    assert [e["type"] for e in events] == ["response.created", "response.queued", "response.queued"]
    assert events[0]["response"]["status"] == "queued"
    assert events[1]["queue"] == {"type": "queue", "position": 3}
    assert events[2]["queue"] == {"type": "queue", "position": 2, "estimated_wait_s": 4.2}
    events += response.begin()
    assert response.begin() == []
    events += response.feed(translator.feed(chunk({"content": "ok"}, "stop")) + translator.end())
    events = [orjson.loads(orjson.dumps(e)) for e in events]
    assert check_stream(events) == "response.completed"
    assert [e["type"] for e in events][3] == "response.in_progress"
    assert events[3]["response"]["status"] == "in_progress"


def test_a_failure_while_queued_follows_the_queue_events() -> None:
    response, _ = stream_of()
    frames = response.queue_frame(1, None)
    events = [
        json.loads(line[6:]) for line in frames.decode().splitlines() if line.startswith("data: ")
    ]
    events += [
        orjson.loads(orjson.dumps(e)) for e in response.fail("rate_limit_exceeded", "waited")
    ]
    assert check_stream(events) == "response.failed"
    assert response.fail("x", "y") == []


def test_the_response_echoes_the_request_and_validates() -> None:
    body = {
        "model": "m",
        "input": "hi",
        "instructions": "Be brief.",
        "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
        "tool_choice": {"type": "function", "name": "f"},
        "temperature": 0.2,
        "max_output_tokens": 64,
        "reasoning": {"effort": "low"},
        "text": {
            "format": {"type": "json_schema", "name": "a", "schema": {"type": "object"}},
            "verbosity": "low",
        },
        "metadata": {"trace": "t"},
        "store": True,
        "truncation": "auto",
        "prompt_cache_key": "k",
        "user": "\ud800 half an emoji",
    }
    response, _ = stream_of(body)
    document = orjson.loads(response.response())
    check_response(document)
    assert document["instructions"] == "Be brief."
    assert document["tools"] == [
        {
            "type": "function",
            "name": "f",
            "description": None,
            "parameters": {"type": "object"},
            "strict": None,
        }
    ]
    assert document["tool_choice"] == {"type": "function", "name": "f"}
    assert (document["temperature"], document["max_output_tokens"]) == (0.2, 64)
    assert document["reasoning"] == {"effort": "low", "summary": None}
    assert document["text"] == {
        "format": {
            "type": "json_schema",
            "name": "a",
            "description": None,
            "schema": None,
            "strict": False,
        },
        "verbosity": "low",
    }
    assert document["metadata"] == {"trace": "t"} and document["store"] is False
    assert document["truncation"] == "auto" and document["prompt_cache_key"] == "k"


@settings(max_examples=60, deadline=None)
@given(st.lists(chunks, max_size=20), st.booleans())
def test_any_chunk_sequence_gives_a_valid_responses_stream(
    sequence: list[dict[str, Any]], queued: bool
) -> None:
    response, translator = stream_of()
    events: list[dict[str, Any]] = []
    if queued:
        frames = response.queue_frame(1, None)
        events += [
            json.loads(line[6:])
            for line in frames.decode().splitlines()
            if line.startswith("data: ")
        ]
        events += response.begin()
    for c in sequence:
        events += response.feed(translator.feed(c))
    events += response.feed(translator.end())
    events = [orjson.loads(orjson.dumps(e)) for e in events]
    if events:
        check_stream(events)


@settings(max_examples=40, deadline=None)
@given(st.lists(upstream_frames, max_size=15), st.data())
def test_raw_upstream_bytes_split_anywhere_give_a_valid_responses_stream(
    frames: list[bytes], data: st.DataObject
) -> None:
    stream = b"".join(frames)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=8)))
    response, translator = stream_of()
    decoder = UpstreamDecoder(translator)
    events: list[dict[str, Any]] = []
    for a, b in zip([0, *cuts], [*cuts, len(stream)], strict=True):
        events += response.feed(decoder.feed(stream[a:b]))
    events += response.feed(decoder.eof("stub"))
    events = [orjson.loads(orjson.dumps(e)) for e in events]
    if events:
        check_stream(events)


def test_assistant_text_between_a_call_and_its_output_joins_the_calls_message() -> None:
    """Chat wants a call's results right after the message that made it: the gateway's own
    output (text, a call, more text) comes back in that order, and images follow all results."""
    image = "data:image/png;base64,iVBORw0KGgo="
    out = upstream(
        {
            "model": "m",
            "input": [
                {"role": "user", "content": "go"},
                {"role": "assistant", "content": "A"},
                {"type": "function_call", "call_id": "a", "name": "f", "arguments": "{}"},
                {"role": "assistant", "content": "B"},
                {"type": "function_call", "call_id": "b", "name": "f", "arguments": "{}"},
                {
                    "type": "function_call_output",
                    "call_id": "a",
                    "output": [{"type": "input_image", "image_url": image}],
                },
                {"type": "function_call_output", "call_id": "b", "output": "done"},
                {"role": "user", "content": "next"},
            ],
        }
    )
    assert [m["role"] for m in out["messages"]] == [
        "user",
        "assistant",
        "tool",
        "tool",
        "user",
        "user",
    ]
    assistant = out["messages"][1]
    assert assistant["content"] == "AB"
    assert [c["id"] for c in assistant["tool_calls"]] == ["a", "b"]
    assert out["messages"][4]["content"][0]["type"] == "image_url"


def test_past_arguments_that_are_no_json_object_go_upstream_as_one() -> None:
    """vLLM parses a past call's arguments to render them: a call cut short or a model's slip
    would fail every later turn of the conversation."""
    out = upstream(
        {
            "model": "m",
            "input": [
                {"role": "user", "content": "go"},
                {"type": "function_call", "call_id": "a", "name": "f", "arguments": '{"cmd": "ls'},
                {"type": "function_call_output", "call_id": "a", "output": "?"},
            ],
        }
    )
    arguments = out["messages"][1]["tool_calls"][0]["function"]["arguments"]
    assert json.loads(arguments) == {"unparsed_arguments": '{"cmd": "ls'}


def test_allowed_tools_names_custom_and_namespaced_tools_and_refuses_unknown_ones() -> None:
    body = {
        "model": "m",
        "input": "hi",
        "tools": [
            APPLY_PATCH,
            {"type": "function", "name": "f"},
            {"type": "namespace", "name": "ns", "tools": [{"type": "function", "name": "spawn"}]},
        ],
        "tool_choice": {
            "type": "allowed_tools",
            "mode": "required",
            "tools": [
                {"type": "custom", "name": "apply_patch"},
                {"type": "function", "name": "spawn", "namespace": "ns"},
            ],
        },
    }
    out = upstream(body)
    assert [t["function"]["name"] for t in out["tools"]] == ["apply_patch", "ns__spawn"]
    assert out["tool_choice"] == "required"
    response, _ = stream_of(body)
    assert orjson.loads(response.response())["tool_choice"] == {
        "type": "allowed_tools",
        "mode": "required",
        "tools": [
            {"type": "function", "name": "apply_patch"},
            {"type": "function", "name": "ns__spawn"},
        ],
    }
    body["tool_choice"]["tools"] = [{"type": "function", "name": "ghost"}]
    assert refusal(body).param == "tool_choice.tools.0.name"


def test_the_models_cap_applies_to_a_limit_its_params_set_and_the_echo_says_it() -> None:
    model = ModelConfig(
        name="local",
        upstream="vllm",
        upstream_model="q",
        max_tokens=100,
        params={"max_completion_tokens": 5000},
    )
    mapped = map_responses({"model": "m", "input": "hi", "max_output_tokens": 4000}, model)
    out = json.loads(mapped.packed.body(model="q"))
    assert (out["max_tokens"], out["max_completion_tokens"]) == (100, 100)
    assert json.loads(mapped.echo)["max_output_tokens"] == 100


def test_a_call_the_output_limit_cut_is_never_given_done() -> None:
    """Its arguments are half a JSON text, and Codex runs every call it gets done."""
    events, _ = run(
        [
            chunk({"content": "Let me"}),
            tool_head(0, "f"),
            tool_args(0, '{"cmd": "l'),
            chunk({}, "length"),
        ]
    )
    assert check_stream(events) == "response.incomplete"
    kinds = [e["type"] for e in events]
    assert kinds.count("response.output_item.done") == 1  # the message's, not the call's
    assert "response.function_call_arguments.done" not in kinds
    call = events[-1]["response"]["output"][-1]
    assert (call["type"], call["status"]) == ("function_call", "incomplete")


def test_an_upstream_tool_id_with_a_lone_surrogate_is_made_whole() -> None:
    response, translator = stream_of()
    head = tool_head(0, "f")
    head["choices"][0]["delta"]["tool_calls"][0]["id"] = "\ud800x"
    events = response.feed(
        translator.feed(head) + translator.feed(chunk({}, "tool_calls")) + translator.end()
    )
    encoded = b"".join(encode_event(e) for e in events)  # orjson refuses a lone surrogate
    assert "\ufffdx".encode() in encoded


def test_minimal_effort_is_echoed_as_the_low_it_runs_as() -> None:
    response, _ = stream_of({"model": "m", "input": "hi", "reasoning": {"effort": "minimal"}})
    document = orjson.loads(response.response())
    check_response(document)
    assert document["reasoning"] == {"effort": "low", "summary": None}


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=6),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=8,
)
FIELDS = [
    "input",
    "instructions",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "max_output_tokens",
    "temperature",
    "top_p",
    "reasoning",
    "text",
    "metadata",
    "stream",
    "user",
    "prompt_cache_key",
    "truncation",
    "service_tier",
    "max_tool_calls",
    "top_logprobs",
    "background",
    "store",
]
CODEX_LIKE = {
    "model": "m",
    "input": [
        {
            "type": "message",
            "role": "developer",
            "content": [{"type": "input_text", "text": "sys"}],
        },
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]},
        {"type": "function_call", "call_id": "c", "name": "exec_command", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c", "output": "ok"},
    ],
    "tools": [
        {"type": "function", "name": "exec_command", "parameters": {"type": "object"}},
        APPLY_PATCH,
    ],
    "tool_choice": "auto",
    "reasoning": {"effort": "low", "summary": "auto"},
    "text": {"format": {"type": "text"}},
}


def _paths(value: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [path]
    if isinstance(value, dict):
        for key, item in value.items():
            out += _paths(item, (*path, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            out += _paths(item, (*path, index))
    return out


@settings(max_examples=300, deadline=None)
@given(st.data(), json_values)
def test_any_value_anywhere_is_mapped_or_refused_naming_a_field(
    data: st.DataObject, value: Any
) -> None:
    """Every odd value in every place of a Codex-like body, and in each top-level field: a
    mapped request whose echo encodes, or an InvalidRequest, never another exception."""
    import copy

    body = copy.deepcopy(CODEX_LIKE)
    places = [p for p in _paths(body)[1:] if p != ("model",)]  # the surface checks the model
    path = data.draw(st.sampled_from(places + [(name,) for name in FIELDS]))
    target = body
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    try:
        mapped = map_responses(body, MODEL)
    except InvalidRequest as e:
        assert e.param, e
        return
    orjson.loads(mapped.echo)
    mapped.packed.body(model="q")
