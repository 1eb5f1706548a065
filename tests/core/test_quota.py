"""The rolling day of a client's tokens (`core.quota`), on plain numbers."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.trial.unittest import TestCase

from homelab_gateway.core.quota import WINDOW, Tally, expires, retry_after

DAY = WINDOW


class RetryAfter(TestCase):
    def test_under_the_limit_nobody_waits(self) -> None:
        self.assertIsNone(retry_after([(100, 29)], 29, 30, 100.5))
        self.assertIsNone(retry_after([], 0, 1, 0.0))

    def test_the_wait_is_until_the_oldest_tokens_that_must_leave_have_left(self) -> None:
        buckets = [(100, 20), (200, 20), (300, 20)]  # 60 tokens; a limit of 30
        self.assertEqual(retry_after(buckets, 60, 30, 1000.0), 200 + 1 + DAY - 1000.0)
        self.assertEqual(retry_after(buckets, 60, 61, 1000.0), None)
        self.assertEqual(retry_after(buckets, 60, 60, 1000.0), 100 + 1 + DAY - 1000.0)


class Tallies(TestCase):
    def test_a_bucket_leaves_when_its_second_ends_a_day_later(self) -> None:
        tally = Tally()
        tally.add("a", 5, 100.7)
        self.assertEqual(tally.used("a", 100 + DAY + 0.999), 5)
        self.assertEqual(tally.retry_after("a", 5, 100.25), 1 + DAY - 0.25)
        self.assertEqual(tally.used("a", 100 + 1 + DAY), 0)
        self.assertNotIn("a", tally._clients, "a client with nothing left is forgotten")

    def test_one_seconds_tokens_share_a_bucket_and_an_earlier_moment_counts_later(self) -> None:
        tally = Tally()
        tally.add("a", 5, 10.2)
        tally.add("a", 7, 10.9)
        tally.add("a", 0, 11.0)
        tally.add("a", 3, 9.0)  # the clock stepped back: counted with second 10, never earlier
        tally.add("b", 1, 20.0)
        self.assertEqual(list(tally._clients["a"].buckets), [[10, 15]])
        self.assertEqual((tally.used("a", 11.0), tally.used("b", 11.0)), (15, 1))
        self.assertEqual(tally.used("nobody", 0.0), 0)
        self.assertIsNone(tally.retry_after("nobody", 1, 0.0))

    @settings(max_examples=200)
    @given(
        st.lists(
            st.tuples(st.floats(0, 200_000, allow_nan=False), st.integers(0, 50)), max_size=30
        ),
        st.integers(1, 300),
        st.floats(0, 300_000, allow_nan=False),
    )
    def test_the_wait_is_exact_and_the_total_is_the_window_s(
        self, spends: list[tuple[float, int]], limit: int, later: float
    ) -> None:
        """Just before the wait ends the client is still at its limit; when it ends, under;
        and the running total is what a count of the live buckets says."""
        tally, counted = Tally(), []
        for at, tokens in sorted(spends):
            tally.add("c", tokens, at)
            if tokens:
                counted.append((at, tokens))
        now = max((at for at, _ in spends), default=0.0) + later

        def used(moment: float) -> int:
            return sum(n for at, n in counted if expires(int(at // 1)) > moment)

        self.assertEqual(tally.used("c", now), used(now))
        wait = tally.retry_after("c", limit, now)
        if wait is None:
            self.assertLess(used(now), limit)
            return
        self.assertGreater(wait, 0)
        self.assertGreaterEqual(used(now + wait - 1e-6), limit)
        self.assertLess(used(now + wait), limit)
