"""What one swap decision costs: the box's plan over its models' lines, with no reactor around
it, as `line.residency` makes it after every change of who waits or holds a slot.

`python -m bench.residency [WAITERS] [MODELS]` (default: 5,000 waiters over 10 models, one
box holding three of them) fills one `Dispatch` per model with waiters of distinct clients and
mixed classes, then times the decision as the residency makes it: each model's first waiter
(`Dispatch.first`, aging included) and count, then `residency.plan`. It prints microseconds per
decision, and the same with the lines empty (the plan alone).
"""

from __future__ import annotations

import sys
import time

from homelab_gateway.core.dispatch import Dispatch, Replica
from homelab_gateway.core.line import CLASSES
from homelab_gateway.core.residency import Model, plan

AGING = 120.0
DECISIONS = 2000


def lines(waiters: int, models: int) -> list[Dispatch[int]]:
    out = []
    for m in range(models):
        dispatch: Dispatch[int] = Dispatch([Replica(f"m{m}", 4)], aging=AGING)
        for i in range(waiters // models):
            dispatch.join(i, f"c-{i % 500}", i % len(CLASSES), i * 0.01, None, retry=False)
        out.append(dispatch)
    return out


def decide(dispatches: list[Dispatch[int]], now: float) -> None:
    models = [
        Model(
            f"m{m}",
            10.0,
            "loaded" if m < 3 else "unloaded",
            running=4 if m < 3 else 0,
            waiting=len(d),
            head=d.first(now),
            loaded_at=0.0,
        )
        for m, d in enumerate(dispatches)
    ]
    plan(30.0, 30.0, models, now)


def per_decision(dispatches: list[Dispatch[int]]) -> float:
    now = 100.0
    t = time.perf_counter()
    for _ in range(DECISIONS):
        decide(dispatches, now)
        now += 0.01
    return (time.perf_counter() - t) / DECISIONS * 1e6


def main() -> None:
    waiters = int(sys.argv[1]) if len(sys.argv) > 1 else 5000
    models = int(sys.argv[2]) if len(sys.argv) > 2 else 10
    full = per_decision(lines(waiters, models))
    empty = per_decision(lines(0, models))
    print(f"{waiters} waiters over {models} models: {full:.1f} us per decision")
    print(f"no waiters, {models} models:{'':>9} {empty:.1f} us per decision")


if __name__ == "__main__":
    main()
