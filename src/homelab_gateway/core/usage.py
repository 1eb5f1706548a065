"""Who used what: finished requests folded into hourly buckets, and `/llm/v1/usage`'s answer.

A bucket is one client's requests to one model on one surface in one hour with one outcome,
and holds their sums. `Ledger` (ledger.py) folds each finished request's record into buckets
in memory and writes them to SQLite; this module holds what needs no I/O: the key, the
folding, the endpoint's query, its rows and their CSV.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, TypeVar

from homelab_gateway.core.record import RequestRecord
from homelab_gateway.core.surfaces import SURFACES as TABLE

HOUR = 3600
SURFACES = frozenset(row.name for row in TABLE if row.counted)
"""The LLM surfaces the ledger counts: not count_tokens (it generates nothing) nor proxy."""
GROUPS = ("client", "model", "surface", "hour")
"""What rows can be grouped by (`by`), in the order a row lists them."""
SUMS = (
    "requests",
    "input_tokens",
    "output_tokens",
    "cached_tokens",
    "slot_seconds",
    "wait_seconds",
)
"""What a bucket and a row sum, in the order a row lists them."""
SECONDS_DIGITS = 3  # of slot_seconds and wait_seconds in an answer

Key = tuple[str, str, str, int, str]
"""A bucket's key: client, model, surface, hour (its start, in unix seconds), outcome."""
Buckets = dict[Key, list[float]]
"""Buckets by key, each its sums in `SUMS`' order (tokens and requests stay ints)."""
K = TypeVar("K")


