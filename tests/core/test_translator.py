"""The streaming translator, rule by rule, plus a grammar property over any chunk sequence.

Chunks are shaped like real vLLM/Ollama/llama.cpp output (see shared/anthropic-wire.md).
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from homelab_gateway.core.errors import upstream_message
from homelab_gateway.core.sse import encode_event
from homelab_gateway.core.translator import (
    PLAIN_EVENT,
    IncompleteMessage,
    MessageBuilder,
    Phase,
    StreamTranslator,
    UpstreamDecoder,
)
from testsupport.grammar import PROMPT_USAGE, check_stream


def chunk(
    delta: dict[str, Any] | None = None,
    finish: str | None = None,
    *,
    usage: dict[str, int] | None = None,
    stop_reason: Any = None,
) -> dict[str, Any]:
    choice: dict[str, Any] = {
        "index": 0,
        "delta": delta or {},
        "logprobs": None,
        "finish_reason": finish,
    }
    if finish is not None:
        choice["stop_reason"] = stop_reason
    out: dict[str, Any] = {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "Qwen/QwQ-32B",
        "choices": [choice],
    }
    if usage:
        out["usage"] = usage
    return out


ROLE = chunk({"role": "assistant", "content": ""})
USAGE = {
    "id": "chatcmpl-1",
    "choices": [],
    "usage": {"prompt_tokens": 52, "completion_tokens": 39, "total_tokens": 91},
}


def run(
    chunks: list[Any], *, done: bool = True, stop: tuple[str, ...] = (), **kw: Any
) -> list[dict[str, Any]]:
    t = StreamTranslator(
        model="reasoning",
        input_tokens=kw.pop("input_tokens", 7),
        stop_sequences=stop,
        show_reasoning=kw.pop("show_reasoning", True),
    )
    events: list[dict[str, Any]] = []
    for c in chunks:
        events += t.feed(c)
    if done:
        events += t.end()
    return events


def usage(
    input_tokens: int, output_tokens: int, cached: int = 0, created: int = 0
) -> dict[str, int]:
    return {
        "input_tokens": input_tokens,
        "cache_creation_input_tokens": created,
        "cache_read_input_tokens": cached,
        "output_tokens": output_tokens,
    }


def kinds(events: list[dict[str, Any]]) -> list[str]:
    return [e["type"] for e in events]


def blocks(events: list[dict[str, Any]]) -> list[tuple[int, str]]:
    return [
        (e["index"], e["content_block"]["type"])
        for e in events
        if e["type"] == "content_block_start"
    ]


def text_of(events: list[dict[str, Any]], index: int) -> str:
    return "".join(
        next(v for k, v in e["delta"].items() if k != "type")
        for e in events
        if e["type"] == "content_block_delta" and e["index"] == index
    )


THINK_THEN_TEXT = [
    ROLE,
    chunk({"reasoning": "The user "}),
    chunk({"reasoning": "wants"}),
    chunk({"content": ""}),
    chunk({"content": "Hello"}),
    chunk({"content": " there"}),
    chunk({"content": ""}, "stop"),
    USAGE,
]


def test_full_sequence_with_thinking_then_text() -> None:
    events = run(THINK_THEN_TEXT)
    assert check_stream(events) == "complete"
    assert kinds(events) == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert events[4] == {
        "type": "content_block_delta",
        "index": 0,
        "delta": {"type": "signature_delta", "signature": ""},
    }
    assert blocks(events) == [(0, "thinking"), (1, "text")]
    assert events[1]["content_block"] == {"type": "thinking", "thinking": "", "signature": ""}
    assert text_of(events, 0) == "The user wants" and text_of(events, 1) == "Hello there"
    assert events[-2]["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert events[-2]["usage"] == usage(52, 39)


def test_message_start_envelope_echoes_the_client_model() -> None:
    start = run([ROLE], done=False)[0]["message"]
    assert start["model"] == "reasoning" and start["id"].startswith("msg_")
    assert (
        start["content"] == [] and start["stop_reason"] is None and start["stop_sequence"] is None
    )
    assert start["usage"] == usage(7, 0)


def test_continuous_usage_makes_message_start_input_tokens_exact() -> None:
    first = chunk(
        {"role": "assistant", "content": ""}, usage={"prompt_tokens": 472, "completion_tokens": 0}
    )
    assert run([first], done=False)[0]["message"]["usage"]["input_tokens"] == 472


def test_input_tokens_are_never_zero_when_the_upstream_does_not_report_them() -> None:
    # sglang #20678 reported input_tokens: 0
    assert run([ROLE], done=False, input_tokens=12)[0]["message"]["usage"]["input_tokens"] == 12


@pytest.mark.parametrize("field", ["reasoning", "reasoning_content"])
def test_either_reasoning_field_opens_the_thinking_block(field: str) -> None:
    events = run([ROLE, chunk({field: "hmm"}), chunk({"content": "ok"}), chunk({}, "stop")])
    assert blocks(events) == [(0, "thinking"), (1, "text")]


def test_transitional_vllm_sending_both_reasoning_fields_is_not_doubled() -> None:
    events = run(
        [
            ROLE,
            chunk({"reasoning": "a", "reasoning_content": "a"}),
            chunk({"content": "b", "reasoning_content": None}),
            chunk({}, "stop"),
        ]
    )
    assert text_of(events, 0) == "a" and text_of(events, 1) == "b"


def test_no_reasoning_puts_text_at_index_0() -> None:
    events = run([ROLE, chunk({"content": "Hi"}), chunk({"content": ""}, "stop")])
    assert blocks(events) == [(0, "text")]


def test_empty_and_null_deltas_open_no_block() -> None:
    # vLLM's first chunk is content "" and llama.cpp's is content null: neither is content.
    events = run(
        [
            ROLE,
            chunk({"role": "assistant", "content": None}),
            chunk({"content": ""}),
            chunk({"reasoning": None, "tool_calls": None}),
            chunk({"content": ""}, "stop"),
        ]
    )
    assert blocks(events) == []
    assert check_stream(events) == "complete"


def test_first_text_token_is_not_dropped() -> None:
    # LiteLLM #30014: the first token arrived in the chunk that opened the block and was lost.
    events = run([chunk({"role": "assistant", "content": "First"}), chunk({}, "stop")])
    assert text_of(events, 0) == "First"


def test_reasoning_only_closes_the_thinking_block_before_message_delta() -> None:
    events = run([ROLE, chunk({"reasoning": "long thought"}), chunk({"reasoning": ""}, "length")])
    assert kinds(events)[-4:] == [
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert events[-2]["delta"]["stop_reason"] == "max_tokens"


def test_interleaved_thinking_opens_a_new_block_never_appends_to_text() -> None:
    events = run(
        [
            ROLE,
            chunk({"reasoning": "a"}),
            chunk({"content": "b"}),
            chunk({"reasoning": "c"}),
            chunk({"content": "d"}),
            chunk({}, "stop"),
        ]
    )
    assert blocks(events) == [(0, "thinking"), (1, "text"), (2, "thinking"), (3, "text")]
    assert [text_of(events, i) for i in range(4)] == ["a", "b", "c", "d"]
    assert check_stream(events) == "complete"


def tool_head(index: int, name: str) -> dict[str, Any]:
    return chunk(
        {
            "tool_calls": [
                {
                    "id": f"chatcmpl-tool-{index}",
                    "type": "function",
                    "index": index,
                    "function": {"name": name},
                }
            ]
        }
    )


def tool_args(index: int, fragment: str) -> dict[str, Any]:
    return chunk({"tool_calls": [{"index": index, "function": {"arguments": fragment}}]})


def test_tool_call_becomes_a_tool_use_block_with_fragments_as_they_arrive() -> None:
    events = run(
        [
            ROLE,
            chunk({"content": "Let me check"}),
            tool_head(0, "get_weather"),
            tool_args(0, '{"city": "'),
            tool_args(0, 'Paris"}'),
            chunk({"content": ""}, "tool_calls"),
            USAGE,
        ]
    )
    assert check_stream(events) == "complete"
    assert blocks(events) == [(0, "text"), (1, "tool_use")]
    start = next(e for e in events if e["type"] == "content_block_start" and e["index"] == 1)
    assert start["content_block"]["name"] == "get_weather" and start["content_block"][
        "id"
    ].startswith("toolu_")
    fragments = [
        e["delta"]["partial_json"]
        for e in events
        if e["type"] == "content_block_delta" and e["index"] == 1
    ]
    assert fragments == ['{"city": "', 'Paris"}']
    assert events[-2]["delta"]["stop_reason"] == "tool_use"


def test_first_tool_argument_fragment_in_the_head_chunk_is_not_dropped() -> None:
    # LiteLLM #25321
    head = chunk(
        {
            "tool_calls": [
                {
                    "id": "t",
                    "type": "function",
                    "index": 0,
                    "function": {"name": "f", "arguments": '{"a":'},
                }
            ]
        }
    )
    events = run([ROLE, head, tool_args(0, "1}"), chunk({}, "tool_calls")])
    assert text_of(events, 0) == '{"a":1}'


def test_tools_called_with_finish_reason_stop_still_report_tool_use() -> None:
    # LiteLLM #34692; some Ollama versions say "stop" after tool calls.
    events = run([ROLE, tool_head(0, "f"), tool_args(0, "{}"), chunk({}, "stop")])
    assert events[-2]["delta"]["stop_reason"] == "tool_use"


def test_parallel_tool_calls_get_their_own_blocks_in_order() -> None:
    events = run(
        [
            ROLE,
            chunk({"reasoning": "two calls"}),
            tool_head(0, "a"),
            tool_args(0, "{}"),
            tool_head(1, "b"),
            tool_args(1, '{"x":1}'),
            chunk({}, "tool_calls"),
        ]
    )
    assert blocks(events) == [(0, "thinking"), (1, "tool_use"), (2, "tool_use")]
    assert text_of(events, 2) == '{"x":1}'
    assert check_stream(events) == "complete"


def test_tool_name_arriving_after_arguments_holds_the_fragments_until_it_can_open() -> None:
    events = run(
        [
            ROLE,
            chunk({"tool_calls": [{"index": 0, "id": "t", "function": {"arguments": '{"a"'}}]}),
            chunk({"tool_calls": [{"index": 0, "function": {"name": "f", "arguments": ":1}"}}]}),
            chunk({}, "tool_calls"),
        ]
    )
    assert blocks(events) == [(0, "tool_use")] and text_of(events, 0) == '{"a":1}'


def test_arguments_for_a_closed_tool_block_fail_the_stream_rather_than_misplace_them() -> None:
    events = run(
        [ROLE, tool_head(0, "a"), tool_head(1, "b"), tool_args(0, "{}"), chunk({}, "tool_calls")]
    )
    assert check_stream(events) == "error"


@pytest.mark.parametrize(
    ("finish", "reason"),
    [
        ("stop", "end_turn"),
        ("length", "max_tokens"),
        ("tool_calls", "tool_use"),
        ("content_filter", "refusal"),
        ("something_new", "end_turn"),
    ],
)
def test_finish_reasons_map_to_stop_reasons(finish: str, reason: str) -> None:
    events = run([ROLE, chunk({"content": "x"}), chunk({}, finish)])
    assert events[-2]["delta"]["stop_reason"] == reason


def test_a_matched_stop_sequence_is_reported() -> None:
    events = run(
        [ROLE, chunk({"content": "x"}), chunk({}, "stop", stop_reason="END")], stop=("END",)
    )
    assert events[-2]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "END"}


def test_a_stop_token_id_is_not_a_stop_sequence() -> None:
    events = run(
        [ROLE, chunk({"content": "x"}), chunk({}, "stop", stop_reason=151645)], stop=("END",)
    )
    assert events[-2]["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}


def test_abort_is_a_failure_not_a_success() -> None:
    events = run([ROLE, chunk({"content": "partial"}), chunk({}, "abort")])
    assert check_stream(events) == "error"
    assert events[-1]["error"]["type"] == "overloaded_error"
    assert "message_stop" not in kinds(events)


def test_error_chunk_mid_stream_ends_with_an_error_frame() -> None:
    # LiteLLM #39703 reported this as end_turn with empty content.
    error = {
        "error": {
            "message": "engine died",
            "type": "InternalServerError",
            "param": None,
            "code": 500,
        }
    }
    events = run(
        [ROLE, chunk({"content": "a"}), error, chunk({"content": "late"}), chunk({}, "stop")]
    )
    assert check_stream(events) == "error"
    assert events[-1] == {
        "type": "error",
        "error": {"type": "api_error", "message": "upstream error: engine died"},
    }


def test_end_without_finish_reason_is_a_failure() -> None:
    assert check_stream(run([ROLE, chunk({"content": "cut"})])) == "error"


def test_end_with_nothing_received_is_a_lone_error() -> None:
    t = StreamTranslator(model="m", input_tokens=1)
    assert kinds(t.end()) == ["error"]


def test_nothing_is_emitted_after_the_end() -> None:
    t = StreamTranslator(model="m", input_tokens=1)
    for c in THINK_THEN_TEXT:
        t.feed(c)
    assert kinds(t.end())[-1] == "message_stop" and t.phase is Phase.DONE
    assert (
        t.feed(chunk({"content": "more"})) == []
        and t.end() == []
        and t.fail("api_error", "x") == []
    )


def test_non_object_chunk_fails() -> None:
    t = StreamTranslator(model="m", input_tokens=1)
    assert kinds(t.feed([1, 2])) == ["error"]


def test_output_tokens_are_counted_when_the_upstream_reports_no_usage() -> None:
    events = run(
        [
            ROLE,
            chunk({"content": "a"}),
            chunk({"content": "b"}),
            chunk({"reasoning": "c"}),
            chunk({}, "stop"),
        ]
    )
    assert events[-2]["usage"]["output_tokens"] == 3


def test_message_builder_folds_events_into_the_non_streaming_message() -> None:
    builder = MessageBuilder()
    builder.add(
        run(
            [
                ROLE,
                chunk({"reasoning": "hm"}),
                chunk({"content": "Hi"}),
                tool_head(0, "f"),
                tool_args(0, '{"a": [1'),
                tool_args(0, "]}"),
                chunk({}, "tool_calls"),
                USAGE,
            ]
        )
    )
    message = builder.message()
    assert message["content"][0] == {"type": "thinking", "thinking": "hm", "signature": ""}
    assert message["content"][1] == {"type": "text", "text": "Hi"}
    assert message["content"][2]["input"] == {"a": [1]} and message["content"][2]["name"] == "f"
    assert message["stop_reason"] == "tool_use" and message["usage"] == usage(52, 39)


def test_message_builder_refuses_a_failed_or_unfinished_stream() -> None:
    builder = MessageBuilder()
    builder.add(run([ROLE, chunk({"content": "a"}), chunk({}, "abort")]))
    with pytest.raises(IncompleteMessage) as info:
        builder.message()
    assert info.value.error_type == "overloaded_error"
    builder = MessageBuilder()
    builder.add(run([ROLE, chunk({"content": "a"})], done=False))
    with pytest.raises(IncompleteMessage):
        builder.message()


def test_message_builder_refuses_tool_arguments_that_are_not_an_object() -> None:
    builder = MessageBuilder()
    builder.add(run([ROLE, tool_head(0, "f"), tool_args(0, "not json"), chunk({}, "tool_calls")]))
    with pytest.raises(IncompleteMessage):
        builder.message()


# The grammar property: whatever the upstream interleaves, the output is a valid stream.
texts = st.sampled_from(["", "a", "bc", " ", "\u00e9\u2603"]) | st.none()
deltas = st.one_of(
    st.builds(lambda t: {"reasoning": t}, texts),
    st.builds(lambda t: {"reasoning_content": t}, texts),
    st.builds(lambda t: {"content": t}, texts),
    st.builds(lambda t, r: {"content": t, "reasoning": r}, texts, texts),
    st.builds(
        lambda i, name, args: {
            "tool_calls": [
                {"index": i, "id": f"id{i}", "function": {"name": name, "arguments": args}}
            ]
        },
        st.integers(0, 2),
        st.sampled_from(["f", "", None]),
        texts,
    ),
    st.just({"role": "assistant", "content": ""}),
    st.just({}),
)
chunks = st.one_of(
    st.builds(chunk, deltas),
    st.builds(
        chunk, deltas, st.sampled_from(["stop", "length", "tool_calls", "abort", "content_filter"])
    ),
    st.just(USAGE),
    st.just({"error": {"message": "boom", "code": 500}}),
)


@settings(max_examples=400)
@given(st.lists(chunks, max_size=25), st.sampled_from(["done", "fail", "none"]))
def test_any_chunk_sequence_yields_a_grammatical_stream(
    sequence: list[dict[str, Any]], ending: str
) -> None:
    t = StreamTranslator(model="m", input_tokens=3)
    events: list[dict[str, Any]] = []
    for c in sequence:
        events += t.feed(c)
    if ending == "done":
        events += t.end()
    elif ending == "fail":
        events += t.fail("api_error", "connection reset")
    else:
        events += t.fail("api_error", "closed before [DONE]")  # what the gateway does at EOF
    outcome = check_stream(events)
    assert kinds(events).count("message_stop") == (1 if outcome == "complete" else 0)


# Raw upstream bytes, split anywhere, through the same decoder the gateway runs.
def frame(document: Any) -> bytes:
    return (
        b"data: "
        + (document if isinstance(document, bytes) else json.dumps(document).encode())
        + b"\n\n"
    )


upstream_frames = st.one_of(
    chunks.map(frame),
    st.just(b"data: [DONE]\n\n"),
    st.just(b": keep-alive comment\n\n"),
    st.just(b'event: message\ndata: {"choices": []}\n\n'),
    st.binary(max_size=40),  # garbage
    st.just(b"data: {not json\n\n"),
)


@settings(max_examples=300)
@given(st.lists(upstream_frames, max_size=20), st.sampled_from([b"\n", b"\r\n"]), st.data())
def test_raw_upstream_bytes_split_anywhere_give_a_grammatical_stream(
    frames: list[bytes], newline: bytes, data: st.DataObject
) -> None:
    stream = b"".join(frames).replace(b"\n", newline)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=12)))
    decoder = UpstreamDecoder(StreamTranslator(model="m", input_tokens=3))
    events: list[dict[str, Any]] = []
    for a, b in zip([0, *cuts], [*cuts, len(stream)], strict=True):
        events += decoder.feed(stream[a:b])
    events += decoder.eof("stub")
    if not events:
        return  # nothing at all: the gateway answers an HTTP error before any frame
    assert check_stream(events) in ("complete", "error")


# The plain-event path (`PLAIN_EVENT`): for any event it accepts, the same events (and so the
# same bytes) as the generic path. Fed one byte at a time, the decoder never sees a whole event
# while its parser is idle, so that is the generic path; fed whole, plain events go around it.
def vllm_event(
    field: bytes, text: bytes, usage: tuple[bytes, bytes, bytes] | None = None, **parts: bytes
) -> bytes:
    """An event as vLLM writes it, with the pieces given as raw bytes (valid or not)."""
    out = (
        b'data: {"id":"' + parts.get("id", b"chatcmpl-1") + b'","object":"chat.completion.chunk",'
        b'"created":'
        + parts.get("created", b"1764547200")
        + b',"model":"'
        + parts.get("model", b"Qwen/Qwen3-32B")
        + b'","choices":[{"index":0,"delta":{"'
        + field
        + b'":"'
        + text
        + b'"},"logprobs":null,"finish_reason":null}]'
    )
    if usage is not None:
        out += (
            b',"usage":{"prompt_tokens":'
            + usage[0]
            + b',"total_tokens":'
            + usage[1]
            + b',"completion_tokens":'
            + usage[2]
            + b"}"
        )
    return out + b"}\n\n"


def by_byte_and_whole(
    stream: bytes, show_reasoning: bool = True, cuts: list[int] | None = None
) -> tuple[bytes, ...]:
    """What a client gets for `stream` fed one byte at a time, whole, and cut at `cuts`."""
    answers = []
    cut = sorted(cuts or [])
    for pieces in (
        [stream[i : i + 1] for i in range(len(stream))],
        [stream],
        [stream[a:b] for a, b in zip([0, *cut], [*cut, len(stream)], strict=True)],
    ):
        decoder = UpstreamDecoder(
            StreamTranslator(
                model="m", input_tokens=3, message_id="msg_1", show_reasoning=show_reasoning
            )
        )
        events = [e for piece in pieces for e in decoder.feed(piece)] + decoder.eof("stub")
        t = decoder.translator
        events.append({"type": "state", "in": t.input_tokens, "out": t.final_output_tokens})
        # Tool ids are random: the same placeholder in both runs.
        frames = b"".join(map(encode_event, events))
        answers.append(re.sub(rb"toolu_[0-9a-f]{24}", b"toolu_x", frames))
    return tuple(answers)


# Mostly what vLLM writes, sometimes anything: a candidate must pass every other part of the
# pattern for one odd part to be tried.
raw_strings = st.one_of(
    st.just(b"chatcmpl-1"),
    st.text(max_size=8).map(lambda s: s.encode("utf-8", "surrogatepass")),
    st.binary(max_size=6),
)
raw_texts = st.lists(
    st.sampled_from(
        [
            b"a",
            b" ",
            b"\\n",
            b'\\"',
            b"\\\\",
            b"\\/",
            b"\\b",
            b"\\t",
            b"\\u00e9",
            b"\\ud83d",
            b"\\x",
            b"\xc3\xa9",
            b"\xff",
            b"\xe2\x82",
            b"\x7f",
            b"\x1f",
            b"\r",
            b'"',
            b"\\",
        ]
    ),
    max_size=6,
).map(b"".join)
raw_counts = st.integers(0, 10**6).map(lambda n: str(n).encode()) | st.from_regex(
    rb"\A(?:[0-9]{1,20}|-1|1\.0)\Z"
)
raw_events = st.builds(
    vllm_event,
    st.sampled_from([b"content", b"reasoning", b"reasoning_content", b"role"]),
    raw_texts,
    st.none() | st.tuples(raw_counts, raw_counts, raw_counts),
    id=raw_strings,
    created=raw_counts,
    model=raw_strings,
)
openings = st.sampled_from(
    [
        [chunk({"role": "assistant", "content": ""})],
        [chunk({"reasoning": "hm"})],
        [chunk({"content": "Hi"})],
        [chunk({"role": "assistant", "content": ""}), chunk({"content": "a"}, "stop")],
        [chunk({"tool_calls": [{"index": 0, "id": "t", "function": {"name": "f"}}]})],
        [],
    ]
)


@settings(max_examples=300)
@given(openings, st.lists(raw_events, min_size=1, max_size=4), st.booleans(), st.data())
def test_plain_events_give_the_same_bytes_as_the_generic_path(
    opening: list[dict[str, Any]], events: list[bytes], show_reasoning: bool, data: st.DataObject
) -> None:
    finish = [chunk({"content": ""}, "stop"), USAGE]
    stream = (
        b"".join(frame(c) for c in opening)
        + b"".join(events)
        + b"".join(frame(c) for c in finish)
        + b"data: [DONE]\n\n"
    )
    cuts = data.draw(st.lists(st.integers(0, len(stream)), max_size=8))
    generic, plain, cut = by_byte_and_whole(stream, show_reasoning, cuts)
    assert plain == generic
    assert cut == generic


def test_vllm_token_events_take_the_plain_path() -> None:
    """The property above only means something if real tokens go the plain way: vLLM's token
    events do, with usage or without, escapes and all; a `\\u` escape does not."""
    accepted = [
        vllm_event(b"content", b"Hello"),
        vllm_event(b"reasoning", b"\xc3\xbcber ", (b"52", b"53", b"1")),
        vllm_event(b"reasoning_content", b'print(\\"hi\\")\\n', (b"0", b"0", b"0")),
    ]
    refused = [
        vllm_event(b"content", b"\\u00e9"),
        vllm_event(b"content", b""),
        vllm_event(b"content", b"a", (b"052", b"53", b"1")),
        vllm_event(b"role", b"assistant"),
        vllm_event(b"content", b"a").replace(b"\n", b"\r\n"),
    ]
    assert all(PLAIN_EVENT.fullmatch(e) for e in accepted)
    assert not any(PLAIN_EVENT.fullmatch(e) for e in refused)
    opening = frame(chunk({"role": "assistant", "content": ""}))
    stream = opening + b"".join(accepted + refused) + b"data: [DONE]\n\n"
    generic, plain, _ = by_byte_and_whole(stream)
    assert plain == generic


def test_the_decoder_stops_at_done_and_ignores_what_follows() -> None:
    decoder = UpstreamDecoder(StreamTranslator(model="m", input_tokens=3))
    body = b"".join(frame(c) for c in THINK_THEN_TEXT) + b'data: [DONE]\n\ndata: {"late": 1}\n\n'
    events = decoder.feed(body) + decoder.eof("stub")
    assert check_stream(events) == "complete"


# vLLM's usage with --enable-prompt-tokens-details (UsageInfo.prompt_tokens_details is a
# PromptTokenUsageInfo, `cached_tokens` in it) and llama.cpp's server's usage_json_oaicompat.
VLLM_CACHED_USAGE = {
    "prompt_tokens": 2100,
    "total_tokens": 2139,
    "completion_tokens": 39,
    "prompt_tokens_details": {"cached_tokens": 2048},
}


def test_cache_reads_are_split_out_of_input_tokens_everywhere() -> None:
    first = chunk({"role": "assistant", "content": ""}, usage=VLLM_CACHED_USAGE)
    events = run([first, chunk({"content": "Hi"}, "stop", usage=VLLM_CACHED_USAGE)])
    assert check_stream(events) == "complete"
    assert events[0]["message"]["usage"] == usage(52, 39, cached=2048)
    assert events[-2]["usage"] == usage(52, 39, cached=2048)
    builder = MessageBuilder()
    builder.add(events)
    assert builder.message()["usage"] == usage(52, 39, cached=2048)


def test_cache_reads_on_the_last_usage_chunk_only() -> None:
    last = {"id": "chatcmpl-1", "choices": [], "usage": VLLM_CACHED_USAGE}
    events = run([ROLE, chunk({"content": "Hi"}, "stop"), last])
    assert events[0]["message"]["usage"] == usage(7, 0)
    assert events[-2]["usage"] == usage(52, 39, cached=2048)


def test_no_cache_details_means_zero_cache_reads() -> None:
    null_details = {**USAGE["usage"], "prompt_tokens_details": None}  # vLLM without the flag
    events = run([ROLE, chunk({"content": "Hi"}, "stop"), {"choices": [], "usage": null_details}])
    assert events[-2]["usage"] == usage(52, 39)


def test_older_llama_cpp_timings_cache_n_counts_as_cache_reads() -> None:
    final = {
        "choices": [],
        "usage": {"prompt_tokens": 52, "completion_tokens": 39, "total_tokens": 91},
        "timings": {"cache_n": 40, "prompt_n": 12},
    }
    events = run([ROLE, chunk({"content": "Hi"}, "stop"), final])
    assert events[-2]["usage"] == usage(12, 39, cached=40)


# vLLM 0.32 also reports the prompt tokens it wrote into its prefix cache
# (PromptTokenUsageInfo.created_cache_tokens), on every usage chunk; its own Anthropic endpoint
# (vllm/entrypoints/anthropic/serving.py, _build_anthropic_usage) takes both out of input_tokens.
VLLM_CREATED_USAGE = {
    "prompt_tokens": 2100,
    "total_tokens": 2139,
    "completion_tokens": 39,
    "prompt_tokens_details": {"cached_tokens": 1024, "created_cache_tokens": 1056},
}


def test_cache_writes_are_split_out_of_input_tokens_everywhere() -> None:
    first = chunk({"role": "assistant", "content": ""}, usage=VLLM_CREATED_USAGE)
    events = run([first, chunk({"content": "Hi"}, "stop", usage=VLLM_CREATED_USAGE)])
    assert check_stream(events) == "complete"
    assert events[0]["message"]["usage"] == usage(20, 39, cached=1024, created=1056)
    assert events[-2]["usage"] == usage(20, 39, cached=1024, created=1056)
    builder = MessageBuilder()
    builder.add(events)
    assert builder.message()["usage"] == usage(20, 39, cached=1024, created=1056)


def test_cache_writes_on_the_last_usage_chunk_only() -> None:
    last = {"id": "chatcmpl-1", "choices": [], "usage": VLLM_CREATED_USAGE}
    events = run([ROLE, chunk({"content": "Hi"}, "stop"), last])
    assert events[0]["message"]["usage"] == usage(7, 0)
    assert events[-2]["usage"] == usage(20, 39, cached=1024, created=1056)


def test_a_cold_prompt_is_all_cache_writes() -> None:
    details = {"cached_tokens": 0, "created_cache_tokens": 2096}  # whole 16-token blocks
    final = {"choices": [], "usage": {**VLLM_CREATED_USAGE, "prompt_tokens_details": details}}
    events = run([ROLE, chunk({"content": "Hi"}, "stop"), final])
    assert events[-2]["usage"] == usage(4, 39, created=2096)


@pytest.mark.parametrize("created", [None, "12", 1.5, -3, True, [12]])
def test_a_missing_or_malformed_cache_write_count_is_zero(created: Any) -> None:
    details = {"cached_tokens": 1024, "created_cache_tokens": created}
    final = {"choices": [], "usage": {**VLLM_CREATED_USAGE, "prompt_tokens_details": details}}
    events = run([ROLE, chunk({"content": "Hi"}, "stop"), final])
    assert events[-2]["usage"] == usage(1076, 39, cached=1024)


def test_a_later_chunk_without_the_count_keeps_the_one_reported() -> None:
    bare = {**VLLM_CREATED_USAGE, "prompt_tokens_details": {"cached_tokens": 1024}}
    first = chunk({"role": "assistant", "content": ""}, usage=VLLM_CREATED_USAGE)
    events = run([first, chunk({"content": "Hi"}, "stop"), {"choices": [], "usage": bare}])
    assert events[-2]["usage"] == usage(20, 39, cached=1024, created=1056)


def test_cache_counts_past_the_prompt_never_make_input_tokens_negative() -> None:
    details = {"cached_tokens": 1500, "created_cache_tokens": 900}  # 2400 of a 2100 prompt
    final = {"choices": [], "usage": {**VLLM_CREATED_USAGE, "prompt_tokens_details": details}}
    events = run([ROLE, chunk({"content": "Hi"}, "stop"), final])
    assert events[-2]["usage"] == usage(0, 39, cached=1500, created=600)


counts = st.integers(0, 5000)
maybe_counts = counts | st.none() | st.just("7") | st.just(2.0) | st.just(-1) | st.just(True)


@given(counts, maybe_counts, maybe_counts, st.booleans())
def test_the_prompt_split_adds_up_to_the_prompt_and_is_never_negative(
    prompt: int, cached: Any, created: Any, details_first: bool
) -> None:
    """Whatever the upstream puts in prompt_tokens_details, the three parts are counts that add
    up to the prompt, in every event that reports them and in the folded message."""
    reported = {
        "prompt_tokens": prompt,
        "completion_tokens": 5,
        "total_tokens": prompt + 5,
        "prompt_tokens_details": {"cached_tokens": cached, "created_cache_tokens": created},
    }
    first = chunk({"role": "assistant", "content": ""}, usage=reported if details_first else None)
    events = run([first, chunk({"content": "Hi"}, "stop"), {"choices": [], "usage": reported}])
    builder = MessageBuilder()
    builder.add(events)
    for split in (events[0]["message"]["usage"], events[-2]["usage"], builder.message()["usage"]):
        assert all(type(split[k]) is int and split[k] >= 0 for k in split), split
    final = events[-2]["usage"]
    assert sum(final[k] for k in PROMPT_USAGE) == prompt
    reads_and_writes = (final["cache_read_input_tokens"], final["cache_creation_input_tokens"])
    if all(type(v) is int and v >= 0 for v in (cached, created)) and cached + created <= prompt:
        assert reads_and_writes == (cached, created)  # a consistent report passes unchanged


def test_reasoning_is_dropped_when_the_model_shows_it_only_on_request() -> None:
    events = run(THINK_THEN_TEXT, show_reasoning=False)
    assert check_stream(events) == "complete"
    assert blocks(events) == [(0, "text")] and text_of(events, 0) == "Hello there"
    assert blocks(run(THINK_THEN_TEXT)) == [(0, "thinking"), (1, "text")]


def test_a_thinking_block_ends_with_an_empty_signature_delta_then_its_stop() -> None:
    events = run([ROLE, chunk({"reasoning": "hm"}), chunk({}, "length")])
    assert check_stream(events) == "complete"
    assert kinds(events)[2:5] == [
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
    ]
    assert events[3]["delta"] == {"type": "signature_delta", "signature": ""}
    builder = MessageBuilder()
    builder.add(events)
    assert builder.message()["content"] == [{"type": "thinking", "thinking": "hm", "signature": ""}]


# Surrogate pairs split across chunks: a JS server (`JSON.stringify`) writes each half of an
# emoji a token boundary split as its own `\u` escape, in its own chunk.
def decode(*frames: bytes) -> list[dict[str, Any]]:
    """What a client gets for these upstream frames, then [DONE], all encodable."""
    decoder = UpstreamDecoder(StreamTranslator(model="m", input_tokens=3))
    events = decoder.feed(b"".join(frames) + b"data: [DONE]\n\n") + decoder.eof("stub")
    for event in events:
        encode_event(event)
    return events


def test_an_emoji_split_across_two_content_chunks_is_joined() -> None:
    assert frame(chunk({"content": "\ud83d"})).count(b"\\ud83d") == 1  # as a JS server writes
    halves = [frame(chunk({"content": half})) for half in ("\ud83d", "\ude00")]
    events = decode(frame(ROLE), *halves, frame(chunk({}, "stop")))
    assert check_stream(events) == "complete"
    assert text_of(events, 0) == "\U0001f600"


@pytest.mark.parametrize("field", ["reasoning", "reasoning_content"])
def test_an_emoji_split_across_two_reasoning_chunks_is_joined(field: str) -> None:
    halves = [frame(chunk({field: half})) for half in ("so \ud83d", "\ude00!")]
    events = decode(frame(ROLE), *halves, frame(chunk({}, "stop")))
    assert check_stream(events) == "complete"
    assert blocks(events) == [(0, "thinking")] and text_of(events, 0) == "so \U0001f600!"


@pytest.mark.parametrize("name_first", [True, False])
def test_an_emoji_split_across_two_tool_argument_fragments_is_joined(name_first: bool) -> None:
    # Name last: the first half waits with the fragments held for the name.
    first, second = tool_args(0, '{"e": "\ud83d'), tool_args(0, '\ude00"}')
    order = [tool_head(0, "f"), first, second] if name_first else [first, tool_head(0, "f"), second]
    events = decode(*map(frame, [ROLE, *order, chunk({}, "tool_calls")]))
    assert check_stream(events) == "complete"
    assert text_of(events, 0) == '{"e": "\U0001f600"}'
    builder = MessageBuilder()
    builder.add(events)
    assert builder.message()["content"][0]["input"] == {"e": "\U0001f600"}


def test_a_lone_half_becomes_a_replacement_character_and_the_stream_goes_on() -> None:
    # The text after the high half takes the plain path: it is a vLLM-shaped event.
    high = frame(chunk({"content": "\ud83d"}))
    events = decode(frame(ROLE), high, vllm_event(b"content", b"abc"), frame(chunk({}, "stop")))
    assert check_stream(events) == "complete"
    assert text_of(events, 0) == "\ufffdabc"
    events = decode(frame(ROLE), frame(chunk({"content": "a\ude00b"})), frame(chunk({}, "stop")))
    assert text_of(events, 0) == "a\ufffdb"
    events = decode(
        frame(ROLE), frame(chunk({"content": "\ud83d\ud83d"})), frame(chunk({}, "stop"))
    )
    assert text_of(events, 0) == "\ufffd\ufffd"
    tool = frame(chunk({"tool_calls": [{"index": 0, "function": {"name": "f\udc00"}}]}))
    assert decode(frame(ROLE), tool)[1]["content_block"]["name"] == "f\ufffd"


def test_a_high_half_at_the_end_of_a_block_is_a_replacement_character_before_its_stop() -> None:
    events = decode(frame(ROLE), frame(chunk({"content": "a\ud83d"})), frame(chunk({}, "stop")))
    assert check_stream(events) == "complete"
    assert [e["delta"] for e in events if e["type"] == "content_block_delta"] == [
        {"type": "text_delta", "text": "a"},
        {"type": "text_delta", "text": "\ufffd"},
    ]
    assert kinds(events)[3:5] == ["content_block_delta", "content_block_stop"]
    # Closed by the next block, here a tool whose arguments end on a half too.
    events = decode(
        *map(
            frame,
            [
                ROLE,
                chunk({"reasoning": "\ud83d"}),
                tool_head(0, "f"),
                tool_args(0, '{"e": "\ud83d'),
                chunk({}, "tool_calls"),
            ],
        )
    )
    assert check_stream(events) == "complete"
    assert text_of(events, 0) == "\ufffd" and text_of(events, 1) == '{"e": "\ufffd'


def test_the_non_streaming_answer_has_the_joined_emoji() -> None:
    halves = [frame(chunk({"content": half})) for half in ("hi \ud83d", "\ude00")]
    builder = MessageBuilder()
    builder.add(decode(frame(ROLE), *halves, frame(chunk({}, "stop")), frame(USAGE)))
    assert builder.message()["content"] == [{"type": "text", "text": "hi \U0001f600"}]


def test_an_in_stream_error_with_a_lone_half_encodes() -> None:
    events = decode(frame(ROLE), frame({"error": {"message": "bad \ud83d", "code": 500}}))
    assert events[-1]["error"]["message"] == "upstream error: bad \ufffd"


def test_an_upstream_error_body_with_a_lone_half_gives_a_message_that_encodes() -> None:
    body = json.dumps({"error": {"message": "x\ud83d\ude00\ud83d"}}).encode()
    assert upstream_message(body) == "x\U0001f600\ufffd"
    assert upstream_message(json.dumps({"error": "\ude00"}).encode()) == "\ufffd"


@pytest.mark.parametrize(
    "line",
    [b'{"choices": NaN}', b'{"usage": -Infinity}', b"[" * 100_000, b'{"a": "\\ud83d'],
)
def test_what_is_not_json_stays_not_json(line: bytes) -> None:
    events = decode(frame(ROLE), b"data: " + line + b"\n\n")
    assert events[-1]["error"]["message"] == "upstream sent a line that is not JSON"


def utf16_units(text: str) -> list[str]:
    """`text` as UTF-16 code units, one string each: an astral character as its two halves."""
    data = text.encode("utf-16-le")
    return [chr(int.from_bytes(data[i : i + 2], "little")) for i in range(0, len(data), 2)]


astral_texts = st.text(
    st.characters(exclude_categories=("Cs",))
    | st.sampled_from(["\U0001f600", "\U0001f469", "\u200d", "\U00010348", "a", "\n"]),
    max_size=20,
)


@settings(max_examples=300)
@given(astral_texts, st.sampled_from(["content", "reasoning", "arguments"]), st.data())
def test_text_split_between_any_utf16_units_reassembles_exactly(
    text: str, field: str, data: st.DataObject
) -> None:
    units = utf16_units(text)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(units)), max_size=8)))
    pieces = ["".join(units[a:b]) for a, b in zip([0, *cuts], [*cuts, len(units)], strict=True)]
    if field == "arguments":
        frames = [frame(tool_head(0, "f")), *(frame(tool_args(0, p)) for p in pieces)]
    else:
        # In vLLM's layout, as JSON.stringify escapes a half: a piece with no `\u` escape takes
        # the plain path, the others the generic one.
        frames = [vllm_event(field.encode(), json.dumps(p)[1:-1].encode()) for p in pieces]
    stream = frame(ROLE) + b"".join(frames) + frame(chunk({}, "stop")) + b"data: [DONE]\n\n"
    byte_cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=8)))
    decoder = UpstreamDecoder(StreamTranslator(model="m", input_tokens=3))
    events = [
        event
        for a, b in zip([0, *byte_cuts], [*byte_cuts, len(stream)], strict=True)
        for event in decoder.feed(stream[a:b])
    ] + decoder.eof("stub")
    for event in events:
        encode_event(event)
    assert check_stream(events) == "complete"
    assert text_of(events, 0) == text


def test_a_count_past_what_json_writes_back_is_ignored() -> None:
    """An upstream's usage of 2e19 tokens would make every later frame unwritable (orjson
    refuses integers past 64 bits): it is no count. A lone surrogate sends the chunk to the
    standard library's decoder, which reads it as an int (orjson, as a float)."""
    usage = (b"3", b"20000000000000000003", b"20000000000000000000")
    stream = vllm_event(b"content", b"\\ud83d", usage) + b"data: [DONE]\n\n"
    by_byte, whole, _ = by_byte_and_whole(stream)
    assert by_byte == whole
    assert b"20000000000000000000" not in whole
