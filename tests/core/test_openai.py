"""The OpenAI surfaces' sans-IO core: checking requests, renaming answers byte for byte,
relaying streams read by read."""

from __future__ import annotations

import json
from typing import Any

import orjson
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from homelab_gateway.config import ModelConfig
from homelab_gateway.core.errors import GatewayError
from homelab_gateway.core.fields import InvalidRequest
from homelab_gateway.core.instructions import marked
from homelab_gateway.core.openai import (
    StreamRelay,
    WholeRelay,
    error_document,
    map_openai,
    renamed,
)

MODEL = ModelConfig(name="local", upstream="vllm", upstream_model="Qwen/QwQ-32B")
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**53), 2**53) | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=10,
)


def documents() -> st.SearchStrategy[dict[str, Any]]:
    """JSON objects with a top-level model somewhere among their keys (and maybe others
    called "model" deeper down, or as text)."""
    return st.builds(
        lambda before, model, after: {**before, "model": model, **after},
        st.dictionaries(
            st.text(max_size=6).filter(lambda k: k != "model"), json_values, max_size=3
        ),
        st.text(max_size=12),
        st.dictionaries(
            st.text(max_size=6).filter(lambda k: k != "model"), json_values, max_size=3
        ),
    )


@given(documents(), st.text(min_size=1, max_size=12))
def test_renaming_changes_the_models_value_and_no_other_byte(
    document: dict[str, Any], name: str
) -> None:
    data = orjson.dumps(document)
    out = renamed(data, orjson.loads(data), name)
    assert orjson.loads(out) == {**document, "model": name}
    assert out == orjson.dumps({**document, "model": name})  # same layout: only the value moved


@given(documents(), st.text(min_size=1, max_size=12))
def test_renaming_keeps_a_spaced_layout(document: dict[str, Any], name: str) -> None:
    assume(name != document["model"])  # the same name: nothing is rewritten
    data = json.dumps(document).encode()  # Python's `", "` and `": "`
    out = renamed(data, orjson.loads(data), name)
    sentinel = json.dumps({**document, "model": "\0name"}).encode()
    assert out == sentinel.replace(b'"\\u0000name"', orjson.dumps(name))


def test_a_nested_or_quoted_model_is_never_the_one_renamed() -> None:
    data = b'{"text":"\\"model\\":\\"x\\"","meta":{"model":"inner"},"model":"outer"}'
    out = renamed(data, orjson.loads(data), "mine")
    assert out == b'{"text":"\\"model\\":\\"x\\"","meta":{"model":"inner"},"model":"mine"}'


@given(documents(), st.text(min_size=1, max_size=12), st.lists(st.integers(0, 400), max_size=6))
def test_a_whole_answer_renames_the_same_however_it_is_split(
    document: dict[str, Any], name: str, cuts: list[int]
) -> None:
    data = orjson.dumps(document)
    relay = WholeRelay(name)
    points = sorted({min(c, len(data)) for c in cuts})
    pieces = [data[a:b] for a, b in zip([0, *points], [*points, len(data)], strict=True)]
    out = b"".join(relay.feed(piece) for piece in pieces) + relay.end()
    assert out == renamed(data, orjson.loads(data), name)


def test_a_whole_answer_that_is_not_json_passes_untouched() -> None:
    relay = WholeRelay("mine", rename=False)
    assert relay.feed(b'\x00\x01"model":"x"') == b'\x00\x01"model":"x"'
    assert relay.end() == b""


def usage_of(body: bytes) -> dict[str, Any] | None:
    relay = WholeRelay("mine")
    relay.feed(body)
    relay.end()
    return relay.usage


def test_the_usage_is_read_from_a_whole_answers_end() -> None:
    body = b'{"choices":[{"message":{"content":"\\"usage\\":{}"}}],"usage":{"prompt_tokens":7}}'
    assert usage_of(body) == {"prompt_tokens": 7}
    assert usage_of(b'{"choices":[]}') is None