def hour_of(at: float) -> int:
    """The start of the hour `at` is in, in unix seconds."""
    return int(at // HOUR) * HOUR


def counted(record: RequestRecord) -> bool:
    """Whether the ledger counts a finished request: not if it is on no LLM surface, nor if
    it has no served model (refused before it named one)."""
    return record.surface in SURFACES and record.served_model is not None


def charged(record: RequestRecord) -> bool:
    """Whether a finished request's tokens count (ledger, quota, metrics): only if it held a
    slot and was not answered with an error status. One refused before a slot has only an
    estimate of its prompt, and one the upstream (or the gateway) refused with an error
    produced no token, whatever its prompt's size; a client that left mid-answer has no
    status, and pays for what the upstream did."""
    return record.slot_seconds is not None and (record.status is None or record.status < 400)


def key_of(record: RequestRecord, at: float) -> Key | None:
    """The bucket of a request that finished at `at`; None for one the ledger leaves out."""
    if not counted(record):
        return None
    assert record.served_model is not None
    outcome = record.outcome or "completed"
    return (record.client, record.served_model, record.surface, hour_of(at), outcome)


def sums_of(record: RequestRecord) -> list[float]:
    """A request's sums; its tokens only where they are `charged`."""
    ran = charged(record)
    return [
        1,
        (record.input_tokens or 0) if ran else 0,
        (record.output_tokens or 0) if ran else 0,
        (record.cached_tokens or 0) if ran else 0,
        record.slot_seconds or 0.0,
        record.queue_wait or 0.0,
    ]


def fold(buckets: Buckets, record: RequestRecord, at: float) -> None:
    """Add a request that finished at `at` to its bucket, if the ledger counts it."""
    key = key_of(record, at)
    if key is not None:
        add(buckets, key, sums_of(record))


def add(buckets: dict[K, list[float]], key: K, sums: Sequence[float]) -> None:
    """Add `sums` to the bucket at `key`, a new one if there is none."""
    into = buckets.get(key)
    if into is None:
        buckets[key] = list(sums)
    else:
        for i, value in enumerate(sums):
            into[i] += value


class InvalidQuery(ValueError):
    """A parameter of `/llm/v1/usage` the gateway cannot answer; `param` names it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


@dataclass(frozen=True)
class UsageQuery:
    """What `/llm/v1/usage` was asked: the hours that overlap [since, until) (either end open
    where None), one client or all, the grouping fields (in `GROUPS`' order) and the format."""

    since: float | None = None
    until: float | None = None
    client: str | None = None
    by: tuple[str, ...] = ("client",)
    format: str = "json"

    def hours(self) -> tuple[int | None, int | None]:
        """The first hour in range and the first one past it, for a store's range query."""
        first = hour_of(self.since) if self.since is not None else None
        past = None
        if self.until is not None:
            past = hour_of(self.until) + (0 if self.until % HOUR == 0 else HOUR)
        return first, past


PARAMETERS = ("since", "until", "client", "by", "format")
FIRST_MOMENT = datetime.min.replace(tzinfo=UTC).timestamp()
LAST_MOMENT = datetime.max.replace(tzinfo=UTC).timestamp()
FORMATS = ("json", "csv")


def parse_query(args: Mapping[bytes, Sequence[bytes]]) -> UsageQuery:
    """The query string's parameters (twisted.web's `request.args`) as a `UsageQuery`."""
    values: dict[str, str] = {}
    for raw, given in args.items():
        name = raw.decode("utf-8", "replace")
        if name not in PARAMETERS:
            raise InvalidQuery(name, f"unknown parameter (known: {', '.join(PARAMETERS)})")
        if len(given) != 1:
            raise InvalidQuery(name, "given more than once")
        try:
            values[name] = given[0].decode("utf-8")
        except UnicodeDecodeError:
            raise InvalidQuery(name, "is not UTF-8") from None
    since = _moment("since", values["since"]) if "since" in values else None
    until = _moment("until", values["until"]) if "until" in values else None
    if since is not None and until is not None and until <= since:
        raise InvalidQuery("until", "must be later than since")
    fmt = values.get("format", "json")
    if fmt not in FORMATS:
        raise InvalidQuery("format", f"must be json or csv, got {fmt!r}")
    return UsageQuery(
        since=since,
        until=until,
        client=values.get("client"),
        by=_groups(values.get("by", "client")),
        format=fmt,
    )


def _moment(name: str, text: str) -> float:
    """Unix seconds, or an ISO 8601 date or date and time (UTC unless it says otherwise); in
    the years 1 to 9999, as a date can be written (and an hour fits SQLite's integers)."""
    try:
        seconds = float(text)
    except ValueError:
        pass
    else:
        if not FIRST_MOMENT <= seconds <= LAST_MOMENT:  # NaN too
            raise InvalidQuery(name, f"must be unix seconds in the years 1 to 9999, got {text!r}")
        return seconds
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise InvalidQuery(
            name, f"must be unix seconds or an ISO 8601 date or time, got {text!r}"
        ) from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return moment.timestamp()


def _groups(text: str) -> tuple[str, ...]:
    names = [name.strip() for name in text.split(",")]
    for name in names:
        if name not in GROUPS:
            raise InvalidQuery("by", f"must be one or more of {','.join(GROUPS)}, got {text!r}")
    return tuple(name for name in GROUPS if name in names)


def group(buckets: Mapping[Key, Sequence[float]], by: Sequence[str]) -> list[dict[str, Any]]:
    """One row per value of the `by` fields, with the sums of its buckets, sorted by those
    fields; `hour` as ISO 8601 UTC."""
    at = [GROUPS.index(name) for name in by]
    totals: dict[tuple[Any, ...], list[float]] = {}
    for key, sums in buckets.items():
        add(totals, tuple(key[i] for i in at), sums)
    rows = []
    for fields in sorted(totals):
        row: dict[str, Any] = dict(zip(by, fields, strict=True))
        if "hour" in row:
            row["hour"] = iso_hour(row["hour"])
        for name, value in zip(SUMS, totals[fields], strict=True):
            row[name] = round(value, SECONDS_DIGITS) if name.endswith("seconds") else value
        rows.append(row)
    return rows


def iso_hour(hour: int) -> str:
    return datetime.fromtimestamp(hour, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def render_csv(rows: list[dict[str, Any]], by: Sequence[str]) -> bytes:
    """The rows under a header row of their field names."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\r\n")
    names = [*by, *SUMS]
    writer.writerow(names)
    for row in rows:
        writer.writerow([row[name] for name in names])
    return out.getvalue().encode()
