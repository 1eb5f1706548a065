"""The status page's charts (sans-IO): the sampled ring and the tokens per client per day."""

from __future__ import annotations

from itertools import pairwise
from typing import Any

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from homelab_gateway.core.history import DAY, DAYS, FIELDS, SIZE, History, tokens_by_day

NOON = 1_796_212_800  # 2026-12-02T12:00:00Z
FIRST = NOON - DAY // 2 - (DAYS - 1) * DAY  # 2026-11-19T00:00:00Z


def take(history: History, now: float, input_tokens: int = 0, output_tokens: int = 0) -> Any:
    return history.take(
        now,
        slots=4,
        in_use=2,
        waiting=3,
        input_tokens=input_tokens,
        output_tokens=output_tokens,
    )


class TestHistory:
    def test_a_rate_is_the_growth_since_the_previous_sample_over_the_seconds_between(self) -> None:
        history = History()
        first = take(history, 100.0, 500, 40)
        assert (first.input_per_s, first.output_per_s) == (0.0, 0.0)  # nothing to compare with
        late = take(history, 112.5, 1500, 140)  # the timer ran late: 12.5 s, not 10
        assert (late.input_per_s, late.output_per_s) == (80.0, 8.0)
        shrunk = take(history, 122.5, 1500, 130)  # a final count below the running estimate
        assert (shrunk.input_per_s, shrunk.output_per_s) == (0.0, 0.0)
        assert take(history, 122.5, 1600, 140).output_per_s == 0.0  # no time between: no rate
        assert take(history, 125.5, 1600, 150).output_per_s == 3.33

    def test_the_ring_keeps_the_last_size_samples_as_rows(self) -> None:
        history = History()
        for i in range(SIZE + 40):
            take(history, 10.0 * i, 0, 10 * i)
        document = history.document(10.0)
        assert (document["interval"], document["size"], document["fields"]) == (10.0, SIZE, FIELDS)
        assert len(document["samples"]) == SIZE
        assert document["samples"][0] == [400.0, 4, 2, 3, 0.0, 1.0]
        assert document["samples"][-1][0] == 10.0 * (SIZE + 39)


class Sampling(RuleBasedStateMachine):
    """Whatever the timing and the tokens, the ring stays bounded and the area under its
    rates is the tokens generated between its first sample and its last."""

    size = 5

    def __init__(self) -> None:
        super().__init__()
        self.history = History(self.size)
        self.now = 0.0
        self.total = 0
        self.totals: list[tuple[float, int]] = []  # (when, total) of each sample taken

    @rule(tokens=st.integers(0, 5000))
    def generate(self, tokens: int) -> None:
        self.total += tokens

    @rule(seconds=st.floats(0.5, 100))
    def wait(self, seconds: float) -> None:
        self.now += seconds

    @precondition(lambda self: not self.totals or self.totals[-1][0] < self.now)
    @rule()
    def sample(self) -> None:
        take(self.history, self.now, self.total, self.total)
        self.totals.append((self.now, self.total))

    @invariant()
    def bounded_and_never_negative(self) -> None:
        samples = self.history.samples
        assert len(samples) <= self.size
        assert all(s.input_per_s >= 0 and s.output_per_s >= 0 for s in samples)

    @invariant()
    def the_area_is_the_tokens(self) -> None:
        samples = list(self.history.samples)
        if len(samples) < 2:
            return
        area = sum(s.output_per_s * (s.at - before.at) for before, s in pairwise(samples))
        kept = self.totals[-len(samples) :]
        seconds = samples[-1].at - samples[0].at
        assert abs(area - (kept[-1][1] - kept[0][1])) <= 0.005 * seconds + 1e-6


TestSampling = Sampling.TestCase
TestSampling.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


class TestTokensByDay:
    def test_each_client_by_utc_day_the_largest_first_then_the_rest_in_one_row(self) -> None:
        rows = [
            ("alice", NOON, 100, 10),
            ("alice", NOON - 3600, 50, 5),  # the same day
            ("bob", FIRST, 1, 1),  # the first hour of the first day
            ("bob", FIRST - 3600, 999, 999),  # a day too early
            ("carol", NOON - DAY, 300, 30),
            ("dave", NOON, 2, 0),
            ("erin", NOON, 1, 1),
        ]
        chart = tokens_by_day(rows, NOON + 600, top=2)
        assert len(chart["days"]) == DAYS
        assert (chart["days"][0], chart["days"][-1]) == ("2026-11-19", "2026-12-02")
        empty = [0] * (DAYS - 1)
        assert chart["clients"] == [
            {
                "client": "carol",
                "input_tokens": [*empty[1:], 300, 0],
                "output_tokens": [*empty[1:], 30, 0],
            },
            {"client": "alice", "input_tokens": [*empty, 150], "output_tokens": [*empty, 15]},
            {
                "others": 3,
                "input_tokens": [1, *empty[1:], 3],
                "output_tokens": [1, *empty[1:], 1],
            },
        ]

    def test_ties_by_name_and_no_others_row_when_all_fit(self) -> None:
        chart = tokens_by_day([("b", NOON, 5, 0), ("a", NOON, 0, 5)], NOON)
        assert [row["client"] for row in chart["clients"]] == ["a", "b"]
        assert tokens_by_day([], NOON)["clients"] == []
