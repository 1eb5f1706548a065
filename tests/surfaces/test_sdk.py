"""The official `anthropic` Python SDK against the real daemon and stub, both run by twistd."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import anthropic
import pytest

from testsupport.processes import start_gateway, start_stub, upstream_status, wait_until

WEATHER = [
    {
        "name": "get_weather",
        "description": "Weather for a city",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
    }
]


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[anthropic.Anthropic]:
    cwd = tmp_path_factory.mktemp("sdk")
    fast, fast_url = start_stub(cwd, "--delay", "0.002", "--reasoning-field", "reasoning_content")
    slow, slow_url = start_stub(
        cwd, "--hold", "3", "--reasoning-tokens", "2", "--content-tokens", "3"
    )
    # vLLM with a 64-token window and --enable-prompt-tokens-details
    tight, tight_url = start_stub(
        cwd, "--max-model-len", "64", "--enable-prompt-tokens-details", "--model", "tight"
    )
    config = f"""
[upstreams.fast]
url = "{fast_url}"
slots = 4

[upstreams.slow]
url = "{slow_url}"
slots = 1

[models.reasoning]
upstream = "fast"
upstream_model = "Qwen/QwQ-32B"

[models.slow]
upstream = "slow"

[upstreams.tight]
url = "{tight_url}"
slots = 1

