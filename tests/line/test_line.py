"""The line's order (sans-IO) and the limiter around it on a Clock: hypothesis properties."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hypothesis import example, given, settings
from hypothesis import strategies as st
from twisted.internet.defer import Deferred
from twisted.internet.task import Clock
from twisted.trial.unittest import TestCase

from homelab_gateway.core.line import CLASS_RANK, Line, aged_at, served_as
from homelab_gateway.line.limiter import PositionedSemaphore, Slot
from homelab_gateway.line.refusals import ClientQueueFull, QueueFull

INTERACTIVE, NORMAL, BATCH = (CLASS_RANK[c] for c in ("interactive", "normal", "batch"))
INTERVAL = 0.4
STEP = 0.05


class LineUnit(TestCase):
    def test_one_client_one_class_is_fifo(self) -> None:
        line: Line[str] = Line(aging=10)
        for name in "abcd":
            line.join(name, "c", NORMAL, 0.0)
        self.assertEqual(list(line.order(0.0)), list("abcd"))
        self.assertEqual(line.queues, 1)
        popped = [line.grant(100.0) for _ in range(4)]
        self.assertEqual([p[0] for p in popped if p], list("abcd"))
        self.assertIsNone(line.grant(100.0))

    def test_a_better_class_goes_first_and_a_lower_one_last(self) -> None:
        line: Line[str] = Line(aging=100)
        line.join("n1", "a", NORMAL, 0.0)
        line.join("b1", "b", BATCH, 0.0)
        line.join("i1", "c", INTERACTIVE, 1.0)
        self.assertEqual(list(line.order(1.0)), ["i1", "n1", "b1"])

    def test_aging_serves_a_waiter_as_the_class_above_per_period(self) -> None:
        self.assertEqual(served_as(BATCH, 0.0, 9.9, 10), BATCH)
        self.assertEqual(served_as(BATCH, 0.0, 10, 10), NORMAL)
        self.assertEqual(served_as(BATCH, 0.0, 25, 10), INTERACTIVE)
        self.assertEqual(served_as(BATCH, 0.0, 1e9, None), BATCH)
        line: Line[str] = Line(aging=10)
        line.join("old-batch", "a", BATCH, 0.0)
        line.join("new-normal", "b", NORMAL, 5.0)
        self.assertEqual(list(line.order(9.0)), ["new-normal", "old-batch"])
        self.assertEqual(line.next_aging(9.0), 10.0)
        self.assertEqual(list(line.order(10.0)), ["old-batch", "new-normal"])

    def test_next_aging_sees_a_later_arrival_cross_before_an_earlier_one_crosses_again(
        self,
    ) -> None:
        line: Line[str] = Line(aging=10)
        line.join("b1", "a", BATCH, 0.0)
        line.join("b2", "a", BATCH, 1.0)
        line.join("n", "b", NORMAL, 0.5)
        self.assertEqual(
            line.next_aging(10.5), 11.0, "b2 becomes normal at 11, b1 interactive at 20"
        )

    @given(
        st.floats(-1e10, 1e10),
        st.sampled_from([0.001, 0.3, 1.0, 7.7, 120.0]),
        st.integers(1, 2),
    )
    @example(1760000400.7349162, 0.3, 1)  # (t + 0.3) - t < 0.3
    @example(-1.0, 1.0, 1)  # near 0, where floats are tiny
    def test_a_waiter_is_aged_from_the_moment_aged_at_gives_and_not_a_float_before(
        self, arrived: float, aging: float, steps: int
    ) -> None:
        """The aging timer is set at `aged_at`: there the waiter must count as aged, and not
        before, whatever the rounding, or a rise would be told late or early."""
        at = aged_at(arrived, steps, aging)
        self.assertEqual(served_as(BATCH, arrived, at, aging), BATCH - steps)
        before = math.nextafter(at, -math.inf)
        self.assertEqual(served_as(BATCH, arrived, before, aging), BATCH - steps + 1)

    def test_a_client_that_held_slots_longer_waits_behind_one_that_did_not(self) -> None:
        line: Line[str] = Line()
        heavy, _ = line.admit("heavy", NORMAL, 0.0)
        line.settle(heavy, 30.0)  # it held a slot for 30 s
        line.join("h1", "heavy", NORMAL, 30.0)
        line.join("h2", "heavy", NORMAL, 30.0)
        line.join("l1", "light", NORMAL, 31.0)
        self.assertEqual(list(line.order(31.0)), ["l1", "h1", "h2"])

    def test_a_waiter_leaving_can_move_another_client_back(self) -> None:
        """b1's grant would have advanced the virtual time; without it a2 and a3 start before c1:
        why a cancel is followed by a walk for rises while more than one client waits."""
        line: Line[str] = Line()
        for at, (name, client, rank) in enumerate(
            [("a1", "a", INTERACTIVE), ("c1", "c", BATCH), ("a2", "a", BATCH), ("a3", "a", BATCH)]
        ):
            line.join(name, client, rank, at / 10)
        popped = line.grant(0.4)
        assert popped is not None
        line.settle(popped[1], 0.0)  # a1 held its slot for no time: a owes nothing
        for at, (name, client) in enumerate([("c2", "c"), ("b1", "b"), ("b2", "b")], start=5):
            line.join(name, client, INTERACTIVE, at / 10)
        self.assertEqual(list(line.order(1.0)), ["c2", "b1", "b2", "c1", "a2", "a3"])
        self.assertTrue(line.leave("b1"))
        self.assertEqual(list(line.order(1.0)), ["c2", "b2", "a2", "a3", "c1"], "c1: 4 -> 5")

    def test_idle_clients_are_forgotten_and_bank_no_credit(self) -> None:
        line: Line[str] = Line()
        grant, _ = line.admit("a", NORMAL, 0.0)
        line.settle(grant, 0.0)
        self.assertEqual(line._clients, {})  # nothing owed, nothing waiting: nothing kept

    def test_oldest_arrival_is_the_longest_waiter_whoever_goes_first(self) -> None:
        line: Line[str] = Line(aging=None)
        self.assertIsNone(line.oldest_arrival())
        line.join("b1", "b", BATCH, 1.0)
        line.join("i1", "a", INTERACTIVE, 2.0)
        line.join("n1", "c", NORMAL, 3.0)
        self.assertEqual(line.oldest_arrival(), 1.0)
        self.assertEqual(line.grant(4.0)[0], "i1")  # type: ignore[index]
        self.assertEqual(line.oldest_arrival(), 1.0)
        line.leave("b1")
        self.assertEqual(line.oldest_arrival(), 3.0)


line_op = st.one_of(
    st.tuples(
        st.just("join"),
        st.sampled_from("abc"),
        st.sampled_from([INTERACTIVE, NORMAL, BATCH]),
    ),
    st.tuples(st.just("pop"), st.sampled_from([0.0, 0.5, 1.0, 4.0])),  # the slot time it will hold
    st.tuples(st.just("leave"), st.integers(0, 60)),
    st.tuples(st.just("settle"), st.integers(0, 60)),
    st.tuples(st.just("wait"), st.sampled_from([0.0, 0.3, 1.0, 2.5, 7.0])),
)


class LineMovesNobodyBackButWhenItSays(TestCase):
    """What the limiter relies on to tell every rise at once and walk nothing when nobody can
    have risen: which operations can move a waiter back (a higher position), and when."""

    @settings(max_examples=300)
    @given(
        st.lists(line_op, max_size=80),
        st.sampled_from([None, 1.0, 3.0]),
        st.sampled_from([{}, {"a": 3.0}, {"b": 0.5}]),
    )
    def test_each_operation(
        self, ops: list[Any], aging: float | None, weights: dict[str, float]
    ) -> None:
        line: Line[int] = Line(aging=aging, weights=weights)
        now = 0.0
        grants: list[tuple[Any, float]] = []
        for n, op in enumerate(ops):
            before = list(line.order(now))
            if op[0] == "join":
                line.join(n, op[1], op[2], now)
                after = list(line.order(now))
                place = after.index(n)
                self.assertEqual(after[:place], before[:place], "moved someone ahead of it")
                if place == len(before):
                    self.assertEqual(after[:place], before, "went last yet moved someone")
                elif line.is_last(n, now):
                    self.fail("said to go last, but goes ahead of someone")
            elif op[0] == "pop":
                head = line.head(now)
                popped = line.grant(now)
                if popped is None:
                    self.assertEqual((before, head), ([], None))
                    continue
                self.assertEqual(popped[0], head)
                self.assertEqual(popped[0], before[0])
                self.assertEqual(list(line.order(now)), before[1:], "a grant moved someone")
                grants.append((popped[1], op[1]))
            elif op[0] == "leave" and before:
                gone = before[op[1] % len(before)]
                if not line.leave(gone):
                    self.assertEqual(list(line.order(now)), [i for i in before if i != gone])
            elif op[0] == "settle" and grants:
                grant, held = grants.pop(op[1] % len(grants))
                if not line.settle(grant, held):
                    self.assertEqual(list(line.order(now)), before, "settled without a word")
            elif op[0] == "wait":
                until = now + op[1]
                at = line.next_aging(now)
                if at is None or at > until:
                    self.assertEqual(list(line.order(until)), before, "aged with no warning")
                else:
                    self.assertGreater(at, now)
                    just_before = math.nextafter(at, -math.inf)
                    self.assertEqual(list(line.order(just_before)), before)
                    was = line.waiting_by_class(just_before)
                    self.assertNotEqual(line.waiting_by_class(at), was)
                now = until


goes_last_op = st.one_of(
    st.tuples(
        st.just("join"),
        st.sampled_from(["a", "b", "c", "new"]),  # "new": a client never seen before
        st.sampled_from([INTERACTIVE, NORMAL, BATCH]),
        st.sampled_from([0.0, 0.0, 0.0, 1.0]),  # arrived that long ago (a reload's adoption)
    ),
    st.tuples(st.just("pop"), st.sampled_from([0.0, 0.5, 1.0, 4.0])),
    st.tuples(st.just("admit"), st.sampled_from(["a", "b", "new"]), st.sampled_from([0.0, 3.0])),
    st.tuples(st.just("leave"), st.integers(0, 60)),
    st.tuples(st.just("settle"), st.integers(0, 60)),
    st.tuples(st.just("wait"), st.sampled_from([0.0, 0.0, 0.3, 2.5])),
)


class GoesLast(TestCase):
    """`Line.is_last` lets a newcomer skip the walk that would find its place: it must never
    say so of one that does not end the order, and must say so in the case it is for."""

    @settings(max_examples=400)
    @example([("join", "b", NORMAL, 0.0)] * 2 + [("join", "a", NORMAL, 0.0)], None, {})
    @example([("join", "b", NORMAL, 0.0), ("join", "a", NORMAL, 1.0)], None, {})
    @example(
        [("admit", "b", 0.0), ("join", "b", NORMAL, 0.0), ("join", "a", NORMAL, 0.0)], None, {}
    )
    @example(  # a tie with a newer client's waiter; `a` was kept (it owed), V has passed it
        [
            ("admit", "a", 0.0),
            ("admit", "b", 0.0),
            ("admit", "b", 0.0),
            ("join", "new", NORMAL, 0.0),
            ("join", "a", NORMAL, 0.0),
        ],
        None,
        {},
    )
    @given(
        st.lists(goes_last_op, max_size=80),
        st.sampled_from([None, 1.0]),
        st.sampled_from([{}, {"a": 3.0}]),
    )
    def test_only_of_a_newcomer_that_ends_the_order(
        self, ops: list[Any], aging: float | None, weights: dict[str, float]
    ) -> None:
        line: Line[int] = Line(aging=aging, weights=weights)
        now = 0.0
        grants: list[tuple[Any, float]] = []
        for n, op in enumerate(ops):
            if op[0] == "join":
                line.join(n, f"new-{n}" if op[1] == "new" else op[1], op[2], now - op[3])
                if line.is_last(n, now):
                    self.assertEqual(list(line.order(now))[-1], n)
            elif op[0] == "pop":
                popped = line.grant(now)
                if popped is not None:
                    grants.append((popped[1], op[1]))
            elif op[0] == "admit":
                grant, _ = line.admit(f"new-{n}" if op[1] == "new" else op[1], NORMAL, now)
                grants.append((grant, op[2]))
            elif op[0] == "leave" and len(line):
                line.leave(list(line.order(now))[op[1] % len(line)])
            elif op[0] == "settle" and grants:
                line.settle(*grants.pop(op[1] % len(grants)))
            elif op[0] == "wait":
                now += op[1]

    def test_thousands_of_clients_waiting_once_each_go_last_as_they_come(self) -> None:
        line: Line[int] = Line(aging=120.0)
        line.admit("earlier", NORMAL, 0.0)  # a client that owes slot time but does not wait
        for i in range(2000):
            line.join(i, f"client-{i}", NORMAL, i * 0.001)
            self.assertTrue(line.is_last(i, i * 0.001))
        line.join(2000, "client-7", NORMAL, 2.0)  # a second waiter starts after V
        self.assertFalse(line.is_last(2000, 2.0))

    def test_newcomers_go_last_without_a_walk_again_once_a_worse_class_left(self) -> None:
        """A batch waiter gave up while others wait: the normal newcomers after it end the
        order, and are told so without a walk."""
        line: Line[str] = Line()
        line.join("batch", "b", BATCH, 0.0)
        line.join("n0", "c0", NORMAL, 0.0)
        self.assertFalse(line.is_last("n0", 0.0))
        line.leave("batch")
        for i in range(1, 50):
            line.join(f"n{i}", f"c{i}", NORMAL, float(i))
            self.assertTrue(line.is_last(f"n{i}", float(i)))

    def test_a_client_that_comes_back_behind_a_newer_one_goes_last_without_a_walk(self) -> None:
        """p stays in the table (it owed when it went idle); q, newer, was served since, so V
        passed p's finish. p's newcomer arrived last and alone at that moment: it is last."""
        line: Line[str] = Line()
        line.admit("p", NORMAL, 0.0)
        line.admit("q", NORMAL, 0.0)
        line.join("q1", "q", NORMAL, 1.0)
        line.grant(1.0)
        line.join("s1", "s", NORMAL, 2.0)
        line.join("p1", "p", NORMAL, 3.0)
        self.assertEqual(list(line.order(3.0)), ["s1", "p1"])
        self.assertTrue(line.is_last("p1", 3.0))


@dataclass
class Sim:
    """A limiter on a Clock with scripted arrivals; records what a client would see."""

    slots: int
    aging: float | None = None
    weights: dict[str, float] = field(default_factory=dict)
    clock: Clock = field(default_factory=Clock)
    sem: PositionedSemaphore = field(init=False)
    granted: list[tuple[int, str, int, float]] = field(default_factory=list)  # id, client, rank
    joined: dict[int, tuple[str, int, float]] = field(default_factory=dict)
    reports: dict[int, list[tuple[float, int]]] = field(default_factory=dict)
    service: dict[str, float] = field(default_factory=dict)
    pending: dict[int, Deferred[Slot]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.sem = PositionedSemaphore(
            self.slots, self.clock, report_interval=INTERVAL, aging=self.aging, weights=self.weights
        )

    def arrive(self, i: int, client: str, rank: int, hold: float) -> None:
        self.joined[i] = (client, rank, self.clock.seconds())
        self.reports[i] = []
        d = self.sem.acquire_in_line(
            lambda p: self.reports[i].append((self.clock.seconds(), p)), client=client, rank=rank
        )
        self.pending[i] = d

        def got(slot: Slot) -> None:
            del self.pending[i]
            self.granted.append((i, client, rank, self.clock.seconds()))
            self.service[client] = self.service.get(client, 0.0) + hold
            self.clock.callLater(hold, slot.release)

        def gave_up(_: object) -> None:
            del self.pending[i]

        d.addCallbacks(got, gave_up)

    def truth(self) -> dict[int, int]:
        ids = {id(d): i for i, d in self.pending.items()}
        now = self.clock.seconds()
        return {ids[id(d)]: k for k, d in enumerate(self.sem.line.order(now), start=1)}

    def check_idle_slots(self, test: TestCase) -> None:
        if self.sem.in_use < self.sem.limit:
            test.assertEqual(len(self.sem.waiting), 0, "a slot idles while someone waits")


arrival = st.tuples(
    st.sampled_from([0.0, 0.0, 0.05, 0.2, 1.0]),  # gap before it
    st.sampled_from(["a", "b", "c"]),
    st.sampled_from([INTERACTIVE, NORMAL, BATCH]),
    st.sampled_from([0.05, 0.3, 1.0, 3.0]),  # slot time it holds
    st.booleans(),  # it gives up after a while
)


class EventClock(Clock):
    """A Clock that runs `after_each` after every call it fires, so a test can look at the line
    after each event (a release, a cancel, an aging timer, a renumbering pass), not once a step.
    `step` moves to the next call's time or by `most`, whichever is sooner, so that each call
    runs at its own time as under a reactor that keeps up."""

    def __init__(self) -> None:
        super().__init__()
        self.after_each: Callable[[], None] = lambda: None

    def callLater(self, delay: float, f: Callable[..., object], *a: object, **kw: object) -> Any:
        def event() -> None:
            f(*a, **kw)
            self.after_each()

        return super().callLater(delay, event)

    def step(self, most: float) -> None:
        soonest = min((call.getTime() for call in self.calls), default=math.inf)
        self.advance(min(most, soonest - self.seconds()))

    def mid_turn(self) -> bool:
        """Another call is due now: the reactor turn that runs this instant is not over."""
        return bool(self.calls) and self.calls[0].getTime() <= self.seconds()


class LimiterProperties(TestCase):
    @settings(max_examples=80)
    @given(
        st.lists(arrival, min_size=1, max_size=40),
        st.integers(1, 3),
        st.sampled_from([1.0, 4.0]),
        st.sampled_from([{}, {"a": 3.0}]),
    )
    def test_work_conserving_fifo_per_client_and_honest_positions(
        self, arrivals: list[Any], slots: int, aging: float, weights: dict[str, float]
    ) -> None:
        """After every event (once the calls due at that instant have run, as within one reactor
        turn) no waiter's last reported position is lower than its true one, and a fall is told
        within the pass interval."""
        clock = EventClock()
        sim = Sim(slots, aging=aging, weights=weights, clock=clock)
        history: deque[tuple[float, dict[int, int]]] = deque()

        def check() -> None:
            truth = sim.truth()
            history.append((clock.seconds(), truth))
            if clock.mid_turn():
                return
            for i, position in truth.items():
                self.assertGreaterEqual(sim.reports[i][-1][1], position, "lower than the truth")

        clock.after_each = check
        script = deque(enumerate(arrivals))
        next_at = 0.0
        while script or sim.pending or sim.sem.in_use:
            now = clock.seconds()
            while script and now >= next_at:
                i, (_gap, client, rank, hold, gives_up) = script.popleft()
                sim.arrive(i, client, rank, hold)
                if gives_up and i in sim.pending:
                    clock.callLater(2.5, sim.pending[i].cancel)
                next_at = now + (script[0][1][0] if script else 0)
                check()
                newcomer = sim.reports[i]
                if newcomer:
                    self.assertEqual(newcomer[0][1], sim.truth()[i], "a newcomer's first report")
            sim.check_idle_slots(self)
            while history and history[0][0] < now - INTERVAL - STEP:
                history.popleft()
            for i in sim.pending:
                seen = [t[i] for _, t in history if i in t]
                self.assertLessEqual(sim.reports[i][-1][1], max(seen), "staler than the bound")
            clock.step(STEP)
            check()
        for i, _, _, _ in sim.granted:
            self.assertEqual(sim.reports[i][-1][1] if sim.reports[i] else 1, 1)
        for client in "abc":
            for rank in (INTERACTIVE, NORMAL, BATCH):
                served = [i for i, c, r, _ in sim.granted if c == client and r == rank]
                self.assertEqual(served, sorted(served), "FIFO within a client and class")
        sim.sem.close()
        self.assertEqual(sim.sem.in_use, 0)

    @settings(max_examples=30)
    @given(st.lists(st.tuples(st.sampled_from([0.0, 0.1, 0.5]), st.floats(0.01, 2)), max_size=60))
    def test_one_client_one_class_is_exactly_fifo(self, arrivals: list[Any]) -> None:
        sim = Sim(2, aging=1.0)
        for i, (gap, hold) in enumerate(arrivals):
            sim.clock.advance(gap)
            sim.arrive(i, "only", NORMAL, hold)
        while sim.pending or sim.sem.in_use:
            sim.clock.advance(STEP)
        self.assertEqual([g[0] for g in sim.granted], list(range(len(arrivals))))
        sim.sem.close()

    @settings(max_examples=20)
    @given(st.floats(1.0, 20.0), st.sampled_from([0.2, 0.5, 1.0]))
    def test_batch_is_served_within_two_aging_periods_under_steady_interactive_load(
        self, aging: float, hold: float
    ) -> None:
        sim = Sim(1, aging=aging)
        n = 0

        def keep_busy() -> None:  # the interactive client always has two more waiting
            nonlocal n
            while sum(1 for i in sim.pending if sim.joined[i][0] == "chat") < 2:
                sim.arrive(n, "chat", INTERACTIVE, hold)
                n += 1

        keep_busy()
        sim.arrive(10**6, "nightly", BATCH, hold)
        while 10**6 in sim.pending:
            sim.clock.advance(STEP)
            keep_busy()
        waited = next(t for i, _, _, t in sim.granted if i == 10**6)
        self.assertLessEqual(waited, 2 * aging + hold + STEP)
        self.assertGreater(waited, aging, "it overtook interactive work before aging")
        sim.clock.advance(10 * hold)
        sim.sem.close()

    @settings(max_examples=27)
    @given(
        st.sampled_from([(1.0, 1.0), (2.0, 1.0), (3.0, 1.0)]),
        st.sampled_from([(0.1, 1.0), (1.0, 1.0), (2.0, 0.2)]),
        st.integers(1, 3),
    )
    def test_slot_time_follows_the_weights_not_the_request_count(
        self, weights: tuple[float, float], holds: tuple[float, float], slots: int
    ) -> None:
        """Two clients always backlogged, one's requests maybe 10x longer: over a long run each
        gets slot time in proportion to its weight, within 10 %."""
        sim = Sim(slots, aging=None, weights={"a": weights[0], "b": weights[1]})
        hold = {"a": holds[0], "b": holds[1]}
        n = 0
        while sim.clock.seconds() < 200:
            for client in "ab":
                while sum(1 for i in sim.pending if sim.joined[i][0] == client) < 3:
                    sim.arrive(n, client, NORMAL, hold[client])
                    n += 1
            sim.check_idle_slots(self)
            sim.clock.advance(STEP)
        share = sim.service["a"] / (sim.service["a"] + sim.service["b"])
        expected = weights[0] / sum(weights)
        self.assertLessEqual(abs(share - expected), 0.1 * expected, f"share {share:.3f}")
        for d in list(sim.pending.values()):
            d.cancel()
        sim.clock.advance(10)
        sim.sem.close()


class Limits(TestCase):
    def test_max_waiting_refuses_that_client_alone(self) -> None:
        clock = Clock()
        sem = PositionedSemaphore(1, clock, max_waiting={"script": 2})
        sem.acquire_in_line(client="script")
        sem.acquire_in_line(client="script")
        sem.acquire_in_line(client="script")
        with self.assertRaises(ClientQueueFull) as raised:
            sem.acquire_in_line(client="script")
        self.assertEqual((raised.exception.client, raised.exception.limit), ("script", 2))
        self.assertIsInstance(raised.exception, QueueFull)
        sem.acquire_in_line(client="chat")
        self.assertEqual(len(sem.waiting), 3)

    def test_resize_grants_new_slots_at_once_and_never_revokes(self) -> None:
        clock = Clock()
        sem = PositionedSemaphore(1, clock)
        held = [sem.acquire_in_line()]
        last: list[int] = []
        waiting = [sem.acquire_in_line(), sem.acquire_in_line(), sem.acquire_in_line(last.append)]
        sem.resize(3)
        self.assertEqual([d.called for d in waiting], [True, True, False])
        self.assertEqual(sem.in_use, 3)
        clock.advance(sem.report_interval)
        self.assertEqual(last, [3, 1], "those still waiting learn they moved up")
        sem.resize(1)
        self.assertEqual(sem.in_use, 3, "held slots are never revoked")
        held[0].result.release()
        waiting[0].result.release()
        self.assertFalse(waiting[2].called, "two held, one slot: nobody new gets one")
        waiting[1].result.release()
        self.assertTrue(waiting[2].called)
        waiting[2].result.release()
        self.assertEqual((sem.in_use, sem.tokens), (0, 1))
        sem.close()

    def test_configure_line_changes_weights_and_caps_without_reordering_a_client(self) -> None:
        clock = Clock()
        sem = PositionedSemaphore(1, clock, max_waiting={"a": 1})
        sem.acquire_in_line(client="a")
        first = sem.acquire_in_line(client="a")
        sem.configure_line(aging=5.0, weights={"a": 3.0}, max_waiting={})
        second = sem.acquire_in_line(client="a")  # the cap is gone
        self.assertEqual(list(sem.line.order(0.0)), [first, second])
        self.assertEqual((sem.line.aging, sem.line._clients["a"].weight), (5.0, 3.0))
        sem.close()

    def test_a_slot_released_twice_frees_one_slot(self) -> None:
        clock = Clock()
        sem = PositionedSemaphore(1, clock)
        slot = self.successResultOf(sem.acquire_in_line())
        slot.release()
        slot.release()
        self.assertEqual((sem.in_use, sem.tokens), (0, 1))
