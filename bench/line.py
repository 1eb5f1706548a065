"""The line's own cost per grant, with no limiter or reactor around it: what a grant costs the
reactor when many distinct clients (API keys, peer addresses) wait at once.

`python -m bench.line [N ...]` (default: 1,000 and 5,000) fills a `Line` and drains it with
`head` then `grant`, as the limiter grants a slot, and prints microseconds per join, per grant and
per `next_aging` (which the limiter calls for every newcomer while position listeners wait):

  one client      N waiters of one client and one class: a plain FIFO
  N clients       one waiter each of N distinct clients, all arrived at once (every key a tie)
  N clients aged  the same, classes mixed, arrivals spread and aging of 1 s while the line
                  drains over time, so that waiters cross into better classes as it drains

Each case runs with aging off and with the default 120 s.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

from homelab_gateway.core.line import CLASSES, Line

DEFAULT_AGING = 120.0


def fill(line: Line[int], n: int, client: Callable[[int], str], spread: float) -> float:
    """Join n waiters, classes cycling when `spread` (seconds between arrivals) is set; returns
    microseconds per join."""
    t = time.perf_counter()
    for i in range(n):
        line.join(i, client(i), i % len(CLASSES) if spread else 1, i * spread)
    return (time.perf_counter() - t) / n * 1e6


def drain(line: Line[int], n: int, start: float, step: float) -> float:
    """Grant every waiter as the limiter does (`head`, then `grant`) at `start`, `start + step`,
    ...; returns microseconds per grant."""
    now = start
    t = time.perf_counter()
    while line.head(now) is not None:
        line.grant(now)
        now += step
    elapsed = time.perf_counter() - t
    assert not len(line), "the line did not drain"
    return elapsed / n * 1e6


def next_aging(line: Line[int], now: float, calls: int = 20) -> float:
    """Microseconds per `next_aging` on a full line."""
    t = time.perf_counter()
    for _ in range(calls):
        line.next_aging(now)
    return (time.perf_counter() - t) / calls * 1e6


def case(name: str, n: int, aging: float | None, client: Callable[[int], str], aged: bool) -> None:
    spread, step = (1.0 / n, 2.0 / n) if aged else (0.0, 0.0)
    period = 1.0 if aged and aging is not None else aging
    line: Line[int] = Line(aging=period)
    joined = fill(line, n, client, spread)
    asked = next_aging(line, n * spread)
    granted = drain(line, n, n * spread, step)
    print(
        f"{name:<22} {n:>6}  aging {period!s:>5}  join {joined:8.1f} us  "
        f"grant {granted:8.1f} us  next_aging {asked:9.1f} us"
    )


def main() -> None:
    sizes = [int(a) for a in sys.argv[1:]] or [1000, 5000]
    for n in sizes:
        for aging in (None, DEFAULT_AGING):
            case("one client", n, aging, lambda i: "only", aged=False)
            case(f"{n} clients", n, aging, lambda i: f"c-{i}", aged=False)
            case(f"{n} clients aged", n, aging, lambda i: f"c-{i}", aged=True)


if __name__ == "__main__":
    main()
