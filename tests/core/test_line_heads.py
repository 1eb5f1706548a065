"""The line's heaps of heads against the walks they replace: the same head, grant and next aging
after any sequence of operations, ties, aging and clocks that go back included (time inside the
line never goes back: the walks look at the latest moment seen)."""

from __future__ import annotations

import math
import random
from bisect import bisect_left
from typing import Any
from unittest.mock import patch

from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.trial.unittest import TestCase

from homelab_gateway.core import line as line_module
from homelab_gateway.core.line import CLASSES, Line, Waiter, aged_at, served_as


def walked_head(line: Line[Any], now: float) -> Waiter[Any] | None:
    """The head as the line chose it before the heaps: a walk of every client's FIFOs, the
    first least `(class at now, start, arrived)` in the dicts' order."""
    best: tuple[tuple[int, float, float], Waiter[Any]] | None = None
    for state in line._clients.values():
        if not state.queues:
            continue
        start = max(line._virtual, state.finish)
        for queue in state.queues.values():
            head = queue[0]
            key = (served_as(head.rank, head.arrived, now, line.aging), start, head.arrived)
            if best is None or key < best[0]:
                best = (key, head)
    return None if best is None else best[1]


def walked_aging(line: Line[Any], now: float) -> float | None:
    """`next_aging` by definition: the least moment after `now` at which any waiter is next
    served as a better class (while more than one FIFO waits)."""
    aging = line.aging
    if aging is None or line.queues < 2:
        return None
    soonest: float | None = None
    for waiter in line._waiters.values():
        rank = served_as(waiter.rank, waiter.arrived, now, aging)
        if rank:
            at = aged_at(waiter.arrived, waiter.rank - rank + 1, aging)
            soonest = at if soonest is None else min(soonest, at)
    return soonest


def bisected_aging(line: Line[Any], now: float) -> float | None:
    """`next_aging` as the line computed it before the heaps, a walk of the FIFOs that relies
    on each being in arrival order."""
    aging = line.aging
    if aging is None or line.queues < 2:
        return None
    soonest: float | None = None
    for state in line._clients.values():
        for queue in state.queues.values():
            rank = queue[0].rank
            for steps in range(1, rank + 1):
                better = rank - steps
                first = bisect_left(
                    queue,
                    True,
                    key=lambda w: served_as(rank, w.arrived, now, aging) > better,
                )
                if first < len(queue):
                    at = aged_at(queue[first].arrived, steps, aging)
                    soonest = at if soonest is None else min(soonest, at)
    return soonest


class Checked:
    """A line driven op by op, each head, grant and next aging checked against the walks."""

    def __init__(self, test: TestCase, aging: float | None, weights: dict[str, float]) -> None:
        self.test = test
        self.line: Line[int] = Line(aging=aging, weights=weights)
        self.now = 0.0
        self.seen = -math.inf  # the line's own time: the latest `now` it was given
        self.went_back = False  # FIFOs may be out of arrival order: the bisecting walk is off
        self.grants: list[Any] = []
        self.n = 0

    def check(self) -> None:
        line, now = self.line, self.now
        head = line.head(now)
        self.seen = max(self.seen, now)
        expected = walked_head(line, self.seen)
        self.test.assertEqual(head, None if expected is None else expected.item)
        self.test.assertEqual(next(iter(line.order(now)), None), head, "pop and order disagree")
        order = list(line.order(now))
        self.test.assertEqual(list(line.order(now)), order, "order changed the line")
        aging = walked_aging(line, self.seen)
        self.test.assertEqual(line.next_aging(now), aging)
        if not self.went_back:
            self.test.assertEqual(bisected_aging(line, self.seen), aging)
        live = sum(len(s.queues) for s in line._clients.values())
        self.test.assertEqual(line.queues, live)
        self.test.assertLessEqual(len(line._at_v) + len(line._owing), 2 * live + 64)
        self.test.assertLessEqual(len(line._ages), 2 * len(line) + 64)

    def do(self, op: tuple[Any, ...]) -> None:
        line = self.line
        kind = op[0]
        if kind == "join":
            self.n += 1
            line.join(self.n, op[1], op[2], self.now)
        elif kind == "join again":  # after Redis was away: with its first arrival
            self.n += 1
            line.join(self.n, op[1], op[2], self.now - op[3])
        elif kind == "pop":
            self.seen = max(self.seen, self.now)
            expected = walked_head(line, self.seen)
            granted = line.grant(self.now)
            if expected is None:
                self.test.assertIsNone(granted)
                return
            assert granted is not None
            item, grant, _ = granted
            self.test.assertEqual(item, expected.item)
            rank = served_as(expected.rank, expected.arrived, self.seen, line.aging)
            self.test.assertEqual((grant.client, grant.rank), (expected.client, rank))
            self.grants.append(grant)
        elif kind == "take" and len(line):
            self.seen = max(self.seen, self.now)
            items = list(line._waiters)
            item = items[op[1] % len(items)]
            waiter = line._waiters[item]
            granted = line.grant(self.now, item)
            assert granted is not None
            rank = served_as(waiter.rank, waiter.arrived, self.seen, line.aging)
            self.test.assertEqual(granted[1].rank, rank)
            self.grants.append(granted[1])
        elif kind == "leave" and len(line):
            items = list(line._waiters)
            line.leave(items[op[1] % len(items)])
        elif kind == "admit":
            self.grants.append(line.admit(op[1], op[2], self.now)[0])
        elif kind == "settle" and self.grants:
            line.settle(self.grants.pop(op[1] % len(self.grants)), op[2])
        elif kind == "wait":
            self.now += op[1]
            self.went_back = self.went_back or op[1] < 0
        elif kind == "configure":
            line.configure(aging=op[1], weights=line.weights)
        self.check()


