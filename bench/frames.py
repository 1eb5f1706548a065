"""Queue frames per second of waiting, counted on a Clock: 5,000 waiters behind 2 slots, each
slot held 10 ms (the line drains in 25 s), no sockets, so the count does not depend on load.

`python -m bench.frames [REPORT_INTERVAL]` (default: the limiter's) prints the position
reports made, per waiter, and per second of waiting for the waiters that waited 1 s or more
(their first frame and the position 1 that comes with the slot included).

Each report is made into the bytes a streaming client would get
(`surfaces.stream.QUEUE_FRAME`, with the line's `estimate` as `EventStream` asks it), and the
run prints a digest of all of them in the
order they were made: a change to the limiter or the estimate that must not change what
clients see keeps the digest. `--repeat N` times the run N times (best process CPU time, the
whole drain: grants, renumbering passes, estimates, frame bytes) and `--clients K` spreads the
waiters over K clients in turn (the fair line: merged order, rises told at once).

`--pass` times renumbering passes instead: 5,000 waiters behind two held slots with a hold
history (so frames carry an estimate); `--repeat` times, one slot is released (the head takes
it) and the pass a second later tells the ~5,000 left their new place, each made into its
frame. It prints the best pass's CPU and the digest of all their frames. Under callgrind, the
difference between two `--repeat` counts is the instructions of that many more passes.
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import time
from collections import deque
from typing import Any

from twisted.internet.task import Clock

from homelab_gateway.line.limiter import PositionedSemaphore, Slot
from homelab_gateway.surfaces.stream import ESTIMATED_QUEUE_FRAME, QUEUE_FRAME


def run(report_interval: float | None, clients: int, n: int = 5000, hold: float = 0.01) -> Any:
    """One drain: the semaphore, the frames per waiter, their waits, the frames' digest and
    the process CPU seconds the drain took."""
    clock = Clock()
    options = {} if report_interval is None else {"report_interval": report_interval}
    sem = PositionedSemaphore(2, clock, **options)  # type: ignore[arg-type]
    frames = [0] * n
    waited = [0.0] * n
    done: list[int] = []
    digest = hashlib.sha256()

    def told(position: int, i: int) -> None:
        frames[i] += 1
        estimate = sem.estimate(position)
        if estimate is None:
            digest.update(QUEUE_FRAME % position)
        else:
            digest.update(ESTIMATED_QUEUE_FRAME % (position, estimate))

    def got(slot: Slot, i: int) -> None:
        waited[i] = clock.seconds()
        done.append(i)
        clock.callLater(hold, slot.release)  # the hold time counts for the estimate

    started = time.process_time()
    blockers: list[Slot] = []
    for _ in range(2):
        sem.acquire_in_line().addCallback(blockers.append)
    for i in range(n):
        sem.acquire_in_line(
            lambda position, i=i: told(position, i), client=f"c{i % clients}"
        ).addCallback(got, i)
    for slot in blockers:
        slot.release()
    while len(done) < n:
        clock.advance(hold)
    cpu = time.process_time() - started
    sem.close()
    return sem, frames, waited, digest.hexdigest(), cpu


def passes(clients: int, repeat: int, n: int = 5000) -> tuple[list[float], int, str]:
    """The process CPU seconds of `repeat` renumbering passes over `n` waiters, each after one
    slot was released (the head takes it, everyone else falls one place); the frames the
    passes made and their digest."""
    clock = Clock()
    sem = PositionedSemaphore(2, clock)
    for seconds in (8.0, 12.0, 10.0, 9.0, 11.0):  # a hold history: frames with an estimate
        sem.holds.add(seconds)
    held: deque[Slot] = deque()
    sem.acquire_in_line().addCallback(held.append)
    clock.advance(3)
    sem.acquire_in_line().addCallback(held.append)
    frames: list[bytes] = []

    def told(position: int) -> None:
        estimate = sem.estimate(position)
        if estimate is None:
            frames.append(QUEUE_FRAME % position)
        else:
            frames.append(ESTIMATED_QUEUE_FRAME % (position, estimate))

    for i in range(n):
        sem.acquire_in_line(told, client=f"c{i % clients}").addCallback(held.append)
    cpus = []
    digest = hashlib.sha256()
    told_in_passes = 0
    for _ in range(repeat):
        held.popleft().release()
        del frames[:]
        started = time.process_time()
        clock.advance(sem.report_interval)
        cpus.append(time.process_time() - started)
        told_in_passes += len(frames)
        digest.update(b"".join(frames))
    sem.close()
    return cpus, told_in_passes, digest.hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.frames")
    parser.add_argument("report_interval", type=float, nargs="?", default=None)
    parser.add_argument("--clients", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--pass", dest="one_pass", action="store_true")
    args = parser.parse_args()
    if args.one_pass:
        cpus, told, digest = passes(args.clients, args.repeat)
        print(
            f"{args.repeat} passes, {args.clients} client(s): {told} frames, sha256 "
            f"{digest[:16]}; CPU best pass {min(cpus) * 1e3:.2f} ms "
            f"({min(cpus) / (told / args.repeat) * 1e6:.2f} us per frame)"
        )
        return
    cpus = []
    for _ in range(args.repeat):
        sem, frames, waited, digest, cpu = run(args.report_interval, args.clients)
        cpus.append(cpu)
    n = len(frames)
    rates = [frames[i] / waited[i] for i in range(n) if waited[i] >= 1.0]
    print(
        f"report_interval {sem.report_interval}, {args.clients} client(s): {sem.reports} reports, "
        f"{sem.reports / n:.1f} per waiter, per second of waiting p50 "
        f"{statistics.median(rates):.2f} max {max(rates):.2f}; frames sha256 {digest[:16]}; "
        f"CPU best of {args.repeat} {min(cpus):.3f} s ({min(cpus) / sem.reports * 1e6:.2f} us "
        "per report)"
    )


if __name__ == "__main__":
    main()
