"""The status page's snapshot (sans-IO): bounded whatever the line, nothing secret, fields kept."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from homelab_gateway.core import snapshot
from homelab_gateway.core.record import RequestRecord


def record(request_id: str = "req_1", started: float = 100.0, **fields: Any) -> RequestRecord:
    return RequestRecord(request_id=request_id, surface="messages", started=started, **fields)


def status(**entry: Any) -> dict[str, Any]:
    line = {
        "models": ["reasoning"],
        "slots": 2,
        "in_use": 1,
        "waiting": 0,
        "waiting_by_class": {"interactive": 0, "normal": 0, "batch": 0},
        "waiting_by_client": {},
    }
    return {"upstreams": {"vllm": {**line, **entry}}}


def build(**overrides: Any) -> dict[str, Any]:
    arguments: dict[str, Any] = {
        "now": 200.0,
        "started": 50.0,
        "version": "1.2.3",
        "status": status(),
        "longest_wait": {},
        "in_flight": [],
        "finished": [],
    }
    return snapshot.build(**{**arguments, **overrides})


class TestTopClients:
    def test_the_largest_first_then_one_row_for_the_rest(self) -> None:
        counts = {"a": 1, "b": 5, "c": 3, "d": 3, "e": 2}
        assert snapshot.top_clients(counts, 3) == [
            {"client": "b", "count": 5},
            {"client": "c", "count": 3},
            {"client": "d", "count": 3},
            {"others": 2, "count": 3},
        ]

    def test_no_others_row_when_all_fit(self) -> None:
        assert snapshot.top_clients({"a": 2, "b": 1}, 2) == [
            {"client": "a", "count": 2},
            {"client": "b", "count": 1},
        ]

    @given(st.dictionaries(st.text(max_size=8), st.integers(1, 10_000)), st.integers(1, 20))
    def test_bounded_and_nothing_lost(self, counts: dict[str, int], limit: int) -> None:
        rows = snapshot.top_clients(counts, limit)
        assert len(rows) <= limit + 1
        assert sum(row["count"] for row in rows) == sum(counts.values())
        shown = {row["client"]: row["count"] for row in rows if "client" in row}
        assert list(shown.values()) == sorted(shown.values(), reverse=True)
        least = min(shown.values(), default=None)
        assert all(least is not None and n <= least for c, n in counts.items() if c not in shown)


class TestBuild:
    def test_upstream_fields_pass_through_with_models_and_longest_wait(self) -> None:
        document = status(health="down", down_since=123.0, last_error="connection refused")
        snap = build(status=document, longest_wait={"vllm": 4.25})
        entry = snap["upstreams"]["vllm"]
        assert (entry["health"], entry["down_since"], entry["last_error"]) == (
            "down",
            123.0,
            "connection refused",
        )
        assert entry["models"] == ["reasoning"]
        assert entry["longest_wait_s"] == 4.25
        assert (snap["version"], snap["uptime_s"]) == ("1.2.3", 150.0)

    def test_an_upstreams_models_are_passed_on(self) -> None:
        snap = build(status=status(models=["a", "b"]))
        assert snap["upstreams"]["vllm"]["models"] == ["a", "b"]

    def test_a_shared_lines_link_is_shown_only_where_there_is_one(self) -> None:
        assert "cluster" not in build()
        document = status()
        document["cluster"] = {"instance": "gw-a/1f2e", "redis": "down", "last_error": "refused"}
        assert build(status=document)["cluster"] == document["cluster"]

    def test_a_top_level_models_map_is_passed_on_with_its_clients_cut(self) -> None:
        document = status()
        clients = {f"c{i}": 1 for i in range(20)}
        document["models"] = {"reasoning": {"waiting": 20, "waiting_by_client": clients}}
        snap = build(status=document, top=3)
        rows = snap["models"]["reasoning"]["waiting_by_client"]
        assert len(rows) == 4 and rows[-1] == {"others": 17, "count": 17}

    def test_five_thousand_waiters_make_a_snapshot_no_larger_than_fifty(self) -> None:
        def size(waiters: int) -> int:
            clients = {f"10.0.{i // 250}.{i % 250}": 1 for i in range(waiters)}
            document = status(
                waiting=waiters,
                waiting_by_class={"interactive": 0, "normal": waiters, "batch": 0},
                waiting_by_client=clients,
            )
            # Every waiter is also a request in flight, not yet past the line.
            waiting = [record(f"req_{i}", started=150.0 + i / 1000) for i in range(waiters)]
            return len(json.dumps(build(status=document, in_flight=waiting)))

        assert size(5000) - size(50) < 20  # the counts' digits, nothing per waiter
        assert size(5000) < 1000

    def test_in_flight_rows_are_the_requests_past_the_line_oldest_first_capped(self) -> None:
        holding = [
            record(
                f"req_{i}",
                started=100.0 + i,
                queue_wait=1.0,
                first_token=1.0,
                output_tokens=10 * i,
                served_model="reasoning",
                upstream="vllm",
                client="frontend",
            )
            for i in (3, 1, 2)
        ]
        waiting = record("req_w", started=90.0)
        snap = build(in_flight=[waiting, *holding], now=110.0, max_rows=2)
        assert snap["in_flight_total"] == 3
        assert [row["request_id"] for row in snap["in_flight"]] == ["req_1", "req_2"]
        first = snap["in_flight"][0]
        # started 101, queued 1 s, first token 1 s later: 7 s of generation at 110.
        assert first["elapsed_s"] == 9.0
        assert first["output_tokens"] == 10
        assert first["tokens_per_s"] == round(10 / 7, 1)
        assert (first["model"], first["client"], first["class"]) == (
            "reasoning",
            "frontend",
            "normal",
        )

    def test_no_token_rate_before_the_first_token(self) -> None:
        row = build(in_flight=[record(queue_wait=0.5)], now=101.0)["in_flight"][0]
        assert (row["output_tokens"], row["tokens_per_s"], row["ttft_s"]) == (0, None, None)

    def test_finished_rows_newest_first_with_their_figures(self) -> None:
        done = record(
            "req_a",
            started=100.0,
            queue_wait=2.0,
            first_token=0.5,
            input_tokens=12,
            output_tokens=50,
            outcome=None,
            status=200,
            served_model="reasoning",
        )
        failed = record("req_b", started=101.0, outcome="queue_timeout", status=529)
        snap = build(finished=[(done, 107.5), (failed, 105.0)])
        assert [row["request_id"] for row in snap["finished"]] == ["req_b", "req_a"]
        row = snap["finished"][1]
        assert row["outcome"] == "completed"
        assert (row["duration_s"], row["queue_wait_s"], row["ttft_s"]) == (7.5, 2.0, 0.5)
        assert row["tokens_per_s"] == 10.0  # 50 tokens in the 5 s after the first one
        assert snap["finished"][0]["outcome"] == "queue_timeout"

    def test_the_clients_model_string_never_appears_only_the_configured_name(self) -> None:
        odd = record(model="<script>alert(1)</script>", queue_wait=0.0)
        text = json.dumps(build(in_flight=[odd], finished=[(odd, 101.0)]))
        assert "script" not in text
        assert build(in_flight=[odd])["in_flight"][0]["model"] == "unknown"