def chunk(content: str, **extra: Any) -> bytes:
    choice = {"index": 0, "delta": {"content": content}, "logprobs": None, "finish_reason": None}
    document = {"id": "c", "model": "Qwen/QwQ-32B", "choices": [choice], **extra}
    return b"data: " + orjson.dumps(document) + b"\n\n"


USAGE = (
    b'data: {"id":"c","model":"Qwen/QwQ-32B","choices":[],'
    b'"usage":{"prompt_tokens":3,"completion_tokens":2}}\n\n'
)
STREAM = chunk("") + chunk("Hel") + chunk("lo") + USAGE + b"data: [DONE]\n\n"


@given(st.lists(st.integers(0, len(STREAM)), max_size=8), st.booleans())
def test_a_stream_relays_the_same_however_its_reads_split_it(
    cuts: list[int], include_usage: bool
) -> None:
    whole = StreamRelay("mine", include_usage)
    expected = whole.feed(STREAM)
    relay = StreamRelay("mine", include_usage)
    points = sorted(set(cuts))
    pieces = [STREAM[a:b] for a, b in zip([0, *points], [*points, len(STREAM)], strict=True)]
    assert b"".join(relay.feed(piece) for piece in pieces) == expected
    assert relay.done and not relay.failed
    assert (relay.input_tokens, relay.output_tokens) == (3, 2)


contents = st.text(st.characters(codec="utf-8"), max_size=6) | st.sampled_from(
    ['"model":"Qwen/QwQ-32B"', "\\", "[DONE]", '"error"', "\n"]
)


@given(
    st.lists(st.tuples(contents, st.integers(0, 2), st.booleans()), min_size=1, max_size=12),
    st.lists(st.integers(0, 4000), max_size=3),
    st.lists(st.integers(0, 12), max_size=6),
    st.sampled_from(["Qwen/QwQ-32B", "mine"]),
)
def test_every_chunk_is_renamed_as_parsing_it_would_rename_it(
    tokens: list[tuple[str, int, bool]], anywhere: list[int], between: list[int], name: str
) -> None:
    """Chunks as vLLM writes them (a `created` that ticks, text of any kind, a nested model
    now and then), in reads split anywhere and between events (as most reads are): each comes
    out as renaming its parsed JSON would write it."""
    events = [
        {
            "id": "chatcmpl-1",
            "created": 100 + second,
            "model": "Qwen/QwQ-32B",
            "choices": [{"index": 0, "delta": {"content": text}}],
            **({"meta": {"model": "Qwen/QwQ-32B"}} if nested else {}),
        }
        for text, second, nested in tokens
    ]
    framed = [b"data: " + orjson.dumps(e) + b"\n\n" for e in events]
    stream = b"".join(framed)
    ends = [sum(map(len, framed[: i + 1])) for i in range(len(framed))]
    cuts = anywhere + [ends[i % len(ends)] for i in between]
    relay = StreamRelay(name, include_usage=False)
    points = sorted({min(c, len(stream)) for c in cuts})
    pieces = [stream[a:b] for a, b in zip([0, *points], [*points, len(stream)], strict=True)]
    out = b"".join(relay.feed(piece) for piece in pieces)
    assert out == b"".join(b"data: " + orjson.dumps({**e, "model": name}) + b"\n\n" for e in events)
    assert not relay.failed


def test_the_stream_is_renamed_and_the_usage_chunk_kept_only_if_asked() -> None:
    plain = StreamRelay("mine", include_usage=False).feed(STREAM)
    assert plain == STREAM.replace(b'"Qwen/QwQ-32B"', b'"mine"').replace(
        USAGE.replace(b'"Qwen/QwQ-32B"', b'"mine"'), b""
    )
    asked = StreamRelay("mine", include_usage=True).feed(STREAM)
    assert asked == STREAM.replace(b'"Qwen/QwQ-32B"', b'"mine"')


