"""Anthropic request -> OpenAI request: every mapped field, and 400s that name the field."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from homelab_gateway.config import ConfigError, ModelConfig, parse_config
from homelab_gateway.core.fields import InvalidRequest
from homelab_gateway.core.instructions import marked
from homelab_gateway.core.mapping import find_model, map_request

MODEL = ModelConfig(name="reasoning", upstream="vllm", upstream_model="Qwen/QwQ-32B")


def mapped(model: ModelConfig = MODEL, **body: Any) -> dict[str, Any]:
    request = {
        "model": "reasoning",
        "max_tokens": 100,
        "messages": [{"role": "user", "content": "hi"}],
        **body,
    }
    return map_request(request, model).body


def rejected(**body: Any) -> str:
    request = {
        "model": "reasoning",
        "max_tokens": 100,
        "messages": [{"role": "user", "content": "hi"}],
        **body,
    }
    with pytest.raises(InvalidRequest) as info:
        map_request(request, MODEL)
    return str(info.value)


def test_minimal_request() -> None:
    body = mapped()
    assert body == {
        "model": "Qwen/QwQ-32B",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 100,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }


def test_continuous_usage_stats_can_be_left_out_for_strict_upstreams() -> None:
    request = {
        "model": "reasoning",
        "max_tokens": 1,
        "messages": [{"role": "user", "content": "x"}],
    }
    assert map_request(request, MODEL, continuous_usage_stats=False).body["stream_options"] == {
        "include_usage": True
    }


def test_system_string_and_blocks_with_cache_control() -> None:
    assert mapped(system="be brief")["messages"][0] == {"role": "system", "content": "be brief"}
    blocks = [
        {"type": "text", "text": "a", "cache_control": {"type": "ephemeral"}},
        {"type": "text", "text": "b"},
    ]
    assert mapped(system=blocks)["messages"][0] == {"role": "system", "content": "a\n\nb"}


def test_a_system_role_inside_messages_is_folded_into_the_user_turn_beside_it() -> None:
    """Qwen3.5's and the Llama, Gemma and Mistral templates refuse a system message in place:
    its text goes into the user turn before it, marked, and the leading system stays first."""
    messages = [
        {"role": "user", "content": "a"},
        {"role": "system", "content": [{"type": "text", "text": "rule"}]},
        {"role": "assistant", "content": "ok"},
        {"role": "system", "content": "next"},
        {"role": "user", "content": "b"},
    ]
    assert mapped(system="s", messages=messages)["messages"] == [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "a\n\n" + marked("rule")},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": marked("next") + "\n\nb"},
    ]


def test_a_system_role_between_a_tool_call_and_its_result_follows_the_result() -> None:
    call = {"type": "tool_use", "id": "t1", "name": "f", "input": {}}
    result = {"type": "tool_result", "tool_use_id": "t1", "content": "done"}
    messages = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": [call]},
        {"role": "system", "content": "mind the time"},
        {"role": "user", "content": [result]},
    ]
    out = mapped(messages=messages)["messages"]
    assert [m["role"] for m in out] == ["user", "assistant", "tool"]
    assert out[2]["content"] == "done\n\n" + marked("mind the time")


def test_user_blocks_text_and_images() -> None:
    content = [
        {"type": "text", "text": "look", "cache_control": {"type": "ephemeral"}},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "aGk="}},
        {"type": "image", "source": {"type": "url", "url": "https://example.org/a.png"}},
    ]
    assert mapped(messages=[{"role": "user", "content": content}])["messages"] == [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "look"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,aGk="}},
                {"type": "image_url", "image_url": {"url": "https://example.org/a.png"}},
            ],
        }
    ]


def test_text_only_blocks_become_one_string() -> None:
    content = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert mapped(messages=[{"role": "user", "content": content}])["messages"] == [
        {"role": "user", "content": "ab"}
    ]


TOOL_TURN = [
    {"role": "user", "content": "weather?"},
    {
        "role": "assistant",
        "content": [
            {"type": "thinking", "thinking": "need tool", "signature": "sig"},
            {"type": "redacted_thinking", "data": "xx"},
            {"type": "text", "text": "Checking."},
            {
                "type": "tool_use",
                "id": "toolu_1",
                "name": "get_weather",
                "input": {"city": "Paris"},
            },
        ],
    },
    {
        "role": "user",
        "content": [
            {
                "type": "tool_result",
                "tool_use_id": "toolu_1",
                "content": [{"type": "text", "text": "18C"}],
            },
            {"type": "text", "text": "thanks"},
        ],
    },
]


def test_tool_use_and_tool_result_round_trip() -> None:
    messages = mapped(messages=TOOL_TURN)["messages"]
    assert messages[1] == {
        "role": "assistant",
        "content": "Checking.",
        "tool_calls": [
            {
                "id": "toolu_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            },
        ],
    }
    assert messages[2] == {"role": "tool", "tool_call_id": "toolu_1", "content": "18C"}
    assert messages[3] == {"role": "user", "content": "thanks"}


def test_thinking_blocks_are_not_sent_back_as_text() -> None:
    assert "need tool" not in json.dumps(mapped(messages=TOOL_TURN))


def test_tool_result_error_string_content_and_images() -> None:
    turn = [
        *TOOL_TURN[:2],
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": "toolu_1",
                    "is_error": True,
                    "content": "failed",
                },
            ],
        },
    ]
    assert mapped(messages=turn)["messages"][2] == {
        "role": "tool",
        "tool_call_id": "toolu_1",
        "content": "failed",
    }
    image = {
        "type": "image",
        "source": {"type": "base64", "media_type": "image/jpeg", "data": "aGk="},
    }
    turn[2] = {
        "role": "user",
        "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": [image]}],
    }
    out = mapped(messages=turn)["messages"]
    assert out[2]["role"] == "tool" and out[3]["role"] == "user"
    assert out[3]["content"][0]["type"] == "image_url"


def test_tool_result_without_a_matching_tool_use_is_a_bad_role_order() -> None:
    message = rejected(
        messages=[
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "toolu_9", "content": "x"}],
            }
        ]
    )
    assert message.startswith("messages.0.content.0.tool_use_id:")


def test_tools_and_tool_choice() -> None:
    tools = [
        {
            "name": "f",
            "description": "does f",
            "input_schema": {"type": "object"},
            "cache_control": {"type": "ephemeral"},
        }
    ]
    body = mapped(tools=tools, tool_choice={"type": "any", "disable_parallel_tool_use": True})
    assert body["tools"] == [
        {
            "type": "function",
            "function": {"name": "f", "parameters": {"type": "object"}, "description": "does f"},
        }
    ]
    assert body["tool_choice"] == "required" and body["parallel_tool_calls"] is False
    assert mapped(tool_choice={"type": "auto"})["tool_choice"] == "auto"
    assert mapped(tool_choice={"type": "none"})["tool_choice"] == "none"
    assert mapped(tool_choice={"type": "tool", "name": "f"})["tool_choice"] == {
        "type": "function",
        "function": {"name": "f"},
    }


def test_sampling_stop_and_user() -> None:
    body = mapped(
        temperature=0.2,
        top_p=0.9,
        top_k=20,
        stop_sequences=["END"],
        metadata={"user_id": '{"device":"x"}'},
    )
    assert (body["temperature"], body["top_p"], body["top_k"], body["stop"], body["user"]) == (
        0.2,
        0.9,
        20,
        ["END"],
        '{"device":"x"}',
    )


def test_max_tokens_is_clamped_to_the_model_limit() -> None:
    limited = ModelConfig(name="r", upstream="v", upstream_model="m", max_tokens=4096)
    assert mapped(limited, max_tokens=32000)["max_tokens"] == 4096
    assert mapped(limited, max_tokens=100)["max_tokens"] == 100


def test_config_params_merge_under_the_clients_fields() -> None:
    model = ModelConfig(
        name="r",
        upstream="v",
        upstream_model="m",
        map_thinking=True,
        params={
            "top_k": 20,
            "temperature": 0.6,
            "chat_template_kwargs": {"enable_thinking": True, "x": 1},
        },
    )
    body = mapped(model, temperature=0.1, thinking={"type": "disabled"})
    assert body["top_k"] == 20 and body["temperature"] == 0.1
    assert body["chat_template_kwargs"] == {"enable_thinking": False, "x": 1}


def test_thinking_and_effort_map_only_where_the_model_says_so() -> None:
    assert "chat_template_kwargs" not in mapped(thinking={"type": "enabled", "budget_tokens": 1024})
    model = ModelConfig(
        name="r", upstream="v", upstream_model="m", map_thinking=True, map_effort=True
    )
    body = mapped(
        model, thinking={"type": "adaptive", "display": "omitted"}, output_config={"effort": "max"}
    )
    assert (
        body["chat_template_kwargs"] == {"enable_thinking": True}
        and body["reasoning_effort"] == "high"
    )


def test_what_claude_code_sends_is_accepted() -> None:
    body = {
        "model": "reasoning",
        "max_tokens": 32000,
        "stream": True,
        "system": [
            {"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}}
        ],
        "messages": [
            {
                "role": "user",
                "content": [{"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}],
            }
        ],
        "thinking": {"type": "adaptive", "display": "omitted"},
        "output_config": {"effort": "high"},
        "context_management": {"edits": []},
        "metadata": {"user_id": '{"session":"abc"}'},
        "tools": [
            {"name": f"tool{i}", "description": "d", "input_schema": {"type": "object"}}
            for i in range(12)
        ],
        "betas": ["x"],
        "anthropic_beta": "y",
    }
    out = map_request(body, MODEL)
    assert out.stream and len(out.body["tools"]) == 12 and out.body["user"] == '{"session":"abc"}'


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"max_tokens": "100"}, "max_tokens:"),
        ({"max_tokens": 0}, "max_tokens:"),
        ({"max_tokens": True}, "max_tokens:"),
        ({"messages": []}, "messages:"),
        ({"messages": "hi"}, "messages:"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role:"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content:"),
        (
            {"messages": [{"role": "user", "content": [{"type": "video"}]}]},
            "messages.0.content.0.type:",
        ),
        (
            {"messages": [{"role": "user", "content": [{"text": "no type"}]}]},
            "messages.0.content.0.type:",
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "image",
                                "source": {
                                    "type": "base64",
                                    "media_type": "image/png",
                                    "data": "!!",
                                },
                            }
                        ],
                    }
                ]
            },
            "messages.0.content.0.source.data:",
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "image",
                                "source": {
                                    "type": "base64",
                                    "media_type": "text/html",
                                    "data": "aGk=",
                                },
                            }
                        ],
                    }
                ]
            },
            "messages.0.content.0.source.media_type:",
        ),
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "content": [{"type": "tool_use", "id": "t", "name": "f", "input": []}],
                    }
                ]
            },
            "messages.0.content.0.input:",
        ),
        ({"stream": "yes"}, "stream:"),
        ({"temperature": "hot"}, "temperature:"),
        ({"stop_sequences": "END"}, "stop_sequences:"),
        ({"tools": [{"name": "f"}]}, "tools.0.input_schema:"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0.type:"),
        ({"tool_choice": {"type": "sometimes"}}, "tool_choice.type:"),
        ({"thinking": {"type": "maybe"}}, "thinking.type:"),
        ({"output_config": {"effort": "extreme"}}, "output_config.effort:"),
        ({"metadata": {"user_id": 5}}, "metadata.user_id:"),
        ({"system": 5}, "system:"),
    ],
)
def test_bad_fields_are_named(body: dict[str, Any], field: str) -> None:
    assert rejected(**body).startswith(field)


def test_count_only_does_not_need_max_tokens() -> None:
    request = {"model": "reasoning", "messages": [{"role": "user", "content": "hi"}]}
    assert "max_tokens" not in map_request(request, MODEL, count_only=True).body
    with pytest.raises(InvalidRequest):
        map_request(request, MODEL)


def test_estimate_grows_with_the_prompt() -> None:
    short = map_request(
        {"model": "r", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}, MODEL
    )
    long = map_request(
        {"model": "r", "max_tokens": 1, "messages": [{"role": "user", "content": "hi " * 400}]},
        MODEL,
    )
    assert 0 < short.estimated_input_tokens < long.estimated_input_tokens


def test_a_recorded_claude_code_request_maps() -> None:
    """Claude Code 2.1.197's real request (texts scrubbed): betas, context_management, effort,
    adaptive thinking, a system message inside messages, 24 tools."""
    fixture = Path(__file__).parent.parent / "fixtures" / "claude_code_2.1.197_request.json"
    body = json.loads(fixture.read_text())
    model = ModelConfig(
        name="reasoning",
        upstream="v",
        upstream_model="m",
        max_tokens=8192,
        map_thinking=True,
        map_effort=True,
    )
    out = map_request(body, model)
    assert out.stream and out.body["max_tokens"] == 8192
    assert [m["role"] for m in out.body["messages"]] == ["system", "user"]
    assert out.body["messages"][1]["content"].endswith(marked(body["messages"][1]["content"]))
    assert len(out.body["tools"]) == len(body["tools"]) == 24
    assert out.body["chat_template_kwargs"] == {"enable_thinking": True}
    assert out.body["reasoning_effort"] == "high"


# Claude Code's attribution line, as its versions send it: a per-prompt suffix, and a `cch=`
# value that changes on every request in others.
BILLING_HEADERS = [
    "x-anthropic-billing-header: cc_version=2.1.328.ce7; cc_entrypoint=sdk-cli;",
    "x-anthropic-billing-header: cc_version=2.1.328.27f; cc_entrypoint=cli;",
    "x-anthropic-billing-header: cc_version=2.1.77.a1b; cc_entrypoint=cli; cch=4f9e2;",
]
CLAUDE_CODE_SYSTEM = "You are Claude Code, Anthropic's official CLI for Claude."


@pytest.mark.parametrize("header", BILLING_HEADERS)
def test_the_billing_header_block_is_dropped_and_nothing_else(header: str) -> None:
    blocks = [
        {"type": "text", "text": header},
        {"type": "text", "text": CLAUDE_CODE_SYSTEM, "cache_control": {"type": "ephemeral"}},
        {"type": "text", "text": "Mentions x-anthropic-billing-header: mid-text, kept."},
    ]
    system = mapped(system=blocks)["messages"][0]
    assert system == {
        "role": "system",
        "content": CLAUDE_CODE_SYSTEM + "\n\nMentions x-anthropic-billing-header: mid-text, kept.",
    }


@pytest.mark.parametrize("header", BILLING_HEADERS)
def test_the_billing_header_line_leaves_the_rest_of_its_block_as_vllm_does(header: str) -> None:
    assert mapped(system=header + "\nline two")["messages"][0]["content"] == "line two"
    only = mapped(system=[{"type": "text", "text": header}])["messages"]
    assert only == [{"role": "user", "content": "hi"}]  # no empty system message
    inside = [{"role": "system", "content": header}, {"role": "user", "content": "hi"}]
    assert mapped(messages=inside)["messages"] == [{"role": "user", "content": "hi"}]


def test_the_billing_header_is_kept_when_the_model_says_so() -> None:
    model = ModelConfig(name="m", upstream="u", upstream_model="m", strip_billing_header=False)
    blocks = [{"type": "text", "text": BILLING_HEADERS[0]}, {"type": "text", "text": "rest"}]
    assert mapped(model, system=blocks)["messages"][0]["content"] == BILLING_HEADERS[0] + "\n\nrest"


def test_an_empty_messages_array_is_named_as_empty() -> None:
    assert rejected(messages=[]) == "messages: must be a non-empty array, got an empty array"
    assert rejected(messages="x") == "messages: must be a non-empty array, got 'x'"


SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
    "additionalProperties": False,
}


def test_structured_output_maps_to_a_json_schema_response_format() -> None:
    expected = {
        "type": "json_schema",
        "json_schema": {"name": "output", "schema": SCHEMA, "strict": True},
    }
    output_format = {"type": "json_schema", "schema": SCHEMA}
    assert mapped(output_config={"format": output_format})["response_format"] == expected
    assert mapped(output_format=output_format)["response_format"] == expected
    both = mapped(output_config={"format": output_format}, output_format=output_format)
    assert both["response_format"] == expected
    assert "response_format" not in mapped(output_config={"effort": "low"})


def test_structured_output_that_cannot_be_carried_is_a_400_naming_the_field() -> None:
    assert rejected(output_config={"format": {"type": "text"}}) == (
        "output_config.format.type: only 'json_schema' can be carried upstream, got 'text'"
    )
    assert rejected(output_format={"type": "json_schema"}) == (
        "output_format.schema: must be a non-empty object, got nothing"
    )
    assert rejected(output_config={"format": "json"}) == (
        "output_config.format: must be an object, got 'json'"
    )
    assert (
        rejected(
            output_config={"format": {"type": "json_schema", "schema": SCHEMA, "strict": False}}
        )
        == "output_config.format.strict: cannot be carried to the upstream"
    )
    assert (
        rejected(
            output_config={"format": {"type": "json_schema", "schema": SCHEMA}},
            output_format={"type": "json_schema", "schema": {"type": "object"}},
        )
        == "output_format: differs from output_config.format; send one of them"
    )


def test_show_reasoning_follows_the_model_option_and_the_request() -> None:
    strict = ModelConfig(
        name="m", upstream="u", upstream_model="m", show_reasoning="when_requested"
    )

    def shows(model: ModelConfig, **body: Any) -> bool:
        request = {"model": "m", "max_tokens": 9, "messages": [{"role": "user", "content": "x"}]}
        return map_request({**request, **body}, model).show_reasoning

    assert shows(MODEL) and shows(MODEL, thinking={"type": "disabled"})
    assert not shows(strict) and not shows(strict, thinking={"type": "disabled"})
    assert shows(strict, thinking={"type": "enabled", "budget_tokens": 1024})
    assert shows(strict, thinking={"type": "adaptive"})


def models(**tables: dict[str, Any]) -> dict[str, ModelConfig]:
    document = {"upstreams": {"u": {"url": "http://x/v1", "slots": 1}}, "models": tables}
    return dict(parse_config(document, environ={}).models)


def test_the_claude_code_model_keys_and_their_defaults() -> None:
    plain = models(m={"upstream": "u"})["m"]
    assert (plain.strip_billing_header, plain.show_reasoning, plain.context_window) == (
        True,
        "always",
        None,
    )
    set_ = models(
        m={
            "upstream": "u",
            "strip_billing_header": False,
            "show_reasoning": "when_requested",
            "context_window": 32768,
        }
    )["m"]
    assert (set_.strip_billing_header, set_.show_reasoning, set_.context_window) == (
        False,
        "when_requested",
        32768,
    )


@pytest.mark.parametrize(
    ("table", "expected"),
    [
        ({"show_reasoning": "never"}, "models.m.show_reasoning: must be 'always' or"),
        ({"strip_billing_header": "yes"}, "models.m.strip_billing_header: must be true or false"),
        ({"context_window": 0}, "models.m.context_window: must be an integer >= 1"),
    ],
)
def test_mistakes_in_the_claude_code_model_keys_name_the_key(
    table: dict[str, Any], expected: str
) -> None:
    with pytest.raises(ConfigError) as info:
        models(m={"upstream": "u", **table})
    assert expected in str(info.value)


def test_a_name_pattern_must_say_its_upstream_model() -> None:
    with pytest.raises(ConfigError) as info:
        models(**{"claude-*": {"upstream": "u"}})
    assert 'models."claude-*".upstream_model: is required for a name pattern' in str(info.value)


def test_exact_names_win_then_the_most_specific_pattern_then_file_order() -> None:
    configured = models(
        **{
            "claude-*": {"upstream": "u", "upstream_model": "big"},
            "claude-*haiku*": {"upstream": "u", "upstream_model": "small"},
            "claude-opus-4-1": {"upstream": "u", "upstream_model": "exact"},
            "*-4-1": {"upstream": "u", "upstream_model": "late"},
            "c?aude-x*": {"upstream": "u", "upstream_model": "first"},
            "claude-x*": {"upstream": "u", "upstream_model": "second"},
        }
    )

    def upstream_model(name: str) -> str | None:
        found = find_model(configured, name)
        return found.upstream_model if found is not None else None

    assert upstream_model("claude-haiku-4-5-20251001") == "small"
    assert upstream_model("claude-3-5-haiku-latest") == "small"
    assert upstream_model("claude-sonnet-4-5-20250929") == "big"
    assert upstream_model("claude-opus-4-1") == "exact"  # exact beats every pattern
    assert upstream_model("claude-opus-4-5") == "big"
    assert upstream_model("claude-x1") == "second"  # 8 literal characters beat 7
    assert upstream_model("Claude-sonnet") is None  # case-sensitive, like model names
    assert upstream_model("gpt-4") is None
    assert upstream_model("claude-*") == "big"  # the pattern's own text is only a name it matches


system_texts = st.lists(
    st.one_of(
        st.text(max_size=30),
        st.sampled_from(BILLING_HEADERS),
        st.builds(lambda h, rest: h + "\n" + rest, st.sampled_from(BILLING_HEADERS), st.text()),
    ),
    max_size=5,
)


@given(system_texts)
def test_stripping_changes_nothing_but_the_header_lines(texts: list[str]) -> None:
    kept = ModelConfig(name="m", upstream="u", upstream_model="m", strip_billing_header=False)
    blocks = [{"type": "text", "text": text} for text in texts]
    stripped = mapped(system=blocks)["messages"]
    as_sent = mapped(kept, system=blocks)["messages"]
    expected = [
        text.partition("\n")[2] if text.startswith("x-anthropic-billing-header") else text
        for text in texts
    ]
    left = [
        text
        for text, original in zip(expected, texts, strict=True)
        if text or not original.startswith("x-anthropic-billing-header")
    ]
    if left or not texts:
        assert stripped[0] == {"role": "system", "content": "\n\n".join(left)}
    else:
        assert stripped[0]["role"] == "user"  # nothing but headers: no system message at all
    assert as_sent[0] == {"role": "system", "content": "\n\n".join(texts)}
    assert stripped[-1] == as_sent[-1]


def packed_body(body: dict[str, Any], **fields: Any) -> dict[str, Any]:
    return json.loads(map_request(body, MODEL).packed().body(**fields))


def test_a_packed_request_is_the_mapped_body_with_each_attempts_fields() -> None:
    body = {"model": "reasoning", "max_tokens": 5, "messages": [{"role": "user", "content": "é"}]}
    mapped = map_request(body, MODEL)
    packed = mapped.packed()
    assert isinstance(packed.json, bytes) and b'"model"' not in packed.json
    sent = packed.body(model="on-this-box", priority=-1)
    assert sent.startswith(b'{"model":"on-this-box","priority":-1,')
    assert json.loads(sent) == {**mapped.body, "model": "on-this-box", "priority": -1}
    assert "é".encode() in sent  # UTF-8, not \\u escapes: a waiter keeps the body's own size
    assert (packed.model, packed.stream) == (mapped.model, mapped.stream)


def test_a_packed_request_keeps_a_params_priority_unless_the_attempt_sets_one() -> None:
    model = ModelConfig(name="m", upstream="vllm", upstream_model="m", params={"priority": 5})
    body = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
    packed = map_request(body, model).packed()
    assert json.loads(packed.body(model="x"))["priority"] == 5
    assert json.loads(packed.body(model="x", priority=1))["priority"] == 1


@given(st.text(), st.integers(min_value=-(2**70), max_value=2**70))
def test_a_packed_request_writes_whatever_the_client_sent(text: str, number: int) -> None:
    """orjson refuses a lone surrogate (`\\ud83d` in the JSON) and integers past 64 bits, which
    Python's json takes from a client: the body still goes upstream as the client wrote it."""
    tools = [{"name": "t", "input_schema": {"type": "object", "maximum": number}}]
    body = {"model": "reasoning", "max_tokens": 5, "messages": [{"role": "user", "content": text}]}
    sent = packed_body({**body, "tools": tools}, model="x")
    assert sent["messages"] == [{"role": "user", "content": text}]
    assert sent["tools"][0]["function"]["parameters"]["maximum"] == number


def test_a_stop_sequence_cannot_hold_a_lone_surrogate() -> None:
    """A matched stop sequence goes back to the client in the answer, whose UTF-8 cannot carry
    half a surrogate pair (`\\udc00` in the request's JSON): a 400 naming it."""
    body = {"model": "reasoning", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
    with pytest.raises(InvalidRequest, match=r"^stop_sequences\.1: holds a lone surrogate"):
        map_request({**body, "stop_sequences": ["END", "\udc00"]}, MODEL)


def test_the_model_name_echoed_has_no_lone_surrogate() -> None:
    """A name a pattern takes (`claude-*`) may hold one: the answer's `model` has U+FFFD there."""
    body = {
        "model": "claude-\ud800",
        "max_tokens": 5,
        "messages": [{"role": "user", "content": "hi"}],
    }
    assert map_request(body, MODEL).model == "claude-\ufffd"
