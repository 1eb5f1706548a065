"""The rolling day of a client's tokens (`core.quota`), on plain numbers."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.trial.unittest import TestCase

from homelab_gateway.core.quota import WINDOW, Tally, retry_after, used

DAY = WINDOW


class RetryAfter(TestCase):
    def test_under_the_limit_nobody_waits(self) -> None:
        self.assertIsNone(retry_after([(100, 29)], 30, 100.5))
        self.assertIsNone(retry_after([], 1, 0.0))

    def test_the_wait_is_until_the_oldest_tokens_that_must_leave_have_left(self) -> None:
        buckets = [(100, 20), (200, 20), (300, 20)]  # 60 tokens; a limit of 30
        wait = retry_after(buckets, 30, 1000.0)
        self.assertEqual(wait, 200 + 1 + DAY - 1000.0, "100 and 200 leave, 20 stay")
        assert wait is not None
        self.assertIsNone(retry_after(buckets, 30, 1000.0 + wait))
        self.assertEqual(used(buckets, 1000.0 + wait), 20)

    def test_a_bucket_leaves_when_its_second_ends_a_day_later(self) -> None:
        self.assertEqual(used([(100, 5)], 100 + DAY + 0.999), 5)
        self.assertEqual(used([(100, 5)], 100 + 1 + DAY), 0)
        self.assertEqual(retry_after([(100, 5)], 5, 100.25), 1 + DAY - 0.25)

    @settings(max_examples=200)
    @given(
        st.lists(st.tuples(st.integers(0, 200_000), st.integers(1, 50)), max_size=20),
        st.integers(1, 300),
        st.floats(0, 300_000, allow_nan=False),
    )
    def test_the_wait_is_exact(
        self, buckets: list[tuple[int, int]], limit: int, now: float
    ) -> None:
        """Just before the wait ends the client is still over; when it ends, under."""
        wait = retry_after(buckets, limit, now)
        if wait is None:
            self.assertLess(used(buckets, now), limit)
            return
        self.assertGreater(wait, 0)
        self.assertGreaterEqual(used(buckets, now + wait - 1e-6), limit)
        self.assertLess(used(buckets, now + wait), limit)


class Tallies(TestCase):
    def test_tokens_of_one_second_share_a_bucket_and_old_ones_are_dropped(self) -> None:
        tally = Tally()
        tally.add("a", 5, 10.2)
        tally.add("a", 7, 10.9)
        tally.add("a", 0, 11.0)
        tally.add("b", 1, 20.0)
        self.assertEqual(tally.buckets("a", 11.0), [(10, 12)])
        tally.add("a", 3, 5000.0)
        self.assertEqual(tally.buckets("a", 11 + DAY), [(5000, 3)])
        self.assertEqual(tally.buckets("a", 5001 + DAY), [])
        self.assertNotIn("a", tally._clients, "a client with nothing left is forgotten")
        self.assertEqual(tally.buckets("nobody", 0.0), [])
