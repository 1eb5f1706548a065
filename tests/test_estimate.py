"""The wait estimate: the formula, its history, and the line's figures on a fake clock."""

from __future__ import annotations

from hypothesis import example, given
from hypothesis import strategies as st
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from homelab_gateway.estimate import MINIMUM_HISTORY, HoldTimes, wait
from homelab_gateway.limiter import PositionedSemaphore, Slot


def test_no_estimate_until_enough_holds_then_the_recent_mean() -> None:
    holds = HoldTimes(size=10)
    for _ in range(MINIMUM_HISTORY - 1):
        holds.add(4.0)
    assert holds.mean() is None
    holds.add(4.0)
    assert holds.mean() == 4.0
    for _ in range(10):
        holds.add(10.0)
    assert holds.mean() == 10.0, "only the most recent holds count"


def test_each_slot_frees_when_its_hold_reaches_the_mean_then_every_mean() -> None:
    # two slots held 4 s and 9 s, mean hold 10 s: they free in 6 s and 1 s
    assert [wait(p, [4.0, 9.0], 2, 10.0) for p in range(1, 6)] == [1.0, 6.0, 11.0, 16.0, 21.0]
    assert wait(1, [15.0], 2, 10.0) == 0.0, "overdue, or a slot free but not for this waiter"


@given(
    st.lists(st.floats(0, 1000), max_size=8),
    st.integers(1, 8),
    st.floats(0.1, 1000),
    st.integers(1, 200),
)
# Found by CI: the last place of a round came out an ulp after the first of the next.
@example(held=[0.0], slots=8, mean=103.024615610838, position=48)
def test_a_later_place_never_waits_less_and_a_round_later_waits_one_mean_more(
    held: list[float], slots: int, mean: float, position: int
) -> None:
    assert wait(position + 1, held, slots, mean) >= wait(position, held, slots, mean)
    later = wait(position + slots, held, slots, mean)
    assert abs(later - (wait(position, held, slots, mean) + mean)) < 1e-6 * max(1.0, later)


class LineEstimate(SynchronousTestCase):
    def test_the_line_estimates_from_its_own_holds_and_holders(self) -> None:
        clock = Clock()
        line = PositionedSemaphore(2, clock)
        self.addCleanup(line.close)

        def hold(seconds: float) -> None:
            got: list[Slot] = []
            line.acquire_in_line().addCallback(got.append)
            clock.advance(seconds)
            got[0].release()

        for _ in range(MINIMUM_HISTORY):
            self.assertIsNone(line.estimate(1))
            hold(10)
        first: list[Slot] = []
        line.acquire_in_line().addCallback(first.append)
        clock.advance(5)
        line.acquire_in_line()
        clock.advance(1)
        self.assertEqual([line.estimate(p) for p in (1, 2, 3)], [4.0, 9.0, 14.0])
        first[0].release()  # held 6 s: the mean is 56 / 6 s, and the other slot is free
        self.assertAlmostEqual(line.estimate(1), 0.0)
        self.assertAlmostEqual(line.estimate(2), 56 / 6 - 1)
