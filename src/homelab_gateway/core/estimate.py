"""How long a waiter will wait, from how long slots have been held lately (sans-IO).

The estimate a queued client gets (`estimated_wait_s` in `event: queue`): if every slot keeps
being held for the recent mean hold time `H`, a slot held for `e` seconds frees in `max(H - e,
0)`, and then every `H` seconds after that. The waiter at position `p` takes the `p`-th slot to
free, so with the `S` slots in rotation sorted by when they free next (`r_0 <= ... <=
r_{S-1}`, a free slot at 0):

    wait(p) = r_{(p-1) mod S} + floor((p-1) / S) * H

It is an estimate of a queue whose future is unknown: a request that joins ahead of the waiter
(a better class, a quieter client) or an answer much longer than usual makes the real wait
longer, a client that gives up makes it shorter. `bench/` measures how close it comes.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

HISTORY = 50  # the hold times the mean is taken over: the recent past, not the whole day
MINIMUM_HISTORY = 5  # fewer finished holds say nothing yet: no estimate is given


class HoldTimes:
    """The most recent `HISTORY` hold times of one line's slots."""

    def __init__(self, size: int = HISTORY) -> None:
        self._recent: deque[float] = deque(maxlen=size)
        self._sum = 0.0

    def add(self, seconds: float) -> None:
        if len(self._recent) == self._recent.maxlen:
            self._sum -= self._recent[0]
        self._recent.append(seconds)
        self._sum += seconds

    def mean(self) -> float | None:
        if len(self._recent) < MINIMUM_HISTORY:
            return None
        return max(0.0, self._sum / len(self._recent))


class Waits:
    """`wait(p)` of the module docstring for any position, from one look at the slots: a
    renumbering pass asks it for thousands of positions in a row, so the slots are sorted once
    per pass, not once per position.

    A slot frees `H` seconds after it was granted (at once if that is past), so the slots free
    in the order they were granted: the idle slots (free now), then the `S` oldest grants, are
    `r_0 <= ... <= r_{S-1}`, and a position's wait needs one of them at the moment it is asked.
    """

    __slots__ = ("_granted", "_idle", "_mean", "_slots")

    def __init__(self, granted_at: Iterable[float], slots: int, mean: float) -> None:
        """`slots` slots, those in use granted at the moments `granted_at` (the clock of the
        `now` given to `at`), held `mean` seconds on average."""
        self._granted = sorted(granted_at)[:slots]
        self._idle = slots - len(self._granted)
        self._slots = slots
        self._mean = mean

    def at(self, position: int, now: float) -> float:
        """Seconds until the waiter at `position` (1-based) gets a slot, asked at `now`."""
        mean = self._mean
        if not mean:  # slots held no time at all: every one is free again at once
            return 0.0
        rounds, index = divmod(position - 1, self._slots)
        index -= self._idle
        if index < 0:
            free = 0.0
        else:
            # Rounding is monotonic, so `mean - (now - granted)` keeps the grants' order: the
            # index-th grant is the index-th slot to free, to the bit. (`max(0.0, free)`, as
            # a comparison: this runs for every queue frame.)
            free = mean - (now - self._granted[index])
            if not free > 0.0:
                free = 0.0
        # In means, not seconds: a slot free in exactly one mean then adds 1.0 to a whole
        # number, which is exact, so the last place of a round never comes out an ulp later
        # than the first of the next (`free + rounds * mean` could), and a later place never
        # waits less.
        return mean * (rounds + free / mean)
