"""The official `openai` Python SDK against the real daemon and stub, both run by twistd."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from testsupport.processes import start_gateway, start_stub, upstream_status, wait_until

WEATHER = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[openai.OpenAI, Path]]:
    cwd = tmp_path_factory.mktemp("openai-sdk")
    fast, fast_url = start_stub(cwd, "--delay", "0.002")
    slow, slow_url = start_stub(
        cwd, "--hold", "2", "--reasoning-tokens", "2", "--content-tokens", "3"
    )
    tight, tight_url = start_stub(cwd, "--max-model-len", "64", "--model", "tight")
    config = f"""
[upstreams.fast]
url = "{fast_url}"
slots = 4

[upstreams.slow]
url = "{slow_url}"
slots = 1
queue_limit = 1

[upstreams.tight]
url = "{tight_url}"
slots = 1

[models.reasoning]
upstream = "fast"
upstream_model = "Qwen/QwQ-32B"

[models.slow]
upstream = "slow"

[models."gpt-*"]
upstream = "tight"
upstream_model = "tight"
"""
    gateway, url = start_gateway(cwd, config)
    yield openai.OpenAI(base_url=url + "/llm/v1", api_key="unused", max_retries=0, timeout=30), cwd
    for process in (gateway, fast, slow, tight):
        process.stop()


@pytest.fixture
def client(setup: tuple[openai.OpenAI, Path]) -> openai.OpenAI:
    return setup[0]


def occupied(gateway: str) -> int:
    """The slow upstream's requests: holding its slot, and waiting for it."""
    status = upstream_status(gateway, "slow")
    return status["in_use"] + status["waiting"]


def gateway_of(client: openai.OpenAI) -> str:
    return str(client.base_url).removesuffix("/").removesuffix("/llm/v1")


def test_a_stream_read_by_the_sdk(client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(model="reasoning", messages=HI, stream=True))
    assert {chunk.model for chunk in chunks} == {"reasoning"}
    assert all(chunk.choices for chunk in chunks)  # no usage chunk: none was asked for
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks)
    assert text.startswith("Hello!")
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_the_usage_chunk_when_asked(client: openai.OpenAI) -> None:
    chunks = list(
        client.chat.completions.create(
            model="reasoning",
            messages=HI,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.prompt_tokens == 5


def test_a_whole_answer_with_tools(client: openai.OpenAI) -> None:
    answer = client.chat.completions.create(
        model="reasoning",
        messages=[{"role": "user", "content": "tool"}],
        tools=WEATHER,  # type: ignore[arg-type]
    )
    assert answer.model == "reasoning"
    call = answer.choices[0].message.tool_calls[0]  # type: ignore[index]
    assert call.function.name == "get_weather"  # type: ignore[union-attr]
    assert answer.choices[0].finish_reason == "tool_calls"
    # and the round trip, as aider and Continue send it
    second = client.chat.completions.create(
        model="reasoning",
        messages=[
            {"role": "user", "content": "tool"},
            answer.choices[0].message.model_dump(exclude_none=True),  # type: ignore[list-item]
            {"role": "tool", "tool_call_id": call.id, "content": "18C"},
        ],
        tools=WEATHER,  # type: ignore[arg-type]
    )
    assert second.model == "reasoning"


def test_a_queued_stream_reads_as_any_other_and_a_full_line_is_a_rate_limit(
    client: openai.OpenAI,
) -> None:
    gateway = gateway_of(client)
    ahead = threading.Thread(
        target=lambda: client.chat.completions.create(model="slow", messages=HI, max_tokens=8)
    )
    ahead.start()
    try:
        # The request ahead holds the only slot for its 2 s hold, far longer than this takes.
        wait_until(lambda: upstream_status(gateway, "slow")["in_use"] == 1)
        stream = client.chat.completions.create(model="slow", messages=HI, stream=True)
        assert occupied(gateway) == 2  # it waits: its headers came with its first comment
        with pytest.raises(openai.RateLimitError) as info:  # queue_limit = 1: no room
            client.chat.completions.create(model="slow", messages=HI)
        assert info.value.response.headers["retry-after"] == "5"
        assert info.value.code == "rate_limit_exceeded"
        chunks = list(stream)
    finally:
        ahead.join(30)
    assert chunks and chunks[-1].choices[0].finish_reason == "stop"


def test_closing_the_stream_cancels_the_upstream(setup: tuple[openai.OpenAI, Path]) -> None:
    client, _ = setup
    gateway = gateway_of(client)
    stream = client.chat.completions.create(
        model="reasoning", messages=[{"role": "user", "content": "long"}], stream=True
    )
    next(iter(stream))
    wait_until(lambda: upstream_status(gateway, "fast")["in_use"] == 1)
    stream.close()
    wait_until(lambda: upstream_status(gateway, "fast")["in_use"] == 0)


def test_an_upstream_failure_mid_stream_raises(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="reasoning", messages=[{"role": "user", "content": "fail"}], stream=True
    )
    with pytest.raises(openai.APIError) as info:
        list(stream)
    assert "engine died" in str(info.value)


def test_each_error_is_the_sdks_own(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="ghost", messages=HI)
    assert missing.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model="reasoning", messages=[])
    assert bad.value.param == "messages"
    with pytest.raises(openai.BadRequestError) as overflow:
        client.chat.completions.create(
            model="gpt-4o", messages=[{"role": "user", "content": "word " * 100}], max_tokens=8
        )
    assert overflow.value.code == "context_length_exceeded"
    with pytest.raises(openai.InternalServerError):
        client.chat.completions.create(
            model="reasoning", messages=[{"role": "user", "content": "error500"}]
        )


def test_embeddings_as_the_sdk_asks_them(client: openai.OpenAI) -> None:
    floats = client.embeddings.create(model="reasoning", input=["a", "b"], encoding_format="float")
    packed = client.embeddings.create(model="reasoning", input=["a", "b"])  # base64, decoded
    assert floats.model == packed.model == "reasoning"
    assert [e.embedding for e in floats.data] == [e.embedding for e in packed.data]
    assert len(floats.data) == 2 and floats.usage.prompt_tokens > 0


def test_legacy_completions_stream_and_whole(client: openai.OpenAI) -> None:
    chunks = list(
        client.completions.create(model="reasoning", prompt="once upon", max_tokens=4, stream=True)
    )
    assert {chunk.model for chunk in chunks} == {"reasoning"} and all(c.choices for c in chunks)
    whole = client.completions.create(model="reasoning", prompt="once upon", max_tokens=4)
    assert whole.model == "reasoning"
    assert whole.choices[0].text == "".join(c.choices[0].text for c in chunks)


# The Responses API, as the SDK and the Agents SDK call it.
WEATHER_TOOL = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        "strict": False,
    }
]