[models."claude-*"]
upstream = "tight"
upstream_model = "tight"
"""
    gateway, url = start_gateway(cwd, config)
    yield anthropic.Anthropic(base_url=url + "/llm", api_key="unused", max_retries=0, timeout=30)
    for process in (gateway, fast, slow, tight):
        process.stop()


def test_stream_thinking_then_text(client: anthropic.Anthropic) -> None:
    with client.messages.stream(
        model="reasoning", max_tokens=64, messages=[{"role": "user", "content": "hi"}]
    ) as stream:
        text = "".join(stream.text_stream)
        message = stream.get_final_message()
    assert [block.type for block in message.content] == ["thinking", "text"]
    assert message.content[1].text == text and text
    assert message.content[0].thinking
    assert message.stop_reason == "end_turn" and message.model == "reasoning"
    assert message.usage.input_tokens == 5 and message.usage.output_tokens == 16


def test_stream_content_only_and_reasoning_only(client: anthropic.Anthropic) -> None:
    with client.messages.stream(
        model="reasoning", max_tokens=64, messages=[{"role": "user", "content": "content-only"}]
    ) as stream:
        message = stream.get_final_message()
    assert [block.type for block in message.content] == ["text"]
    with client.messages.stream(
        model="reasoning", max_tokens=10, messages=[{"role": "user", "content": "reasoning-only"}]
    ) as stream:
        message = stream.get_final_message()
    assert [block.type for block in message.content] == ["thinking"]
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 10


def test_stream_tool_use(client: anthropic.Anthropic) -> None:
    with client.messages.stream(
        model="reasoning",
        max_tokens=64,
        tools=WEATHER,
        messages=[{"role": "user", "content": "tool"}],
    ) as stream:
        message = stream.get_final_message()
    tool = message.content[-1]
    assert tool.type == "tool_use" and tool.name == "get_weather"
    assert tool.input == {"city": "Paris", "unit": "celsius"} and tool.id.startswith("toolu_")
    assert message.stop_reason == "tool_use"


def test_create_without_streaming(client: anthropic.Anthropic) -> None:
    message = client.messages.create(
        model="reasoning", max_tokens=64, messages=[{"role": "user", "content": "hi"}]
    )
    assert [block.type for block in message.content] == ["thinking", "text"]
    assert message.stop_reason == "end_turn" and message.usage.output_tokens == 16


def test_tool_round_trip(client: anthropic.Anthropic) -> None:
    first = client.messages.create(
        model="reasoning",
        max_tokens=64,
        tools=WEATHER,
        messages=[{"role": "user", "content": "tool"}],
    )
    call = first.content[-1]
    second = client.messages.create(
        model="reasoning",
        max_tokens=64,
        tools=WEATHER,
        messages=[
            {"role": "user", "content": "tool"},
            {"role": "assistant", "content": first.content},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "18C"}],
            },
        ],
    )
    assert second.stop_reason in ("end_turn", "tool_use")


def test_upstream_failure_mid_stream_raises(client: anthropic.Anthropic) -> None:
    with (
        pytest.raises(anthropic.APIStatusError) as info,
        client.messages.stream(
            model="reasoning", max_tokens=64, messages=[{"role": "user", "content": "fail"}]
        ) as stream,
    ):
        stream.get_final_message()
    assert "engine died" in str(info.value)


def test_client_errors_are_anthropic_errors(client: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(
            model="ghost", max_tokens=5, messages=[{"role": "user", "content": "hi"}]
        )
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(
            model="reasoning", max_tokens=5, messages=[{"role": "robot", "content": "hi"}]
        )
    assert "messages.0.role" in str(info.value)


def test_a_queued_stream_gives_the_correct_final_message(client: anthropic.Anthropic) -> None:
    gateway = str(client.base_url).removesuffix("/").removesuffix("/llm")
    ahead = threading.Thread(
        target=lambda: client.messages.create(
            model="slow", max_tokens=8, messages=[{"role": "user", "content": "hi"}]
        )
    )
    ahead.start()
    try:
        # The request ahead must hold the only slot before the stream is sent, or the two race
        # for it. The slow stub holds its first token 3 s, far longer than this takes.
        wait_until(lambda: upstream_status(gateway, "slow")["in_use"] == 1)
        seen: list[str] = []
        with client.messages.stream(
            model="slow", max_tokens=8, messages=[{"role": "user", "content": "hi"}]
        ) as stream:
            seen.extend(event.type for event in stream)
            message = stream.get_final_message()
    finally:
        ahead.join(30)
    assert "queue" in seen and seen.index("queue") < seen.index("message_start")
    assert [block.type for block in message.content] == ["thinking", "text"]
    assert message.stop_reason == "end_turn"


def test_models_and_count_tokens(client: anthropic.Anthropic) -> None:
    assert sorted(model.id for model in client.models.list()) == ["reasoning", "slow"]
    # a pattern's name, with the window vLLM reports (once the first /models probe is in)
    wait_until(lambda: client.models.retrieve("claude-haiku-4-5").max_input_tokens == 64)
    model = client.models.retrieve("claude-haiku-4-5")
    assert (model.id, model.type, model.display_name) == ("claude-haiku-4-5", "model", model.id)
    count = client.messages.count_tokens(
        model="reasoning", messages=[{"role": "user", "content": "a b c"}]
    )
    assert count.input_tokens == 3 + 4


def test_context_overflow_is_anthropics_wording_with_the_numbers(
    client: anthropic.Anthropic,
) -> None:
    words = " ".join(["word"] * 100)
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(
            model="claude-local-sonnet", max_tokens=8, messages=[{"role": "user", "content": words}]
        )
    assert info.value.body["error"] == {  # type: ignore[index]
        "type": "invalid_request_error",
        "message": "prompt is too long: 104 tokens > 64 maximum",
    }
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(
            model="claude-local-sonnet",
            max_tokens=60,
            messages=[{"role": "user", "content": "a b"}],
        )
    assert "input length and `max_tokens` exceed context limit: 6 + 60 > 64" in str(info.value)


def test_signature_and_cache_usage_as_the_sdk_types_have_them(client: anthropic.Anthropic) -> None:
    system = [
        {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.328.ce7; cch=1;"},
        {"type": "text", "text": " ".join(["rule"] * 28)},
    ]
    for turn in ("one", "two"):
        with client.messages.stream(
            model="claude-haiku-4-5",
            max_tokens=16,
            system=system,  # type: ignore[arg-type]
            messages=[{"role": "user", "content": turn}],
        ) as stream:
            kinds = [
                (event.type, getattr(getattr(event, "delta", None), "type", None))
                for event in stream
            ]
            message = stream.get_final_message()
        system[0]["text"] = system[0]["text"].replace("cch=1", "cch=2")
    assert ("content_block_delta", "signature_delta") in kinds
    assert message.content[0].type == "thinking" and message.content[0].signature == ""
    # the system prompt (1 + 28 + 3 tokens) is whole 16-token blocks of the prefix cache
    usage = message.usage
    assert (usage.cache_read_input_tokens, usage.cache_creation_input_tokens) == (32, 0)
    assert usage.input_tokens == 37 - 32  # the user turn: a word and 4
    assert message.model == "claude-haiku-4-5"


def test_structured_output_reaches_the_upstream_or_is_refused_by_name(
    client: anthropic.Anthropic,
) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string"}}}
    message = client.messages.create(
        model="reasoning",
        max_tokens=16,
        messages=[{"role": "user", "content": "hi"}],
        extra_body={"output_config": {"format": {"type": "json_schema", "schema": schema}}},
    )
    assert message.stop_reason == "end_turn"
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(
            model="reasoning",
            max_tokens=16,
            messages=[{"role": "user", "content": "hi"}],
            extra_body={"output_format": {"type": "json_schema", "schema": "not a schema"}},
        )
    assert "output_format.schema" in str(info.value)