@pytest.mark.parametrize(
    "event",
    [
        b'data: {"error":{"message":"boom","type":"InternalServerError","param":null,"code":500}}',
        b'data: {"object":"error","message":"boom","type":"InternalServerError","param":null,'
        b'"code":500}',
    ],
)
def test_an_upstream_error_event_ends_the_stream_in_openais_shape(event: bytes) -> None:
    relay = StreamRelay("mine", include_usage=False)
    out = relay.feed(chunk("a") + event + b"\n\n" + b"data: [DONE]\n\n")
    *_, last = out.split(b"\n\n")[:-1]
    assert orjson.loads(last[len(b"data: ") :]) == {
        "error": {"message": "boom", "type": "InternalServerError", "param": None, "code": 500}
    }
    assert relay.failed and b"[DONE]" not in out


def test_a_stream_that_stops_short_fails() -> None:
    relay = StreamRelay("mine", include_usage=False)
    relay.feed(chunk("a"))
    end = relay.eof("vllm")
    assert orjson.loads(end[len(b"data: ") :])["error"]["type"] == "server_error"
    assert relay.failed
    assert relay.feed(chunk("b")) == b""
    broken = StreamRelay("mine", include_usage=False)
    assert b"error" in broken.feed(b"data: {not json\n\n") and broken.failed


def mapped(kind: str, body: dict[str, Any], model: ModelConfig = MODEL) -> Any:
    return map_openai(kind, {"model": "local", **body}, model)


def sent(request: Any) -> dict[str, Any]:
    return dict(orjson.loads(request.packed.body(model="Qwen/QwQ-32B")))


def test_a_streamed_request_asks_for_usage_keeping_the_clients_options() -> None:
    messages = [{"role": "user", "content": "hi"}]
    both = {"include_usage": True, "continuous_usage_stats": True}
    asked = mapped("chat", {"messages": messages, "stream": True, "stream_options": both})
    assert sent(asked)["stream_options"] == both and asked.include_usage
    # vLLM sends usage in every chunk only with the usage chunk: not to a client that did not
    # ask for that one
    alone = {"continuous_usage_stats": True}
    request = mapped("chat", {"messages": messages, "stream": True, "stream_options": alone})
    assert sent(request)["stream_options"] == {"include_usage": True}
    assert not request.include_usage
    whole = mapped("chat", {"messages": messages, "stream": None})
    assert "stream_options" not in sent(whole) and not whole.packed.stream


LATE_SYSTEM = [
    {"role": "system", "content": "s"},
    {"role": "user", "content": "hi"},
    {"role": "developer", "content": "be brief"},
]


def test_a_chat_passes_its_messages_as_sent_by_default() -> None:
    body = {"messages": LATE_SYSTEM, "stream": False}
    assert sent(mapped("chat", body))["messages"] == LATE_SYSTEM


def test_a_model_that_takes_system_messages_first_gets_the_later_ones_folded() -> None:
    first = ModelConfig(name="local", upstream="vllm", upstream_model="q", system_messages="first")
    messages = sent(mapped("chat", {"messages": LATE_SYSTEM}, first))["messages"]
    assert messages == [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "hi\n\n" + marked("be brief")},
    ]
    assert LATE_SYSTEM[1] == {"role": "user", "content": "hi"}  # the client's left unchanged
    # embeddings' `messages` are no conversation: passed as sent
    embedded = sent(mapped("embeddings", {"messages": LATE_SYSTEM}, first))["messages"]
    assert embedded == LATE_SYSTEM
    with pytest.raises(InvalidRequest, match=r"^messages\.1\.content: must be a string"):
        mapped("chat", {"messages": [LATE_SYSTEM[0], {"role": "user", "content": 5}]}, first)


def test_a_clients_priority_never_reaches_the_upstream() -> None:
    request = mapped("chat", {"messages": [{"role": "user", "content": "hi"}], "priority": -9})
    assert "priority" not in sent(request)


