"""What the status page shows, as one JSON-ready dict built from plain inputs (sans-IO).

`build` takes the `/llm/v1/status` document as it is (whatever fields it has: a field added
there, such as an upstream's health, reaches the page without a change here), the requests in
flight and the last finished ones, and returns the snapshot the page renders. It reads no clock
and holds no state, so it is tested on plain numbers.

Its size does not grow with the line: the waiters are counts (per class, per client), the
per-client counts are cut to the `top_clients` largest plus one "others" row, and the requests
in flight are the ones past the line (holding a slot), at most `max_rows` of them. It carries
no key, no prompt and no answer: a `RequestRecord` holds none, and only the fields named below
are copied out of one.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from homelab_gateway.core.record import RequestRecord

TOP_CLIENTS = 8
MAX_ROWS = 100
CLIENTS_FIELD = "waiting_by_client"


def top_clients(counts: Mapping[str, int], limit: int = TOP_CLIENTS) -> list[dict[str, Any]]:
    """The `limit` clients with the most waiters (ties by name), then one row for the rest:
    `{"others": k, "count": n}`, k clients with n waiters between them."""
    ranked = sorted(counts.items(), key=lambda item: (-item[1], item[0]))
    rows: list[dict[str, Any]] = [{"client": c, "count": n} for c, n in ranked[:limit]]
    rest = ranked[limit:]
    if rest:
        rows.append({"others": len(rest), "count": sum(n for _, n in rest)})
    return rows


def _line(entry: Mapping[str, Any], limit: int) -> dict[str, Any]:
    """A copy of a status entry whose per-client counts are cut to `top_clients` rows."""
    out = dict(entry)
    counts = out.get(CLIENTS_FIELD)
    if isinstance(counts, Mapping):
        out[CLIENTS_FIELD] = top_clients(counts, limit)
    return out


def _model(record: RequestRecord) -> str:
    """The configured model that took the request (never the client's string, which may be
    anything), `unknown` for a name no model serves, empty where none was asked for."""
    return record.served_model or ("unknown" if record.model else "")


def _rate(tokens: int | None, seconds: float) -> float | None:
    return round(tokens / seconds, 1) if tokens and seconds > 0 else None


def _first_token_at(record: RequestRecord) -> float | None:
    """When the first token came, from the record's durations: the request's start plus its
    wait plus its time to first token (what resolving the body took before the wait is left
    out: milliseconds)."""
    if record.first_token is None:
        return None
    return record.started + (record.queue_wait or 0.0) + record.first_token


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def _about(record: RequestRecord) -> dict[str, Any]:
    """What a row says of any request, in flight or finished."""
    return {
        "request_id": record.request_id,
        "surface": record.surface,
        "model": _model(record),
        "upstream": record.upstream,
        "client": record.client,
        "class": record.served_as or record.priority,
        "stream": record.stream,
    }


def in_flight_row(record: RequestRecord, now: float) -> dict[str, Any]:
    first = _first_token_at(record)
    return {
        **_about(record),
        "elapsed_s": _round(now - record.started),
        "queue_wait_s": _round(record.queue_wait),
        "ttft_s": _round(record.first_token),
        "output_tokens": record.output_tokens or 0,
        "tokens_per_s": None if first is None else _rate(record.output_tokens, now - first),
    }


def finished_row(record: RequestRecord, ended: float) -> dict[str, Any]:
    first = _first_token_at(record)
    return {
        **_about(record),
        "ended": round(ended, 3),
        "outcome": record.outcome or "completed",
        "status": record.status,
        "duration_s": _round(ended - record.started),
        "queue_wait_s": _round(record.queue_wait),
        "ttft_s": _round(record.first_token),
        "input_tokens": record.input_tokens,
        "output_tokens": record.output_tokens,
        "tokens_per_s": None if first is None else _rate(record.output_tokens, ended - first),
    }


def build(
    *,
    now: float,
    started: float,
    version: str,
    status: Mapping[str, Any],
    longest_wait: Mapping[str, float],
    in_flight: Iterable[RequestRecord],
    finished: Iterable[tuple[RequestRecord, float]],
    top: int = TOP_CLIENTS,
    max_rows: int = MAX_ROWS,
) -> dict[str, Any]:
    """The page's snapshot at `now` (seconds, the clock `started` and the records use).

    - `status`: the `/llm/v1/status` document; each upstream entry (its `models` included)
      and each entry of its top-level `models` map is passed on with its per-client counts cut.
    - `longest_wait`: upstream -> how long its oldest waiter has waited, for those with one.
    - `in_flight`: every request being handled; those past the line (a slot granted) are rows,
      oldest first. Waiters are not rows: they are the counts.
    - `finished`: (record, when it ended) of the last finished requests, oldest first; the
      snapshot lists them newest first.
    """
    upstreams: dict[str, Any] = {}
    for name, entry in (status.get("upstreams") or {}).items():
        line = _line(entry, top)
        line["longest_wait_s"] = _round(longest_wait.get(name))
        upstreams[name] = line
    snapshot: dict[str, Any] = {
        "version": version,
        "now": round(now, 3),
        "uptime_s": round(now - started, 1),
        "upstreams": upstreams,
    }
    clients = status.get("clients")
    if isinstance(clients, Mapping):  # those with a max_in_flight or a tokens_per_day
        snapshot["clients"] = dict(clients)
    cluster = status.get("cluster")
    if isinstance(cluster, Mapping):  # lines shared through Redis: this gateway and its link
        snapshot["cluster"] = dict(cluster)
    boxes = status.get("boxes")
    if isinstance(boxes, Mapping):  # models loaded on demand: each box's memory and models
        snapshot["boxes"] = dict(boxes)
    lines = status.get("models")
    if isinstance(lines, Mapping):
        snapshot["models"] = {
            name: _line(entry, top) if isinstance(entry, Mapping) else entry
            for name, entry in lines.items()
        }
    past_the_line = sorted(
        (r for r in in_flight if r.queue_wait is not None), key=lambda r: r.started
    )
    snapshot["in_flight"] = [in_flight_row(r, now) for r in past_the_line[:max_rows]]
    snapshot["in_flight_total"] = len(past_the_line)
    snapshot["finished"] = [finished_row(r, ended) for r, ended in reversed(list(finished))]
    return snapshot
