"""Tokens a client used in a rolling day, and when one over its `tokens_per_day` may come back
(sans-IO).

Usage is counted in buckets of one second: second `s` holds the tokens of the requests that
ended in it, and leaves the window when `s + 1 + WINDOW` comes, so nobody is let back early and
the wait told is right to the second. A client's buckets are kept oldest first with their
running total, in memory (`Tally`, a gateway alone) or in Redis (shared by a cluster), so a
check costs the buckets that leave, not the day's; either way `retry_after` decides.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

WINDOW = 86_400.0  # seconds: the rolling day


def second_of(now: float) -> int:
    return math.floor(now)


def expires(second: int, window: float = WINDOW) -> float:
    """When the bucket of `second` leaves the window."""
    return second + 1 + window


def retry_after(
    oldest: Iterable[tuple[int, int]], total: int, limit: int, now: float, window: float = WINDOW
) -> float | None:
    """Seconds from `now` until `total`, the tokens in the window, is below `limit`, as the
    buckets leave oldest first (`oldest`, those still in the window); None if it is now."""
    if total < limit:
        return None
    for second, tokens in oldest:
        total -= tokens
        if total < limit:
            return expires(second, window) - now
    return None  # not reached: the buckets hold the total, and `limit` is at least 1


@dataclass
class _Day:
    buckets: deque[list[int]] = field(default_factory=deque)  # [second, tokens], oldest first
    total: int = 0


class Tally:
    """Each client's buckets, in memory."""

    def __init__(self, window: float = WINDOW) -> None:
        self.window = window
        self._clients: dict[str, _Day] = {}

    def add(self, client: str, tokens: int, now: float) -> None:
        """Tokens spent at `now`. A moment before the newest bucket's (the clock stepped
        back, or the day is read back from the ledger after a request was counted) counts
        in that bucket: later, so never let back early."""
        if tokens <= 0:
            return
        day = self._clients.setdefault(client, _Day())
        second = second_of(now)
        if day.buckets and day.buckets[-1][0] >= second:
            day.buckets[-1][1] += tokens
        else:
            day.buckets.append([second, tokens])
        day.total += tokens

    def forget(self, client: str) -> None:
        self._clients.pop(client, None)

    def used(self, client: str, now: float) -> int:
        day = self._live(client, now)
        return 0 if day is None else day.total

    def retry_after(self, client: str, limit: int, now: float) -> float | None:
        day = self._live(client, now)
        if day is None:
            return None
        return retry_after(((s, n) for s, n in day.buckets), day.total, limit, now, self.window)

    def _live(self, client: str, now: float) -> _Day | None:
        """`client`'s day at `now`, the buckets that left dropped (a client with none left
        is forgotten)."""
        day = self._clients.get(client)
        if day is None:
            return None
        buckets = day.buckets
        while buckets and expires(buckets[0][0], self.window) <= now:
            day.total -= buckets.popleft()[1]
        if not buckets:
            del self._clients[client]
            return None
        return day