def test_vllms_other_prompt_fields_are_taken() -> None:
    messages = [{"role": "user", "content": "hi"}]
    assert sent(mapped("embeddings", {"messages": messages}))["messages"] == messages
    assert sent(mapped("completions", {"prompt_embeds": "AAAA"}))["prompt_embeds"] == "AAAA"
    echo = {"prompt": "x", "echo": True, "max_tokens": 0}
    assert sent(mapped("completions", echo))["max_tokens"] == 0
    with pytest.raises(InvalidRequest):
        mapped("chat", {"messages": messages, "max_tokens": 0})


def test_the_cap_lowers_a_max_tokens_the_models_params_set() -> None:
    capped = ModelConfig(
        name="local",
        upstream="vllm",
        upstream_model="m",
        max_tokens=100,
        params={"max_tokens": 900},
    )
    assert sent(mapped("completions", {"prompt": "x"}, capped))["max_tokens"] == 100


def test_the_session_is_the_prompt_cache_key_then_the_user() -> None:
    messages = [{"role": "user", "content": "hi"}]
    both = {"messages": messages, "prompt_cache_key": "k", "user": "u"}
    assert mapped("chat", both).session == "k"
    assert mapped("chat", {"messages": messages, "user": "u"}).session == "u"
    assert mapped("chat", {"messages": messages}).session is None


@pytest.mark.parametrize(
    "kind, body",
    [
        ("completions", {"prompt": "once upon"}),
        ("completions", {"prompt": ["a", "b"]}),
        ("completions", {"prompt": [1, 2, 3]}),
        ("completions", {"prompt": [[1, 2], [3]]}),
        ("embeddings", {"input": "text"}),
        ("embeddings", {"input": [[1, 2]], "encoding_format": "base64"}),
    ],
)
def test_every_prompt_shape_vllm_takes_is_taken(kind: str, body: dict[str, Any]) -> None:
    request = mapped(kind, body)
    assert {**sent(request), "model": "local"} == {"model": "local", **body}


