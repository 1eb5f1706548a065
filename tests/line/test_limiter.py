"""The slot limiter on a Clock: what it relies on from DeferredSemaphore, positions, scale."""

from __future__ import annotations

from collections import deque

from twisted.internet.defer import CancelledError, DeferredSemaphore
from twisted.internet.task import Clock
from twisted.trial.unittest import TestCase

from homelab_gateway.core import line as line_module
from homelab_gateway.core.dispatch import Replica
from homelab_gateway.core.line import CLASS_RANK
from homelab_gateway.line.limiter import REPORT_INTERVAL, PositionedSemaphore, Slot
from homelab_gateway.line.refusals import QueueFull
from testsupport.helpers import SoonerResetClock

INTERACTIVE, NORMAL, BATCH = (CLASS_RANK[c] for c in ("interactive", "normal", "batch"))


class BaseClassBehaviourWeRelyOn(TestCase):
    """If a Twisted release changes these, the limiter's assumptions break: fail here first."""

    def test_waiting_is_a_fifo_list_and_release_hands_over_synchronously(self) -> None:
        sem = DeferredSemaphore(1)
        sem.acquire()
        first, second = sem.acquire(), sem.acquire()
        self.assertEqual(sem.waiting, [first, second])
        sem.release()
        self.assertTrue(first.called)  # synchronously, inside release()
        self.assertEqual(sem.waiting, [second])
        self.assertEqual(sem.tokens, 0)

    def test_cancel_removes_the_waiter_through_cancel_acquire(self) -> None:
        sem = DeferredSemaphore(1)
        sem.acquire()
        d = sem.acquire()
        d.cancel()
        self.failureResultOf(d, CancelledError)
        self.assertEqual(sem.waiting, [])
        sem.release()
        self.assertEqual(sem.tokens, 1)


