"""Tokens a client used in a rolling day, and when one over its `tokens_per_day` may come back
(sans-IO).

Usage is counted in buckets of one second: second `s` holds the tokens of the requests that
ended in it, and leaves the window when `s + 1 + WINDOW` comes, so nobody is let back early and
the wait told is right to the second. The buckets come from memory (`Tally`, a gateway alone)
or from Redis (shared by a cluster); either way `retry_after` decides.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

WINDOW = 86_400.0  # seconds: the rolling day

Buckets = Iterable[tuple[int, int]]  # (second, tokens)


def second_of(now: float) -> int:
    return math.floor(now)


def expires(second: int, window: float = WINDOW) -> float:
    """When the bucket of `second` leaves the window."""
    return second + 1 + window


def retry_after(buckets: Buckets, limit: int, now: float, window: float = WINDOW) -> float | None:
    """Seconds from `now` until the tokens in the window are fewer than `limit`; None if they
    are now. The oldest buckets leave first."""
    live = sorted((s, n) for s, n in buckets if expires(s, window) > now)
    spent = sum(n for _, n in live)
    if spent < limit:
        return None
    for second, tokens in live:
        spent -= tokens
        if spent < limit:
            return expires(second, window) - now
    return None  # not reached: `limit` is at least 1, and all of them leave


def used(buckets: Buckets, now: float, window: float = WINDOW) -> int:
    """The tokens in the window at `now`."""
    return sum(n for s, n in buckets if expires(s, window) > now)


class Tally:
    """Each client's buckets, in memory. A client's are kept in the order they were first
    added to, which is time order (`add` at `now`, `seed` before any), so the expired are at
    the front."""

    def __init__(self, window: float = WINDOW) -> None:
        self.window = window
        self._clients: dict[str, dict[int, int]] = {}

    def add(self, client: str, tokens: int, now: float) -> None:
        if tokens <= 0:
            return
        buckets = self._clients.setdefault(client, {})
        second = second_of(now)
        buckets[second] = buckets.get(second, 0) + tokens

    def buckets(self, client: str, now: float) -> list[tuple[int, int]]:
        """`client`'s buckets still in the window at `now`; the rest are dropped."""
        buckets = self._clients.get(client)
        if buckets is None:
            return []
        for second in list(buckets):
            if expires(second, self.window) > now:
                break
            del buckets[second]
        if not buckets:
            del self._clients[client]
        return list(buckets.items())
