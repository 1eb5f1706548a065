"""The usage ledger's core (sans-IO): buckets, the endpoint's query, rows and their CSV."""

from __future__ import annotations

import csv
import io
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from homelab_gateway.core.record import RequestRecord
from homelab_gateway.core.usage import (
    GROUPS,
    SUMS,
    Buckets,
    InvalidQuery,
    UsageQuery,
    fold,
    group,
    hour_of,
    iso_hour,
    key_of,
    parse_query,
    render_csv,
)

NOON = 1_796_212_800  # 2026-12-02T12:00:00Z


def record(surface: str = "messages", **fields: Any) -> RequestRecord:
    defaults: dict[str, Any] = {"served_model": "reasoning", "client": "alice"}
    return RequestRecord(request_id="req_1", surface=surface, started=0.0, **{**defaults, **fields})


def test_a_record_folds_into_its_hour_with_every_sum() -> None:
    buckets: Buckets = {}
    done = record(
        input_tokens=120, output_tokens=30, cached_tokens=64, slot_seconds=1.5, queue_wait=0.25
    )
    fold(buckets, done, NOON + 59 * 60)
    fold(buckets, done, NOON + 10)
    key = ("alice", "reasoning", "messages", NOON, "completed")
    assert buckets == {key: [2, 240, 60, 128, 3.0, 0.5]}


def test_outcomes_keep_buckets_of_their_own_and_unknown_counts_are_zero() -> None:
    buckets: Buckets = {}
    fold(buckets, record(outcome="client_gone"), NOON)
    fold(buckets, record(), NOON)
    assert buckets[("alice", "reasoning", "messages", NOON, "client_gone")] == [1, 0, 0, 0, 0, 0]
    assert len(buckets) == 2


@pytest.mark.parametrize(
    "done",
    [
        record("proxy"),
        record("count_tokens"),
        record(served_model=None),  # refused before it named a served model
    ],
)
def test_what_the_ledger_leaves_out(done: RequestRecord) -> None:
    assert key_of(done, NOON) is None


@pytest.mark.parametrize("surface", ["messages", "chat", "completions", "embeddings", "responses"])
def test_every_llm_surface_counts(surface: str) -> None:
    assert key_of(record(surface), NOON) == ("alice", "reasoning", surface, NOON, "completed")


def args(**values: str) -> dict[bytes, list[bytes]]:
    return {name.encode(): [value.encode()] for name, value in values.items()}


def test_the_query_defaults() -> None:
    assert parse_query({}) == UsageQuery(since=None, until=None, client=None, by=("client",))


@pytest.mark.parametrize(
    "text",
    [
        str(NOON),
        f"{NOON}.0",
        "2026-12-02T12:00:00Z",
        "2026-12-02T12:00:00",
        "2026-12-02T13:00:00+01:00",
        "2026-12-02 12:00",
    ],
)
def test_moments_in_unix_seconds_or_iso_8601_utc(text: str) -> None:
    assert parse_query(args(since=text)).since == NOON


def test_a_date_is_its_midnight_utc() -> None:
    assert parse_query(args(until="2026-12-02")).until == NOON - 12 * 3600


def test_by_takes_several_fields_and_lists_them_in_row_order() -> None:
    query = parse_query(args(by="hour,client,model", client="bob", format="csv"))
    assert (query.by, query.client, query.format) == (("client", "model", "hour"), "bob", "csv")


@pytest.mark.parametrize(
    ("given", "param"),
    [
        (args(since="yesterday"), "since"),
        (args(until="nan"), "until"),
        (args(since="1e19"), "since"),
        (args(until="1e19"), "until"),
        (args(since="-1e19"), "since"),
        (args(since="1e300"), "since"),
        (args(until="inf"), "until"),
        (args(since=str(NOON), until=str(NOON)), "until"),
        (args(by="client,outcome"), "by"),
        (args(by=""), "by"),
        (args(format="xml"), "format"),
        (args(group="client"), "group"),
        ({b"client": [b"a", b"b"]}, "client"),
        ({b"client": [b"\xff"]}, "client"),
    ],
)
def test_a_bad_parameter_is_named(given: dict[bytes, list[bytes]], param: str) -> None:
    with pytest.raises(InvalidQuery) as raised:
        parse_query(given)
    assert raised.value.param == param
    assert str(raised.value).startswith(f"{param}: ")