class Positions(TestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.sem = PositionedSemaphore(1, self.clock, report_interval=0.5)
        self.addCleanup(self.sem.close)

    def waiter(self) -> tuple[object, list[int]]:
        seen: list[int] = []
        return self.sem.acquire_in_line(seen.append), seen

    def test_a_free_slot_is_taken_with_no_position_report(self) -> None:
        d, seen = self.waiter()
        self.assertTrue(d.called)
        self.assertEqual(seen, [])
        self.assertEqual(self.sem.in_use, 1)

    def test_waiters_learn_their_position_at_once_then_as_the_line_moves(self) -> None:
        self.waiter()
        _, a = self.waiter()
        _, b = self.waiter()
        _, c = self.waiter()
        self.assertEqual((a, b, c), ([1], [2], [3]))
        self.sem.release()  # a gets the slot
        self.assertEqual((b, c), ([2], [3]), "renumbering waits for the coalescing pass")
        self.clock.advance(0.5)
        self.assertEqual((b, c), ([2, 1], [3, 2]))

    def test_acquiring_reports_position_1_first_if_it_was_not_reported(self) -> None:
        self.waiter()
        _, a = self.waiter()
        _, b = self.waiter()
        self.sem.release()
        self.sem.release()  # both released before any pass ran
        self.assertEqual(b, [2, 1])
        self.assertEqual(a, [1])

    def test_cancelled_waiter_leaves_and_those_behind_move_up(self) -> None:
        self.waiter()
        d1, a = self.waiter()
        _, b = self.waiter()
        d1.cancel()
        self.failureResultOf(d1, CancelledError)
        self.assertEqual(len(self.sem.waiting), 1)
        self.clock.advance(0.5)
        self.assertEqual(b, [2, 1])
        self.assertEqual(a, [1])
        self.sem.release()
        self.assertEqual(self.sem.in_use, 1)

    def test_queue_limit(self) -> None:
        limited = PositionedSemaphore(1, self.clock, queue_limit=2)
        limited.acquire_in_line()
        limited.acquire_in_line()
        limited.acquire_in_line()
        with self.assertRaises(QueueFull):
            limited.acquire_in_line()
        self.assertEqual(len(limited.waiting), 2)

    def test_no_pass_is_scheduled_without_listeners(self) -> None:
        self.sem.acquire_in_line()
        self.sem.acquire_in_line()  # no listener
        self.sem.release()
        self.assertEqual(self.clock.getDelayedCalls(), [])


class FallRate(TestCase):
    def test_a_moving_line_tells_a_waiter_about_once_a_second_and_within_a_second(self) -> None:
        """The default pass: in a line that moves every 1/8 s a waiter gets one frame per second
        of waiting (a 0.4 s pass sent 2.5), never shows a place better than its true one, and
        shows a place no worse than where it truly was REPORT_INTERVAL earlier."""
        step, ahead = 0.125, 32
        clock = Clock()
        sem = PositionedSemaphore(1, clock)
        self.addCleanup(sem.close)
        sem.acquire()
        for _ in range(ahead):
            sem.acquire_in_line(lambda position: None)
        seen: list[int] = []
        d = sem.acquire_in_line(seen.append)

        def truth(at: float) -> int:  # one waiter ahead is granted every step
            return ahead + 1 - int(at / step)

        while not d.called:
            clock.advance(step)
            sem.release()
            now = clock.seconds()
            if not d.called:
                self.assertGreaterEqual(seen[-1], truth(now))
                self.assertLessEqual(seen[-1], truth(max(0.0, now - REPORT_INTERVAL)))
        waited = clock.seconds()
        self.assertEqual(waited, (ahead + 1) * step)
        self.assertEqual(seen[-1], 1)
        # The first frame, one per second of waiting, and position 1 with the slot.
        self.assertLessEqual(len(seen), 1 + int(waited / REPORT_INTERVAL) + 1)


class Rises(TestCase):
    """A position that goes up is told at once (never shown lower than the truth); one that goes
    down waits for the coalesced pass."""

    def setUp(self) -> None:
        self.clock = SoonerResetClock()
        self.sem = PositionedSemaphore(1, self.clock, report_interval=0.5, aging=10.0)
        self.addCleanup(self.sem.close)

    def waiter(self, client: str, rank: int = NORMAL) -> tuple[object, list[int]]:
        seen: list[int] = []
        return self.sem.acquire_in_line(seen.append, client=client, rank=rank), seen

    def aging_timers(self) -> list[float]:
        """When the aging timer is set to go off (none, or one)."""
        return [c.getTime() for c in self.clock.getDelayedCalls() if c.func == self.sem._aged]

    def test_an_arrival_that_goes_ahead_tells_those_it_passed_at_once(self) -> None:
        self.sem.acquire_in_line(client="script")
        seen = [self.waiter("script")[1] for _ in range(3)]
        _, chat = self.waiter("chat", INTERACTIVE)
        self.assertEqual(chat, [1])
        self.assertEqual(seen, [[1, 2], [2, 3], [3, 4]])
        self.clock.advance(0.5)
        self.assertEqual(seen, [[1, 2], [2, 3], [3, 4]])

    def test_an_arrival_that_goes_last_tells_nobody_else_and_schedules_nothing(self) -> None:
        self.sem = PositionedSemaphore(1, self.clock, report_interval=0.5)
        self.sem.acquire_in_line(client="chat")
        _, first = self.waiter("chat")
        _, nightly = self.waiter("nightly", BATCH)
        self.assertEqual((first, nightly), ([1], [2]))
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_ageing_into_a_better_class_tells_those_passed_at_once(self) -> None:
        self.sem.acquire_in_line(client="chat")
        _, nightly = self.waiter("nightly", BATCH)
        self.clock.advance(5)
        _, chat = self.waiter("chat")
        self.assertEqual((nightly, chat), ([1, 2], [1]))
        self.clock.advance(0.5)  # the pass: nothing fell
        self.clock.advance(4.5)  # nightly has waited 10 s: it is served as normal, and earlier
        self.assertEqual(chat, [1, 2])
        self.assertEqual(nightly, [1, 2], "the fall waits for the pass")
        self.clock.advance(0.5)
        self.assertEqual(nightly, [1, 2, 1])

    def nightly_elsewhere(self) -> tuple[PositionedSemaphore, list[int]]:
        """A line of its own where a batch waiter has queued since 0 s, and what it is told;
        a reload will move it into this test's line, whose slot is taken at 0 s too."""
        old = PositionedSemaphore(1, self.clock, report_interval=0.5, aging=10.0)
        self.addCleanup(old.close)
        old.acquire_in_line(client="x")
        nightly: list[int] = []
        old.acquire_in_line(nightly.append, client="nightly", rank=BATCH)
        self.sem.acquire_in_line(client="x")
        return old, nightly

    def test_an_adopted_waiter_ageing_past_one_of_the_new_line_tells_it_at_once(self) -> None:
        """A reload moves a batch waiter into a line whose waiters it will overtake by ageing;
        nothing else joins after it, so the adoption itself must set the aging timer."""
        old, nightly = self.nightly_elsewhere()
        self.clock.advance(5)
        _, chat = self.waiter("chat")
        self.sem.adopt(old)
        self.assertEqual((chat, nightly), ([1], [1, 2]))
        self.clock.advance(0.5)  # the pass the adoption scheduled: nothing moved
        self.clock.advance(4.5)  # nightly has waited 10 s: served as normal, it arrived first
        self.assertEqual(chat, [1, 2])

    def test_an_adopted_waiter_that_ages_before_the_new_lines_timer_moves_it_sooner(self) -> None:
        """The new line's timer waits for its own waiters' crossing at 15 s; the adopted one,
        older, crosses at 10 s: a new call, not a `reset` to a sooner time (a real reactor
        searches every timer for that)."""
        old, nightly = self.nightly_elsewhere()
        self.clock.advance(5)
        (_, chat), (_, pal) = self.waiter("chat"), self.waiter("pal")
        self.sem.adopt(old)
        self.assertEqual((chat, pal, nightly), ([1], [2], [1, 3]))
        self.assertEqual((self.aging_timers(), self.clock.moved_sooner), ([10.0], 0))
        self.clock.advance(0.5)
        self.clock.advance(4.5)
        self.assertEqual((chat, pal), ([1, 2], [2, 3]))

    def test_clients_waiting_once_each_join_without_a_walk(self) -> None:
        """Each goes last (`Line.is_last`): its place is the line's length and nobody moved,
        so no walk of the order per join (quadratic for thousands of clients at once)."""
        walks = []
        order = self.sem.line.order
        self.sem.line.order = lambda now: walks.append(now) or order(now)  # type: ignore[method-assign]
        self.sem.acquire_in_line(client="x")
        waiters = [self.waiter(f"client-{i}") for i in range(50)]
        self.assertEqual(walks, [])
        self.assertEqual([seen for _, seen in waiters], [[i] for i in range(1, 51)])
        _, chat = self.waiter("chat", INTERACTIVE)  # one that goes ahead still walks
        self.assertEqual((chat, len(walks)), ([1], 1))
        self.assertEqual(waiters[-1][1], [50, 51])

    def test_the_aging_timer_is_at_the_next_crossing_after_every_join(self) -> None:
        """Clients and classes mixed, joining while the clock runs past crossings: after each
        join the one aging timer is at `Line.next_aging`."""
        self.sem.acquire_in_line(client="x")
        for i in range(40):
            self.waiter(f"client-{i % 7}", (BATCH, NORMAL, INTERACTIVE, BATCH)[i % 4])
            at = self.sem.line.next_aging(self.clock.seconds())
            self.assertEqual(self.aging_timers(), [] if at is None else [at], f"join {i}")
            self.clock.advance((0.5, 3.0, 1.5)[i % 3])

    def test_a_join_looks_for_the_aging_timer_at_no_more_cost_with_more_clients(self) -> None:
        """Every join looks for the next crossing; with thousands of clients waiting once each
        a look at every waiter per join made a burst of joins quadratic. Each waiter's next
        crossing is computed once in all the joins, not once per join."""
        found: list[int] = []
        aged_at = line_module.aged_at
        self.patch(line_module, "aged_at", lambda *a: found.append(1) or aged_at(*a))
        self.sem.acquire_in_line(client="x")
        found.clear()
        for i in range(2000):
            self.waiter(f"client-{i}", BATCH)
        self.assertLessEqual(len(found), 5 * 2000, "a few per join, whatever waits")
        self.assertEqual(self.aging_timers(), [self.sem.line.next_aging(self.clock.seconds())])

    def test_the_aging_timer_finds_its_waiter_crossed_at_an_epoch_clock(self) -> None:
        """The moment the timer is set for is the moment the line counts the waiter as aged,
        whatever the rounding of a large clock (here `(t + 0.3) - t < 0.3`): the rise is told
        when the timer goes off, not a step later."""
        sem = self.sem = PositionedSemaphore(1, self.clock, report_interval=0.5, aging=0.3)
        self.addCleanup(sem.close)
        self.clock.advance(1760000400.7349162)
        sem.acquire_in_line(client="chat")
        _, nightly = self.waiter("nightly", BATCH)
        self.clock.advance(0.1)
        _, chat = self.waiter("chat")
        self.assertEqual((nightly, chat), ([1, 2], [1]))
        (at,) = self.aging_timers()
        self.assertEqual(at, 1760000400.7349162 + 0.3)
        self.clock.advance(at - self.clock.seconds())
        self.assertEqual(chat, [1, 2], "nightly is served as normal, and owes nothing")

    def test_a_release_whose_correction_moves_a_client_back_tells_it_at_once(self) -> None:
        """Both clients were charged 1 s a grant; a's slot was held 10 s, so a's waiters go
        behind b's."""
        sem = self.sem = PositionedSemaphore(2, self.clock, report_interval=0.5)
        held = self.successResultOf(sem.acquire_in_line(client="a"))
        sem.acquire_in_line(client="b")
        (_, a1), (_, b1), (_, a2), (_, b2) = (self.waiter(c) for c in "abab")
        self.assertEqual((a1, b1, a2, b2), ([1], [2], [3], [4]))
        self.clock.advance(10)
        held.release()  # b1 gets the slot; a1 now waits behind b2
        self.assertEqual((a1, b1, a2, b2), ([1, 2], [2, 1], [3], [4]))
        self.clock.advance(0.5)
        self.assertEqual((a1, a2, b2), ([1, 2], [3], [4, 1]))

    def test_a_release_after_a_reload_moved_its_replica_tells_the_rise_in_the_old_line(
        self,
    ) -> None:
        """a's slot on r1 was held 10 s; a reload moved r1 to a new line meanwhile. The settle
        still moves a's waiter behind b's in the old line, which must say so at once."""
        r0, r1 = Replica("r0", 1), Replica("r1", 1)
        sem = self.sem = PositionedSemaphore([r0, r1], self.clock, report_interval=0.5)
        on_r1 = self.successResultOf(sem.acquire_in_line(client="a", among=frozenset({r1})))
        self.successResultOf(sem.acquire_in_line(client="b", among=frozenset({r0})))
        (_, a1), (_, b1) = self.waiter("a"), self.waiter("b")
        self.assertEqual((a1, b1), ([1], [2]))
        moved = PositionedSemaphore([r1], self.clock, report_interval=0.5)
        self.addCleanup(moved.close)
        self.clock.advance(10)
        on_r1.release()
        self.assertEqual((a1, b1), ([1, 2], [2]), "a now owes 9 s more than b")
        self.assertEqual(r1.held, 0)

    def test_a_plain_fifo_walks_the_line_only_in_the_coalesced_pass(self) -> None:
        """One client, one class: arrivals, grants and cancels walk nothing; one pass walks once."""
        walks = []
        order = self.sem.line.order
        self.sem.line.order = lambda now: walks.append(now) or order(now)  # type: ignore[method-assign]
        self.sem.acquire_in_line(client="only")
        waiters = [self.waiter("only") for _ in range(50)]
        self.sem.release()
        cancelled = waiters[5][0]
        cancelled.addErrback(lambda _: None)  # type: ignore[attr-defined]
        cancelled.cancel()  # type: ignore[attr-defined]
        self.assertEqual(walks, [])
        self.clock.advance(0.5)
        self.assertEqual(len(walks), 1)
        self.assertEqual(waiters[-1][1], [50, 48])

    def test_a_grant_finds_the_head_of_the_line_once(self) -> None:
        """Finding the head is a look at every client's queues: a slot handed over looks once,
        not once to find the waiter and again to pop it."""
        looks = []
        best_head = self.sem.line._best_head
        self.sem.line._best_head = lambda now: looks.append(now) or best_head(now)  # type: ignore[method-assign]
        slots: list[Slot] = []
        self.sem.acquire_in_line(client="a").addCallback(slots.append)
        waiters = [self.waiter(client)[0] for client in ("a", "b", "a", "b")]
        for waiter in waiters:
            waiter.addCallback(slots.append)  # type: ignore[attr-defined]
        looks.clear()
        slots[0].release()
        slots[1].release()
        self.assertEqual(sum(w.called for w in waiters), 2)  # type: ignore[attr-defined]
        self.assertEqual(len(looks), 2)


class Scale(TestCase):
    def test_two_thousand_waiters_behind_two_slots(self) -> None:
        """All finish in FIFO order; positions only go down, reach 1 before the slot, are never
        lower than the truth, lag it by at most the pass interval, and cost a handful of
        reports per waiter rather than one per release."""
        clock = Clock()
        sem = PositionedSemaphore(2, clock, report_interval=0.5)
        n, hold = 2000, 0.01
        reports: dict[int, list[tuple[float, int]]] = {i: [] for i in range(n)}
        order: list[int] = []
        deferreds = []

        def got_slot(_: object, i: int) -> None:
            order.append(i)
            self.assertEqual(reports[i][-1][1] if reports[i] else 1, 1)
            clock.callLater(hold, sem.release)

        sem.acquire()
        sem.acquire()  # both slots busy before the crowd arrives
        for i in range(n):
            d = sem.acquire_in_line(lambda p, i=i: reports[i].append((clock.seconds(), p)))
            d.addCallback(got_slot, i)
            deferreds.append(d)
        sem.release()
        sem.release()

        # The truth one pass interval (plus one simulated step of float drift) ago: a report
        # may lag the truth, never by more than that.
        interval_steps = round(0.5 / hold) + 2
        history: deque[dict[int, int]] = deque(maxlen=interval_steps)
        while len(order) < n:
            clock.advance(hold)
            truth = {id(d): k for k, d in enumerate(sem.waiting, start=1)}
            history.append(truth)
            for i, d in enumerate(deferreds):
                if d.called:
                    continue
                reported = reports[i][-1][1]
                self.assertGreaterEqual(reported, truth[id(d)], "a position lower than the truth")
                if len(history) == interval_steps and id(d) in history[0]:
                    self.assertLessEqual(reported, history[0][id(d)], "a report staler than 0.5 s")

        self.assertEqual(order, list(range(n)))
        for i in range(n):
            positions = [p for _, p in reports[i]]
            self.assertEqual(positions, sorted(positions, reverse=True))
            self.assertEqual(len(positions), len(set(positions)))
            self.assertEqual(positions[-1], 1)
        per_waiter = sem.reports / n
        # The line drains in n / 2 * hold = 10 s: about 20 passes at most, never ~1000 releases.
        self.assertLess(per_waiter, 25)
        clock.advance(1)  # the last holders release; any pending pass runs
        self.assertEqual(sem.in_use, 0)
        self.assertEqual(clock.getDelayedCalls(), [])


class Resize(TestCase):
    """A config reload changes `slots`: new grants follow the new limit, held slots stay."""

    def setUp(self) -> None:
        self.clock = Clock()
        self.sem = PositionedSemaphore(2, self.clock)

    def test_growing_hands_the_new_slots_to_the_head_of_the_line(self) -> None:
        self.sem.acquire_in_line()
        self.sem.acquire_in_line()
        first, second, third = (self.sem.acquire_in_line() for _ in range(3))
        self.sem.resize(4)
        self.assertTrue(first.called and second.called and not third.called)
        self.assertEqual((self.sem.limit, self.sem.in_use, self.sem.waiting), (4, 4, [third]))

    def test_shrinking_revokes_nothing_and_grants_again_below_the_new_limit(self) -> None:
        self.sem = PositionedSemaphore(3, self.clock)
        for _ in range(3):
            self.sem.acquire_in_line()
        waiter = self.sem.acquire_in_line()
        self.sem.resize(1)
        self.assertEqual((self.sem.limit, self.sem.in_use), (1, 3))
        self.sem.release()
        self.sem.release()
        self.assertFalse(waiter.called, "two held over a limit of 1: no grant yet")
        self.assertEqual(self.sem.in_use, 1)
        self.sem.release()
        self.assertTrue(waiter.called)
        self.assertEqual(self.sem.in_use, 1)
        self.assertEqual(self.sem.acquire_in_line().called, False)

    def test_a_free_slot_within_the_new_limit_is_taken_at_once(self) -> None:
        self.sem.acquire_in_line()
        self.sem.resize(1)
        self.assertFalse(self.sem.acquire_in_line().called)
        self.sem.resize(3)
        self.assertEqual(self.sem.in_use, 2)
        self.assertTrue(self.sem.acquire_in_line().called)

    def test_waiters_keep_their_place_through_a_resize(self) -> None:
        self.sem.acquire_in_line()
        self.sem.acquire_in_line()
        positions: list[list[int]] = [[], [], []]
        for i in range(3):
            self.sem.acquire_in_line(positions[i].append)
        self.sem.resize(3)
        self.clock.advance(1)
        self.assertEqual(positions, [[1], [2, 1], [3, 2]])


class MaxInFlight(TestCase):
    """A client's max_in_flight through the Twisted layer: positions, reloads, probes."""

    def setUp(self) -> None:
        self.clock = Clock()

    def line(self, members: list[Replica]) -> PositionedSemaphore:
        line = PositionedSemaphore(
            members, self.clock, report_interval=0.5, max_in_flight={"flood": 1}
        )
        self.addCleanup(line.close)
        return line

    def test_a_reload_that_gives_the_line_a_replica_keeps_the_cap(self) -> None:
        a, b = Replica("a", 1), Replica("b", 4)
        old = self.line([a])
        held = self.successResultOf(old.acquire_in_line(client="flood"))
        waiters = [old.acquire_in_line(client="flood") for _ in range(5)]
        new = self.line([a, b])
        new.adopt(old)
        self.assertEqual((b.held, len(new.waiting)), (0, 5), "flood holds its one slot on a")
        self.assertEqual(new.dispatch.in_flight, {"flood": 1})
        held.release()
        self.assertEqual(sum(d.called for d in waiters), 1)
        self.assertEqual(new.dispatch.in_flight, {"flood": 1})

    def test_the_grant_that_caps_a_client_tells_its_waiters_their_rise_at_once(self) -> None:
        line = self.line([Replica("r", 1)])
        self.successResultOf(line.acquire_in_line(client="other"))
        told: dict[str, list[int]] = {}
        for name, client in (("f1", "flood"), ("f2", "flood"), ("o1", "other"), ("o2", "other")):
            told[name] = []
            rank = CLASS_RANK["interactive" if client == "flood" else "normal"]
            line.acquire_in_line(told[name].append, client=client, rank=rank)
        self.assertEqual([told[n][-1] for n in ("f1", "f2", "o1", "o2")], [1, 2, 3, 4])
        line.resize(2)  # a free slot: f1 starts, which caps flood
        self.assertEqual(told["f2"][-1], 3, "told at once: behind both of other's now")
        self.assertEqual(line.dispatch.in_flight, {"other": 1, "flood": 1})