clients = st.sampled_from("abcde")
ranks = st.sampled_from(range(len(CLASSES)))
op = st.one_of(
    st.tuples(st.just("join"), clients, ranks),
    st.tuples(st.just("join again"), clients, ranks, st.sampled_from([0.25, 1.0, 5.0])),
    st.tuples(st.just("pop")),
    st.tuples(st.just("take"), st.integers(0, 100)),
    st.tuples(st.just("leave"), st.integers(0, 100)),
    st.tuples(st.just("admit"), st.sampled_from("abcdef"), ranks),
    st.tuples(st.just("settle"), st.integers(0, 100), st.sampled_from([0.0, 0.5, 1.0, 3.0])),
    # No time at all (equal arrivals: ties), less and more than an aging period.
    st.tuples(st.just("wait"), st.sampled_from([0.0, 0.0, 0.25, 0.5, 1.0, 2.5])),
)


class HeadsAreTheWalksHeads(TestCase):
    @settings(max_examples=400)
    @given(
        st.lists(op, max_size=150),
        st.sampled_from([None, 0.5, 1.0, 3.0]),
        st.sampled_from([{}, {"a": 3.0}, {"b": 0.5, "c": 2.0}]),
    )
    def test_any_sequence(
        self, ops: list[Any], aging: float | None, weights: dict[str, float]
    ) -> None:
        checked = Checked(self, aging, weights)
        for step in ops:
            checked.do(step)

    @settings(max_examples=200)
    @given(
        st.lists(
            st.one_of(
                op,
                st.tuples(st.just("wait"), st.sampled_from([-0.25, -1.0, -3.0])),
                st.tuples(st.just("configure"), st.sampled_from([None, 0.5, 1.0, 3.0])),
            ),
            max_size=150,
        ),
        st.sampled_from([None, 0.5, 1.0]),
    )
    def test_a_clock_that_goes_back_and_a_new_aging_period(
        self, ops: list[Any], aging: float | None
    ) -> None:
        checked = Checked(self, aging, {})
        for step in ops:
            checked.do(step)

    def test_many_clients_at_once(self) -> None:
        """Hundreds of FIFOs, far past the 64 stale entries the heaps keep before tidying."""
        for seed, aging in [(1, None), (2, 120.0), (3, 0.5)]:
            rnd = random.Random(seed)
            checked = Checked(self, aging, {f"c{i}": 1 + i % 3 for i in range(0, 300, 7)})
            for _ in range(900):
                roll = rnd.random()
                if roll < 0.45:
                    step: tuple[Any, ...] = ("join", f"c{rnd.randrange(300)}", rnd.randrange(3))
                elif roll < 0.75:
                    step = ("pop",)
                elif roll < 0.8:
                    step = ("take", rnd.randrange(1000))
                elif roll < 0.85:
                    step = ("leave", rnd.randrange(1000))
                elif roll < 0.9:
                    step = ("admit", f"c{rnd.randrange(300)}", 1)
                elif roll < 0.95:
                    step = ("settle", rnd.randrange(1000), rnd.choice([0.0, 1.0, 5.0]))
                else:
                    step = ("wait", rnd.choice([0.0, 0.1, 0.4]))
                checked.do(step)

    def test_a_waiter_that_aged_elsewhere_joins_and_the_clock_goes_back(self) -> None:
        """A waiter moved from another line keeps its arrival: it may join already aged. A
        clock that goes back over a crossing does not make anyone younger."""
        line: Line[str] = Line(aging=1.0)
        line.join("batch", "a", 2, 0.0)
        line.join("normal", "b", 1, 0.5)
        self.assertEqual(line.head(1.2), "batch")  # served as normal since 1.0, and came first
        line.join("moved", "c", 2, -5.0)  # interactive since -3.0
        self.assertEqual(line.head(1.2), "moved")
        granted = line.grant(0.2)
        self.assertEqual(granted and (granted[0], granted[1].rank), ("moved", 0))
        self.assertEqual(line.head(0.2), "batch", "still served as normal at 0.2")
        self.assertEqual(line.next_aging(0.2), 1.5, "normal is interactive at 1.5, after 1.2")

    def test_one_joining_again_with_its_first_arrival_goes_by_it_among_its_clients(
        self,
    ) -> None:
        line: Line[str] = Line()
        for item, arrived in (("second", 2.0), ("fourth", 4.0)):
            line.join(item, "a", 1, arrived)
        line.join("third", "a", 1, 3.0)
        line.join("first", "a", 1, 1.0)
        line.join("other", "b", 1, 2.5)
        self.assertEqual(list(line.order(5.0)), ["first", "other", "second", "third", "fourth"])
        self.assertEqual(line.head(5.0), "first")

    def test_a_tie_goes_to_the_client_first_in_the_table(self) -> None:
        """Equal keys: the client created first, even if its FIFO of that class is newer."""
        line: Line[str] = Line()
        line.join("a-batch", "a", 2, 0.0)
        line.join("b-normal", "b", 1, 0.0)
        line.join("a-normal", "a", 1, 0.0)
        self.assertEqual(line.head(0.0), "a-normal")
        self.assertEqual(next(iter(line.order(0.0))), "a-normal")

    def test_a_client_whose_finish_the_virtual_time_reached_starts_at_it(self) -> None:
        """b's finish is exactly V after a's grant: b2 starts at V like the newcomer c1, and
        arrived first (d's batch waiter keeps more than one FIFO waiting throughout)."""
        line: Line[str] = Line()
        line.join("d1", "d", 2, 0.0)
        for item, client, at in [("a1", "a", 0.0), ("b1", "b", 0.0), ("a2", "a", 0.0)]:
            line.join(item, client, 1, at)
        line.join("b2", "b", 1, 0.1)
        self.assertEqual([line.grant(0.2)[0] for _ in range(3)], ["a1", "b1", "a2"])  # type: ignore[index]
        line.join("c1", "c", 1, 0.2)
        self.assertEqual(line.head(0.2), "b2")


