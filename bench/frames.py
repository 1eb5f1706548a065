"""Queue frames per second of waiting, counted on a Clock: 5,000 waiters behind 2 slots, each
slot held 10 ms (the line drains in 25 s), no sockets, so the count does not depend on load.

`python -m bench.frames [REPORT_INTERVAL]` (default: the limiter's) prints the position
reports made, per waiter, and per second of waiting for the waiters that waited 1 s or more
(their first frame and the position 1 that comes with the slot included).
"""

from __future__ import annotations

import statistics
import sys

from twisted.internet.task import Clock

from homelab_gateway.limiter import PositionedSemaphore


def main() -> None:
    clock = Clock()
    options = {"report_interval": float(sys.argv[1])} if len(sys.argv) > 1 else {}
    sem = PositionedSemaphore(2, clock, **options)  # type: ignore[arg-type]
    n, hold = 5000, 0.01
    frames = [0] * n
    waited = [0.0] * n
    done: list[int] = []

    def told(i: int) -> None:
        frames[i] += 1

    def got(slot: object, i: int) -> None:
        waited[i] = clock.seconds()
        done.append(i)
        clock.callLater(hold, sem.release)

    sem.acquire()
    sem.acquire()
    for i in range(n):
        sem.acquire_in_line(lambda _, i=i: told(i)).addCallback(got, i)
    sem.release()
    sem.release()
    while len(done) < n:
        clock.advance(hold)
    rates = [frames[i] / waited[i] for i in range(n) if waited[i] >= 1.0]
    print(
        f"report_interval {sem.report_interval}: {sem.reports} reports, "
        f"{sem.reports / n:.1f} per waiter, per second of waiting p50 "
        f"{statistics.median(rates):.2f} max {max(rates):.2f}"
    )
    sem.close()


if __name__ == "__main__":
    main()