def test_a_response_whole_and_streamed(client: openai.OpenAI) -> None:
    whole = client.responses.create(model="reasoning", input="hi", max_output_tokens=64)
    assert whole.model == "reasoning" and whole.status == "completed"
    assert whole.output_text.startswith("Hello!")
    assert whole.usage is not None and whole.usage.total_tokens > whole.usage.output_tokens > 0
    events = list(client.responses.create(model="reasoning", input="hi", stream=True))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[-1].type == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == events[-1].response.output_text


def test_the_sdks_accumulator_takes_the_stream(client: openai.OpenAI) -> None:
    """`responses.stream()` checks the order, the response's id on every lifecycle event and
    each item's indices, and builds the final response from the events."""
    with client.responses.stream(
        model="reasoning", input="hi", reasoning={"effort": "low"}
    ) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert final.output_text == "".join(deltas)
    assert [item.type for item in final.output] == ["reasoning", "message"]


def test_a_tool_round_trip_through_the_sdk(client: openai.OpenAI) -> None:
    first = client.responses.create(model="reasoning", input="tool", tools=WEATHER_TOOL)  # type: ignore[arg-type]
    call = next(item for item in first.output if item.type == "function_call")
    assert call.name == "get_weather" and call.call_id
    second = client.responses.create(
        model="reasoning",
        input=[
            {"role": "user", "content": "tool"},
            *[item.model_dump(exclude_none=True) for item in first.output],  # type: ignore[misc]
            {"type": "function_call_output", "call_id": call.call_id, "output": "18C"},
        ],
        tools=WEATHER_TOOL,  # type: ignore[arg-type]
    )
    assert second.status == "completed" and second.output[-1].type in ("message", "function_call")


def test_a_queued_response_stream_reads_as_any_other(client: openai.OpenAI) -> None:
    gateway = gateway_of(client)
    ahead = threading.Thread(
        target=lambda: client.responses.create(model="slow", input="hi", max_output_tokens=8)
    )
    ahead.start()
    try:
        wait_until(lambda: upstream_status(gateway, "slow")["in_use"] == 1)
        with client.responses.stream(model="slow", input="hi") as stream:
            kinds = [event.type for event in stream]
            final = stream.get_final_response()
    finally:
        ahead.join(30)
    assert kinds[:3] == ["response.created", "response.queued", "response.in_progress"]
    assert final.status == "completed" and final.output_text


def test_each_responses_error_is_the_sdks_own(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as stored:
        client.responses.create(model="reasoning", input="hi", previous_response_id="resp_1")
    assert stored.value.param == "previous_response_id"
    with pytest.raises(openai.BadRequestError) as overflow:
        client.responses.create(model="gpt-4o", input="word " * 100)
    assert overflow.value.code == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_1")
    stream = client.responses.create(model="reasoning", input="fail", stream=True)
    assert list(stream)[-1].type == "response.failed"