def fair_share_first(served: int, start: float, waiter: Any, client: Any, queue: Any) -> Any:
    """Another policy, for the test that the line follows `place` alone: the fair share
    between all clients first, the class only between equal starts."""
    return (start, served, waiter.arrived, client.seq, queue.seq)


def walked_place_head(line: Line[Any], now: float) -> Any:
    """The head by the patched `place`: the least place of every FIFO's head."""
    heads = [
        (
            line_module.place(
                served_as(q[0].rank, q[0].arrived, now, line.aging),
                max(line._virtual, state.finish),
                q[0],
                state,
                q,
            ),
            q[0].item,
        )
        for state in line._clients.values()
        for q in state.queues.values()
    ]
    return min(heads)[1] if heads else None


class AnotherPolicy(TestCase):
    """A new order is a change to `line.place` alone: with another key, the head, grants,
    order and `is_last` of the heaps follow it, as a walk of every FIFO's head finds it."""

    @settings(max_examples=300)
    @given(st.lists(op, max_size=100), st.sampled_from([None, 0.5, 3.0]))
    def test_the_heaps_follow_the_key(self, ops: list[Any], aging: float | None) -> None:
        with patch.object(line_module, "place", fair_share_first):
            line: Line[int] = Line(aging=aging, weights={"a": 3.0, "b": 0.5})
            now, n, grants = 0.0, 0, []
            for step in ops:
                kind = step[0]
                order = list(line.order(now))
                self.assertEqual(line.head(now), walked_place_head(line, line._now))
                self.assertEqual(next(iter(order), None), line.head(now))
                if kind in ("join", "join again"):
                    n += 1
                    line.join(n, step[1], step[2], now - (step[3] if len(step) > 3 else 0.0))
                    if line.is_last(n, now):
                        self.assertEqual(list(line.order(now))[-1], n)
                elif kind == "pop":
                    granted = line.grant(now)
                    if granted is not None:
                        grants.append(granted[1])
                        self.assertEqual([granted[0], *line.order(now)], order)
                elif kind == "leave" and order:
                    line.leave(order[step[1] % len(order)])
                elif kind == "admit":
                    grants.append(line.admit(step[1], step[2], now)[0])
                elif kind == "settle" and grants:
                    line.settle(grants.pop(step[1] % len(grants)), step[2])
                elif kind == "wait":
                    now += step[1]

    def test_the_fair_share_goes_before_the_class(self) -> None:
        with patch.object(line_module, "place", fair_share_first):
            line: Line[str] = Line()
            line.admit("a", 0, 0.0)  # a owes a second of slot time
            line.join("a-interactive", "a", 0, 0.0)
            line.join("b-batch", "b", 2, 0.0)
            self.assertEqual(list(line.order(0.0)), ["b-batch", "a-interactive"])
            self.assertEqual(line.head(0.0), "b-batch")
