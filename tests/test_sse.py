"""The SSE parser and writer: the grammar, byte-split anywhere, every line ending."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from homelab_gateway.sse import ServerSentEvent, SSEParser, encode_event


def parse_all(chunks: list[bytes]) -> list[ServerSentEvent]:
    parser = SSEParser()
    events = []
    for chunk in chunks:
        events.extend(parser.feed(chunk))
    return events


def test_data_only_frames_as_vllm_sends_them() -> None:
    stream = b'data: {"a": 1}\n\ndata: [DONE]\n\n'
    assert parse_all([stream]) == [ServerSentEvent('{"a": 1}'), ServerSentEvent("[DONE]")]


def test_named_events_ids_and_multiline_data() -> None:
    stream = b"event: ping\nid: 7\ndata: one\ndata: two\n\n"
    assert parse_all([stream]) == [ServerSentEvent("one\ntwo", event="ping", id="7")]


def test_comments_and_unknown_fields_are_ignored() -> None:
    stream = b": keep-alive\nretry: 10\nfoo: bar\ndata: x\n\n:another\n\n"
    assert parse_all([stream]) == [ServerSentEvent("x")]


def test_crlf_and_lone_cr_line_ends() -> None:
    assert parse_all([b"data: a\r\n\r\ndata: b\r\rdata: c\n\n"]) == [
        ServerSentEvent("a"),
        ServerSentEvent("b"),
        ServerSentEvent("c"),
    ]


def test_crlf_split_between_reads_is_one_line_end() -> None:
    assert parse_all([b"data: a\r", b"\n", b"\r", b"\n"]) == [ServerSentEvent("a")]
    # A lone LF read after a CRLF's LF was consumed is a real blank line.
    assert parse_all([b"data: a\r", b"\n", b"\n"]) == [ServerSentEvent("a")]


def test_space_after_colon_is_optional_and_only_one_is_stripped() -> None:
    assert parse_all([b"data:x\n\ndata:  y\n\n"]) == [ServerSentEvent("x"), ServerSentEvent(" y")]


def test_incomplete_event_at_end_is_not_dispatched() -> None:
    assert parse_all([b"data: partial"]) == []
    assert parse_all([b"data: partial\n"]) == []


def test_utf8_split_inside_a_character() -> None:
    data = "data: h\u00e9llo \u2603\n\n".encode()
    assert parse_all([data[:9], data[9:]]) == [ServerSentEvent("h\u00e9llo \u2603")]


def test_bom_at_start_is_skipped() -> None:
    assert parse_all([b"\xef\xbb\xbfdata: x\n\n"]) == [ServerSentEvent("x")]


def test_encode_event_names_the_frame_after_its_type() -> None:
    frame = encode_event({"type": "content_block_delta", "text": "line\nbreak \u00e9"})
    name, data, end = frame.split(b"\n", 2)
    assert name == b"event: content_block_delta"
    assert json.loads(data[len(b"data: ") :]) == {
        "type": "content_block_delta",
        "text": "line\nbreak \u00e9",
    }
    assert end == b"\n"


payloads = st.lists(
    st.text(
        alphabet=st.characters(blacklist_characters="\r\n", blacklist_categories=("Cs",)),
        max_size=30,
    ),
    min_size=1,
    max_size=8,
)


@given(payloads, st.sampled_from([b"\n", b"\r\n", b"\r"]), st.data())
def test_any_split_and_any_line_end_give_the_same_events(
    texts: list[str], newline: bytes, data: st.DataObject
) -> None:
    stream = b"".join(
        b": comment" + newline + b"data: " + text.encode() + newline + newline for text in texts
    )
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=10)))
    chunks = [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)], strict=True)]
    expected = [ServerSentEvent(t) for t in texts]  # "data: " loses its one space, no more
    assert parse_all(chunks) == expected


@given(st.binary(max_size=200), st.data())
def test_garbage_never_raises_and_splitting_changes_nothing(
    blob: bytes, data: st.DataObject
) -> None:
    cut = data.draw(st.integers(0, len(blob)))
    assert parse_all([blob[:cut], blob[cut:]]) == parse_all([blob])


def test_the_queue_frame_template_is_what_encode_event_writes() -> None:
    from homelab_gateway.llm import QUEUE_FRAME

    for position in (1, 7, 12345):
        assert QUEUE_FRAME % position == encode_event({"type": "queue", "position": position})


sse_lines = st.lists(
    st.one_of(
        st.just(b""),
        st.sampled_from(
            [b"data", b"data:", b"data: ", b"data:  ", b"event: ", b"id: ", b":", b"x: "]
        )
        .flatmap(lambda head: st.binary(max_size=12).map(lambda tail: head + tail))
        .filter(lambda line: b"\n" not in line and b"\r" not in line),
    ),
    max_size=30,
)


@given(sse_lines, st.data())
def test_reads_of_whole_lines_parse_as_byte_by_byte(
    lines: list[bytes], data: st.DataObject
) -> None:
    """Whole LF-terminated lines take the parser's fast path: it must agree with the slow one."""
    cuts = sorted(set(data.draw(st.lists(st.integers(0, len(lines)), max_size=6))))
    reads = [
        b"".join(line + b"\n" for line in lines[a:b])
        for a, b in zip([0, *cuts], [*cuts, len(lines)], strict=True)
    ]
    stream = b"".join(reads)
    assert parse_all(reads) == parse_all([stream[i : i + 1] for i in range(len(stream))])
