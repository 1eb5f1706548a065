"""The SSE parser and writer: the grammar, byte-split anywhere, every line ending."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from homelab_gateway.core.sse import (
    MAX_EVENT_BYTES,
    EventTooLarge,
    ServerSentEvent,
    SSEParser,
    encode_event,
)


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
    from homelab_gateway.surfaces.stream import QUEUE_FRAME

    for position in (1, 7, 12345):
        assert QUEUE_FRAME % position == encode_event({"type": "queue", "position": position})


@given(st.integers(1, 10**6), st.floats(0, 10**7, allow_nan=False))
def test_the_estimated_queue_frame_template_is_what_encode_event_writes(
    position: int, estimate: float
) -> None:
    from homelab_gateway.surfaces.stream import ESTIMATED_QUEUE_FRAME

    frame = {"type": "queue", "position": position, "estimated_wait_s": round(estimate, 1)}
    assert ESTIMATED_QUEUE_FRAME % (position, estimate) == encode_event(frame)


def test_a_line_without_end_is_refused_past_the_limit() -> None:
    parser = SSEParser(limit=100)
    assert parser.feed(b"data: ok\n\ndata: " + b"x" * 50) == [ServerSentEvent("ok")]
    try:
        parser.feed(b"x" * 60)
    except EventTooLarge as e:
        assert e.events == []
    else:
        raise AssertionError("a 116-byte line passed a 100-byte limit")


def test_the_events_before_an_overlong_line_in_the_same_read_are_kept() -> None:
    parser = SSEParser(limit=100)
    try:
        parser.feed(b"data: a\n\ndata: b\n\ndata: " + b"y" * 200 + b"\n\n")
    except EventTooLarge as e:
        assert e.events == [ServerSentEvent("a"), ServerSentEvent("b")]
    else:
        raise AssertionError("a 206-byte line passed a 100-byte limit")


def test_many_data_lines_are_bounded_as_one_event() -> None:
    parser = SSEParser(limit=100)
    try:
        for _ in range(30):
            parser.feed(b"data: 0123456789\n")
    except EventTooLarge:
        pass
    else:
        raise AssertionError("300 bytes of one event's data passed a 100-byte limit")


def test_the_default_limit_is_a_few_megabytes() -> None:
    assert 1024 * 1024 <= MAX_EVENT_BYTES <= 8 * 1024 * 1024


def test_a_long_line_in_small_reads_is_buffered_in_linear_time() -> None:
    """1 MB in 1-byte reads: quadratic re-copying would move ~500 GB; a list of reads moves
    each byte once. Counted in bytes copied, not seconds, so a busy machine cannot fail it."""
    copied = 0

    class Counting(bytes):
        def __add__(self, other: bytes) -> bytes:  # what a concatenating buffer would do
            nonlocal copied
            copied += len(self) + len(other)
            return bytes.__add__(self, other)

        def __radd__(self, other: bytes) -> bytes:
            nonlocal copied
            copied += len(self) + len(other)
            return other.__add__(self)

    parser = SSEParser()
    parser.feed(b"data: ")
    for _ in range(20_000):
        parser.feed(Counting(b"x" * 50))
    assert copied == 0
    assert parser.feed(b"\n\n") == [ServerSentEvent("x" * 1_000_000)]


@given(
    st.binary(max_size=300),
    st.integers(1, 120),
    st.lists(st.integers(0, 300), max_size=8),
)
def test_the_limit_fails_the_same_wherever_the_stream_is_split(
    blob: bytes, limit: int, cuts: list[int]
) -> None:
    """Split anywhere, the stream either parses to the same events as in one read, or is
    refused; and a refusal never comes before the line that overflowed could have completed."""
    points = sorted(c for c in cuts if c <= len(blob))
    chunks = [blob[a:b] for a, b in zip([0, *points], [*points, len(blob)], strict=True)]
    whole = SSEParser(limit=limit * 4)
    split = SSEParser(limit=limit * 4)
    try:
        expected = whole.feed(blob)
    except EventTooLarge:
        expected = None
    got: list[ServerSentEvent] = []
    try:
        for chunk in chunks:
            got.extend(split.feed(chunk))
    except EventTooLarge as e:
        got.extend(e.events)
        if expected is not None:
            # Refused in pieces but not at once: only an unended tail can do that.
            assert got == expected[: len(got)]
            return
    if expected is not None:
        assert got == expected


def test_an_overlong_upstream_line_fails_the_stream_with_an_error_event() -> None:
    from homelab_gateway.core.translator import StreamTranslator, UpstreamDecoder

    decoder = UpstreamDecoder(StreamTranslator(model="m", input_tokens=1))
    first = b'data: {"choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n'
    events = decoder.feed(first + b"data: " + b"x" * (MAX_EVENT_BYTES + 1))
    assert [e["type"] for e in events][-1] == "error"
    assert "content_block_delta" in [e["type"] for e in events]
    assert decoder.feed(b"more\n\n") == []


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
