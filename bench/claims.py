"""What a claim of the shared line costs as its line grows, with no Redis: a load-independent
figure for `shared.RedisSource._claim`.

`python -m bench.claims [N ...]` (default: 1,000 and 5,000) builds one gateway's copy of a line
of two slots with N waiters of another gateway (`Remote`s) behind two blockers, then drains it
as Redis would: a blocker's or a waiter's slot is released, the copy claims the freed slot, the
claim's `grant` event comes back and the claim is answered. cProfile counts the function calls
the drain makes inside `_claim`, per claim (a count, not a time: the same on a busy machine),
then a second drain times it:

  one client    every waiter of one client and one class (the line is a FIFO): bench.cluster's
                5,000 clients on one address
  N clients     one waiter each of N distinct clients (API keys, peer addresses)
  pairs         N clients, both slots freed at once every time: one claim run claims for the
                head and for the waiter behind it

The fake cluster answers every script call at once; the events come back in the order Redis
would append them.
"""

from __future__ import annotations

import cProfile
import pstats
import sys
import time
from collections.abc import Callable

import orjson
from twisted.internet.task import Clock

from homelab_gateway.core.dispatch import Replica
from homelab_gateway.line.shared import RedisSource, shared_line
from testsupport.helpers import FakeCluster


def build(n: int, client: Callable[[int], str]) -> tuple[RedisSource, FakeCluster, Clock]:
    """A copy with both slots held by blockers and n waiters of another gateway."""
    clock = Clock()
    clock.advance(1000.0)
    cluster = FakeCluster()
    shared = shared_line([Replica("stub", 2)], clock, cluster=cluster)  # type: ignore[arg-type]
    line = shared.source
    assert isinstance(line, RedisSource)
    t = repr(clock.seconds())
    for b in ("blocker-1", "blocker-2"):
        info = orjson.dumps({"c": "blocker", "k": 1})
        line.apply({"op": "admit", "w": f"there/1/{b}", "r": "stub", "i": info, "t": t})
    for i in range(n):
        info = orjson.dumps({"c": client(i), "k": 1})
        line.apply({"op": "join", "w": f"there/1/{i}", "i": info, "a": t, "t": t})
    line.applied()
    return line, cluster, clock


def drain(line: RedisSource, cluster: FakeCluster, clock: Clock, together: int) -> int:
    """Release `together` slots at a time, answer the claims as Redis would (the first claim
    for a slot wins), until nobody waits; returns the claims made."""
    claims = 0
    held = list(line._slots)
    while line.line.waiting or held:
        clock.advance(0.5)
        t = repr(clock.seconds())
        for w in held[:together]:
            line.apply({"op": "release", "w": w, "t": t})
        del held[:together]
        line.applied()
        made, cluster.claims = cluster.claims, []
        claims += len(made)
        for w, prefs, _ in made:
            info = orjson.dumps({"c": "x", "k": 1})
            line.apply({"op": "grant", "w": w, "r": orjson.loads(prefs)[0], "i": info, "t": t})
            held.append(w)
        line.applied()
        for _, _, d in made:
            d.callback(1)
        if not made and not held:
            break
    assert not line.line.waiting, "the line did not drain"
    return claims


def case(name: str, n: int, client: Callable[[int], str], together: int) -> None:
    """Drain a line of n waiters twice: once profiled (function calls made in `_claim`), once
    timed (microseconds spent in `_claim`, per claim made)."""
    line, cluster, clock = build(n, client)
    profile = cProfile.Profile()
    claim = line._claim

    def profiled() -> None:
        profile.enable()
        try:
            claim()
        finally:
            profile.disable()

    line._claim = profiled  # type: ignore[method-assign]
    claims = drain(line, cluster, clock, together)
    line.line.close()
    table = pstats.Stats(profile).stats  # type: ignore[attr-defined]
    runs = next(v[1] for k, v in table.items() if k[2] == "_claim")
    calls = sum(v[1] for k, v in table.items() if "disable" not in k[2])

    line, cluster, clock = build(n, client)
    spent = 0.0
    claim = line._claim

    def timed() -> None:
        nonlocal spent
        t = time.perf_counter()
        claim()
        spent += time.perf_counter() - t

    line._claim = timed  # type: ignore[method-assign]
    drain(line, cluster, clock, together)
    line.line.close()
    print(
        f"{name:12} N={n:>6}: {claims:>6} claims in {runs:>6} _claim runs, "
        f"{calls / claims:8.1f} function calls and {spent / claims * 1e6:8.1f} us "
        "in _claim per claim"
    )


def main(argv: list[str]) -> None:
    sizes = [int(a) for a in argv] or [1000, 5000]
    for n in sizes:
        case("one client", n, lambda i: "127.0.0.1", 1)
        case("N clients", n, lambda i: f"client-{i}", 1)
        case("pairs", n, lambda i: f"client-{i}", 2)


if __name__ == "__main__":
    main(sys.argv[1:])