def test_the_hours_a_range_overlaps() -> None:
    query = UsageQuery(since=NOON + 1800, until=NOON + 3600 + 1)
    assert query.hours() == (NOON, NOON + 2 * 3600)
    assert UsageQuery(until=NOON).hours() == (None, NOON)


def test_rows_are_grouped_sorted_and_their_hour_is_iso() -> None:
    buckets: Buckets = {
        ("bob", "m", "chat", NOON, "completed"): [1, 10, 5, 0, 0.5, 0.0],
        ("alice", "m", "messages", NOON + 3600, "completed"): [2, 20, 6, 4, 1.0, 0.1],
        ("alice", "m", "messages", NOON, "upstream_error"): [1, 7, 0, 0, 0.25, 0.2],
    }
    assert group(buckets, ("client",)) == [
        {"client": "alice", **dict(zip(SUMS, [3, 27, 6, 4, 1.25, 0.3], strict=True))},
        {"client": "bob", **dict(zip(SUMS, [1, 10, 5, 0, 0.5, 0.0], strict=True))},
    ]
    hours = group(buckets, ("hour",))
    assert [row["hour"] for row in hours] == ["2026-12-02T12:00:00Z", "2026-12-02T13:00:00Z"]
    assert [row["requests"] for row in hours] == [2, 2]


def test_csv_has_a_header_row_of_the_field_names() -> None:
    buckets: Buckets = {("alice", "m", "chat", NOON, "completed"): [1, 10, 5, 2, 0.5, 0.0]}
    text = render_csv(group(buckets, ("client", "hour")), ("client", "hour")).decode()
    assert list(csv.reader(io.StringIO(text))) == [
        ["client", "hour", *SUMS],
        ["alice", "2026-12-02T12:00:00Z", "1", "10", "5", "2", "0.5", "0.0"],
    ]


def test_an_hour_starts_on_the_hour() -> None:
    assert hour_of(NOON + 3599.9) == NOON
    assert iso_hour(NOON) == "2026-12-02T12:00:00Z"


sums = st.tuples(
    st.integers(0, 10**6), st.integers(0, 10**6), st.integers(0, 10**6), st.integers(0, 10**6)
)
records = st.lists(
    st.tuples(
        st.sampled_from(["alice", "bob", "10.0.0.1"]),
        st.sampled_from(["reasoning", "coder"]),
        st.sampled_from(["messages", "chat", "responses"]),
        st.integers(0, 5 * 3600),
        st.sampled_from([None, "client_gone", "upstream_error"]),
        sums,
    ),
    max_size=40,
)


@given(records, st.sets(st.sampled_from(GROUPS), min_size=1))
def test_grouping_keeps_every_total(given: list[Any], by: set[str]) -> None:
    buckets: Buckets = {}
    for client, model, surface, offset, outcome, (tokens_in, tokens_out, cached, ms) in given:
        done = record(
            surface,
            client=client,
            served_model=model,
            outcome=outcome,
            input_tokens=tokens_in,
            output_tokens=tokens_out,
            cached_tokens=cached,
            slot_seconds=ms / 1000,
        )
        fold(buckets, done, NOON + offset)
    fields = tuple(name for name in GROUPS if name in by)
    rows = group(buckets, fields)
    assert sum(row["requests"] for row in rows) == len(given)
    for index, name in enumerate(("input_tokens", "output_tokens", "cached_tokens")):
        assert sum(row[name] for row in rows) == sum(g[5][index] for g in given)
    assert sum(row["slot_seconds"] for row in rows) == pytest.approx(
        sum(g[5][3] / 1000 for g in given), abs=0.001 * (len(rows) + 1)
    )
    keys = [tuple(row[name] for name in fields) for row in rows]
    assert keys == sorted(set(keys)), "one row per group, in order"


def test_a_request_answered_with_an_error_status_counts_with_no_tokens() -> None:
    buckets: Buckets = {}
    tokens = {"input_tokens": 262_145, "output_tokens": 0, "slot_seconds": 0.1}
    fold(buckets, record(status=400, outcome="bad_request", **tokens), NOON)
    fold(buckets, record(status=None, outcome="client_disconnected", **tokens), NOON)
    fold(buckets, record(status=200, **tokens), NOON)
    assert [sums[:3] for sums in buckets.values()] == [[1, 0, 0], [1, 262_145, 0], [1, 262_145, 0]]