@pytest.mark.parametrize(
    "kind, body, param",
    [
        ("completions", {}, "prompt"),
        ("completions", {"prompt": [{"text": "x"}]}, "prompt.0"),
        ("embeddings", {"input": []}, "input"),
        ("embeddings", {"input": 7}, "input"),
        ("chat", {"messages": [{"content": "x"}]}, "messages.0.role"),
        ("completions", {"prompt": "x", "max_tokens": True}, "max_tokens"),
        ("completions", {"prompt": "x", "stream_options": 1, "stream": True}, "stream_options"),
    ],
)
def test_a_mistake_names_its_field(kind: str, body: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        mapped(kind, body)
    assert caught.value.param == param
    assert str(caught.value).startswith(param + ":")


def test_the_models_cap_lowers_only_what_the_client_asked_past_it() -> None:
    capped = ModelConfig(name="local", upstream="vllm", upstream_model="m", max_tokens=100)
    assert (
        sent(mapped("completions", {"prompt": "x", "max_tokens": 500}, capped))["max_tokens"] == 100
    )
    assert "max_tokens" not in sent(mapped("completions", {"prompt": "x"}, capped))  # vLLM's 16
    assert sent(mapped("completions", {"prompt": "x", "max_tokens": 5}, capped))["max_tokens"] == 5


def test_a_null_limit_gets_the_models_cap_on_completions_as_on_chat() -> None:
    capped = ModelConfig(name="local", upstream="vllm", upstream_model="m", max_tokens=100)
    completion = {"prompt": "x", "max_tokens": None}
    assert sent(mapped("completions", completion, capped))["max_tokens"] == 100
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": None}
    assert sent(mapped("chat", chat, capped))["max_tokens"] == 100
    # No cap configured: null stays the client's "to the end of the window", as on chat.
    assert sent(mapped("completions", completion))["max_tokens"] is None


@pytest.mark.parametrize("kind", ["chat", "completions"])
@pytest.mark.parametrize("n", [2, 64, 0, "2", 1.5])
def test_more_than_one_choice_is_refused_naming_n(kind: str, n: Any) -> None:
    prompt = (
        {"messages": [{"role": "user", "content": "hi"}]} if kind == "chat" else {"prompt": "x"}
    )
    with pytest.raises(InvalidRequest) as caught:
        mapped(kind, {**prompt, "n": n})
    assert caught.value.param == "n"
    assert str(caught.value).startswith("n:")


def test_one_choice_is_taken_as_asked() -> None:
    assert sent(mapped("completions", {"prompt": "x", "n": 1}))["n"] == 1
    mapped("chat", {"messages": [{"role": "user", "content": "hi"}], "n": None})
    with_params = ModelConfig(name="local", upstream="vllm", upstream_model="m", params={"n": 4})
    with pytest.raises(InvalidRequest):
        mapped("completions", {"prompt": "x"}, with_params)


@pytest.mark.parametrize(
    "outcome, status", [("queue_timeout", 429), ("rejected_queue_full", 429), (None, 503)]
)
def test_a_529_is_openais_429_when_the_line_refused_else_503(
    outcome: str | None, status: int
) -> None:
    error = GatewayError(529, "busy", outcome=outcome, retry_after=5)
    assert error.openai_status == status
    body = error.openai_body()["error"]
    assert body["type"] == ("rate_limit_error" if status == 429 else "server_error")
    assert body["code"] == ("rate_limit_exceeded" if status == 429 else None)


def test_an_error_event_of_any_shape_ends_the_stream_readably() -> None:
    relay = StreamRelay("mine", include_usage=False)
    out = relay.feed(chunk("a") + 'data: {"error": "模型"}\n\n'.encode())
    assert relay.failed and relay.error == {
        "message": "模型",
        "type": "server_error",
        "param": None,
        "code": None,
    }
    assert out.endswith(b"\n\n") and b"[DONE]" not in out
    quiet = StreamRelay("mine", include_usage=False)
    quiet.feed(chunk("a", error=None))
    assert not quiet.failed  # a chunk that says "no error" is no error


def test_an_upstreams_flat_error_is_written_in_openais_shape() -> None:
    error = GatewayError(400, "x", upstream_body=b'{"object":"error","message":"m","code":400}')
    assert error_document(error) == {"error": {"message": "m", "code": 400}}
    assert (
        error_document(GatewayError(400, "x", upstream_body=b"<html>"))["error"]["message"] == "x"
    )


def test_only_chunks_with_output_count_and_start_the_answer() -> None:
    relay = StreamRelay("mine", include_usage=False)
    role = {"delta": {"role": "assistant", "content": ""}}
    first = b'data: {"model":"m","choices":[' + orjson.dumps({**role, "index": 0}) + b"]}\n\n"
    second = b'data: {"model":"m","choices":[' + orjson.dumps({**role, "index": 1}) + b"]}\n\n"
    relay.feed(first)
    relay.feed(second)  # n=2: a role chunk for each choice
    assert (relay.chunks, relay.started) == (0, False)
    relay.feed(b'data: {"model":"m","choices":[{"index":0,"delta":{"content":"a"}}]}\n\n')
    assert (relay.chunks, relay.started) == (1, True)


def test_usage_in_every_chunk_is_read_from_every_chunk() -> None:
    relay = StreamRelay("mine", include_usage=True)
    for n in range(1, 6):
        relay.feed(
            b'data: {"model":"m","choices":[{"index":0,"delta":{"content":"a"}}],'
            b'"usage":{"prompt_tokens":3,"completion_tokens":%d}}\n\n' % n
        )
    assert relay.output_tokens == 5
    relay.feed(b'data: {"model":"m","usage":{"prompt_tokens":3,"completion_tokens":6}}\n\n')
    assert relay.output_tokens == 6  # a usage chunk with no choices at all


def test_a_chunk_cut_short_fails_the_stream_even_when_it_starts_as_the_others() -> None:
    relay = StreamRelay("mine", include_usage=False)
    relay.feed(b'data: {"model":"m","choices":[{"index":0,"delta":{"content":"a"}}]}\n\n')
    out = relay.feed(b'data: {"model":"m","choices":[{"index":0,"delta":{"content":"b\n\n')
    assert relay.failed and b"not JSON" in out
