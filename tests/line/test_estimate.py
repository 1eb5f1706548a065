"""The wait estimate: the formula, its history, and the line's figures on a fake clock."""

from __future__ import annotations

from hypothesis import example, given
from hypothesis import strategies as st
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from homelab_gateway.core.estimate import MINIMUM_HISTORY, HoldTimes, Waits
from homelab_gateway.line.limiter import PositionedSemaphore, Slot


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


def wait(position: int, held_for: list[float], slots: int, mean: float) -> float:
    """The wait at `position` with the slots in use held for `held_for` seconds so far."""
    return Waits([100.0 - held for held in held_for], slots, mean).at(position, 100.0)


def wait_before_waits(position: int, held_for: list[float], slots: int, mean: float) -> float:
    """`estimate.wait` as it was before `Waits`: every position sorted the slots' free times
    itself. Clients must see the same figure to the bit."""
    frees = [max(0.0, mean - held) for held in held_for]
    frees = sorted(frees + [0.0] * (slots - len(frees)))[:slots]
    rounds, index = divmod(position - 1, slots)
    return mean * (rounds + frees[index] / mean)


def test_each_slot_frees_when_its_hold_reaches_the_mean_then_every_mean() -> None:
    # two slots held 4 s and 9 s, mean hold 10 s: they free in 6 s and 1 s
    assert [wait(p, [4.0, 9.0], 2, 10.0) for p in range(1, 6)] == [1.0, 6.0, 11.0, 16.0, 21.0]
    assert wait(1, [15.0], 2, 10.0) == 0.0, "overdue, or a slot free but not for this waiter"


def test_more_slots_held_than_in_rotation_count_the_first_to_free() -> None:
    # three held 1, 9 and 5 s (a replica just left rotation), two slots in rotation, mean 10 s
    assert [wait(p, [1.0, 9.0, 5.0], 2, 10.0) for p in (1, 2, 3)] == [1.0, 5.0, 11.0]


def test_slots_held_no_time_at_all_free_at_once() -> None:
    # A mean of 0 (holds of 0 s on a fake clock, or clocks apart in a shared line) divided
    # by itself raised ZeroDivisionError inside the renumbering pass.
    assert [wait(p, [0.0, 3.0], 2, 0.0) for p in (1, 2, 3)] == [0.0, 0.0, 0.0]


@given(
    st.lists(st.floats(-1000, 1000), max_size=8),
    st.integers(1, 8),
    st.floats(0.001, 1000),
    st.integers(1, 200),
    st.floats(0, 1e9),
)
def test_one_view_of_the_slots_gives_every_position_the_figure_it_had(
    held: list[float], slots: int, mean: float, position: int, now: float
) -> None:
    waits = Waits([now - h for h in held], slots, mean)
    held_now = [now - (now - h) for h in held]  # what the clock says they were held
    assert waits.at(position, now) == wait_before_waits(position, held_now, slots, mean)


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

    def test_a_renumbering_pass_looks_at_the_slots_once_and_tells_the_same_figures(
        self,
    ) -> None:
        clock = Clock()
        line = PositionedSemaphore(2, clock, report_interval=1.0)
        self.addCleanup(line.close)
        for seconds in (8.0, 12.0, 10.0, 9.0, 11.0):
            line.holds.add(seconds)
        held: list[Slot] = []
        line.acquire_in_line().addCallback(held.append)
        clock.advance(3)
        line.acquire_in_line().addCallback(held.append)
        told: list[tuple[int, float | None]] = []
        for _ in range(6):
            line.acquire_in_line(lambda p: told.append((p, line.estimate(p))))
        looks = 0
        mean = line.holds.mean

        def counted() -> float | None:
            nonlocal looks
            looks += 1
            return mean()

        line.holds.mean = counted  # type: ignore[method-assign]
        clock.advance(2)
        held[0].release()  # the head (told 1 already) gets it; the others fall, told in 1 s
        self.assertEqual([p for p, _ in told], [1, 2, 3, 4, 5, 6])
        del told[:]
        looks_before_pass = looks
        clock.advance(line.report_interval)
        self.assertEqual([p for p, _ in told], [1, 2, 3, 4, 5])
        self.assertEqual(looks - looks_before_pass, 1, "one look for the whole pass")
        self.assertEqual(told, [(p, line.estimate(p)) for p in range(1, 6)])
