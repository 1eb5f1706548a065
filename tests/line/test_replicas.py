"""Replicas: the circuit, the choice of replica, and one line over several upstreams' slots."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from homelab_gateway.core.replicas import (
    DOWN,
    HALF_OPEN,
    UP,
    Circuit,
    Sessions,
    choose,
    session_key,
)
from homelab_gateway.line.limiter import PositionedSemaphore, Replica, Slot


class CircuitStates(SynchronousTestCase):
    def test_failures_in_a_row_take_it_out_then_one_trial_brings_it_back(self) -> None:
        circuit = Circuit(failures_to_open=3, cooldown=30)
        self.assertIsNone(circuit.failed(0, "refused"))
        self.assertIsNone(circuit.failed(1, "refused"))
        self.assertEqual(circuit.failed(2, "refused"), DOWN)
        self.assertEqual((circuit.down_since, circuit.retry_at), (2, 32))
        self.assertFalse(circuit.admits(31.9))
        self.assertTrue(circuit.admits(32))
        self.assertTrue(circuit.begin(), "the first request after the cool-down is the trial")
        self.assertEqual(circuit.state, HALF_OPEN)
        self.assertFalse(circuit.admits(33), "one trial at a time")
        self.assertEqual(circuit.succeeded(), UP)
        self.assertTrue(circuit.admits(33))
        self.assertFalse(circuit.begin())

    def test_a_success_between_failures_resets_the_count(self) -> None:
        circuit = Circuit(failures_to_open=2)
        circuit.failed(0, "x")
        circuit.succeeded()
        self.assertIsNone(circuit.failed(1, "x"))
        self.assertEqual(circuit.state, UP)

    def test_a_failed_trial_starts_a_new_cool_down_and_keeps_down_since(self) -> None:
        circuit = Circuit(failures_to_open=1, cooldown=10)
        circuit.failed(5, "refused")
        circuit.begin()
        self.assertEqual(circuit.failed(15, "refused again"), DOWN)
        self.assertEqual((circuit.down_since, circuit.retry_at), (5, 25))
        self.assertEqual(circuit.last_error, "refused again")

    def test_late_failures_of_requests_started_before_do_not_extend_the_cool_down(self) -> None:
        circuit = Circuit(failures_to_open=1, cooldown=10)
        circuit.failed(0, "refused")
        self.assertIsNone(circuit.failed(4, "refused"))
        self.assertEqual(circuit.retry_at, 10)

    def test_an_abandoned_trial_lets_the_next_request_try(self) -> None:
        circuit = Circuit(failures_to_open=1, cooldown=1)
        circuit.failed(0, "x")
        circuit.begin()
        circuit.abandoned()
        self.assertTrue(circuit.admits(1))

    def test_a_probe_brings_it_back_at_once(self) -> None:
        circuit = Circuit(failures_to_open=1, cooldown=100)
        circuit.failed(0, "x")
        self.assertEqual(circuit.probed(), UP)
        self.assertIsNone(circuit.probed())
        self.assertIsNone(circuit.down_since)


@dataclass
class Box:
    name: str
    free: int
    fallback: bool = False


class Choice(SynchronousTestCase):
    def test_most_free_slots_then_ties_in_turn(self) -> None:
        a, b, c = Box("a", 1), Box("b", 3), Box("c", 3)
        self.assertEqual([choose([a, b, c], None, turn).name for turn in range(4)], list("bcbc"))

    def test_the_session_s_last_replica_while_it_has_a_free_slot(self) -> None:
        a, b = Box("a", 1), Box("b", 3)
        self.assertEqual(choose([a, b], "a", 0).name, "a")
        self.assertEqual(choose([b], "a", 0).name, "b", "a is full: the session moves")

    def test_a_fallback_only_when_no_other_replica_has_a_free_slot(self) -> None:
        ollama = Box("ollama", 4, fallback=True)
        self.assertEqual(choose([Box("vllm", 1), ollama], "ollama", 0).name, "vllm")
        self.assertEqual(choose([ollama], None, 0).name, "ollama")

    @given(
        st.lists(st.tuples(st.integers(1, 8), st.booleans()), min_size=1, max_size=5, unique=False),
        st.integers(0, 10),
    )
    def test_the_choice_is_always_a_best_candidate(
        self, shapes: list[tuple[int, bool]], turn: int
    ) -> None:
        boxes = [Box(f"r{i}", free, fallback) for i, (free, fallback) in enumerate(shapes)]
        chosen = choose(boxes, None, turn)
        if any(not b.fallback for b in boxes):
            self.assertFalse(chosen.fallback)
        tier = [b for b in boxes if b.fallback == chosen.fallback]
        self.assertEqual(chosen.free, max(b.free for b in tier))


class SessionTable(SynchronousTestCase):
    def test_bounded_least_recently_used(self) -> None:
        sessions = Sessions(size=2)
        sessions.served("s1", "a")
        sessions.served("s2", "b")
        self.assertEqual(sessions.get("s1"), "a")
        sessions.served("s1", "a")  # s1 is the most recent now
        sessions.served("s3", "a")
        self.assertEqual(len(sessions), 2)
        self.assertIsNone(sessions.get("s2"))
        self.assertEqual(sessions.get("s1"), "a")
        sessions.served(None, "a")
        self.assertEqual(len(sessions), 2)


class OneLineManyReplicas(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.a = Replica("a", 2, circuit=Circuit(failures_to_open=1, cooldown=10))
        self.b = Replica("b", 2, circuit=Circuit(failures_to_open=1, cooldown=10))
        self.line = PositionedSemaphore([self.a, self.b], self.clock)
        self.addCleanup(self.line.close)

    def take(self, **kw: object) -> list[Slot]:
        got: list[Slot] = []
        self.line.acquire_in_line(**kw).addCallback(got.append)  # type: ignore[arg-type]
        return got

    def test_slots_spread_over_replicas_and_the_line_takes_the_first_to_free(self) -> None:
        slots = [self.take()[0] for _ in range(4)]
        self.assertEqual((self.a.held, self.b.held), (2, 2))
        waiter = self.take()
        self.assertEqual(waiter, [])
        slots[3].release()
        self.assertEqual(waiter[0].replica, slots[3].replica)

    def test_a_waiter_only_takes_its_own_replicas(self) -> None:
        slots = [self.take()[0] for _ in range(4)]
        only_b = self.take(among=frozenset({self.b}), client="x")
        anyone = self.take(client="y")
        released_a = next(s for s in slots if s.replica is self.a)
        released_a.release()
        self.assertEqual(only_b, [], "a slot of a is no use to a waiter for b")
        self.assertEqual(anyone[0].replica, self.a, "the one behind it takes it out of turn")
        next(s for s in slots if s.replica is self.b).release()
        self.assertEqual(only_b[0].replica, self.b)

    def test_a_replica_out_of_rotation_takes_nothing_until_its_trial(self) -> None:
        first = self.take()[0]
        first.failed("refused")
        first.release()
        self.assertEqual(self.a.circuit.state if first.replica is self.a else None, DOWN)
        others = [self.take()[0] for _ in range(2)]
        self.assertTrue(all(s.replica is self.b for s in others))
        waiter = self.take()
        self.assertEqual(waiter, [], "b is full and a is out of rotation")
        self.clock.advance(10)
        self.assertEqual(waiter[0].replica, self.a, "the cool-down ended: the trial")
        self.assertTrue(waiter[0].trial)
        waiter[0].succeeded()
        self.assertEqual(self.a.circuit.state, UP)

    def test_a_retry_waits_ahead_of_the_line_and_avoids_the_replica_it_failed_on(self) -> None:
        slots = [self.take(client="c")[0] for _ in range(4)]
        positions: list[int] = []
        waiting = self.take(client="w", on_position=positions.append)
        self.assertEqual(positions, [1])
        failed = next(s for s in slots if s.replica is self.a)
        retry = self.take(client="c", avoid=frozenset({self.a}), first=True)
        self.assertEqual(positions, [1, 2], "the retry went ahead: told at once")
        failed.release()
        self.assertEqual(retry, [], "the retry avoids a while b is in rotation")
        self.assertEqual(waiting[0].replica, self.a)
        next(s for s in slots if s.replica is self.b).release()
        self.assertEqual(retry[0].replica, self.b)

    def test_sessions_stay_on_their_replica(self) -> None:
        replicas = set()
        for _ in range(10):
            slot = self.take(session="conversation")[0]
            replicas.add(slot.replica.name)
            slot.release()
        self.assertEqual(len(replicas), 1)

    def test_cancelling_a_restricted_waiter_keeps_the_count_right(self) -> None:
        slots = [self.take()[0] for _ in range(4)]
        d = self.line.acquire_in_line(among=frozenset({self.b}))
        d.addErrback(lambda f: f.trap(CancelledError))
        d.cancel()
        self.assertEqual(self.line.dispatch._restricted, 0)
        slots[0].release()
        self.assertEqual(len(self.line.waiting), 0)

    def test_a_reload_joining_two_lines_moves_the_waiters_with_their_place(self) -> None:
        solo = Replica("solo", 1)
        old = PositionedSemaphore([solo], self.clock)
        held = old.acquire_in_line()
        told: list[int] = []
        moved = []
        old.acquire_in_line(on_position=told.append).addCallback(moved.append)
        self.assertEqual(told, [1])
        self.assertTrue(held.called)
        joined = PositionedSemaphore([solo, self.a], self.clock)
        self.addCleanup(joined.close)
        for _ in range(2):
            joined.acquire_in_line()  # a's two slots
        joined.adopt(old)
        self.assertEqual(len(old.waiting), 0)
        self.assertEqual(len(joined.waiting), 1)
        held.result.release()  # released through solo's new line
        self.assertEqual(moved[0].replica, solo)
        self.assertEqual(told, [1])


class LineOfReplicasMachine(RuleBasedStateMachine):
    """Any sequence of joins, releases, cancels, failures, probes and time over one line of
    three replicas keeps the limiter's promises."""

    def __init__(self) -> None:
        super().__init__()
        self.clock = Clock()
        self.replicas = [
            Replica(name, limit, fallback=name == "c", circuit=Circuit(2, 10.0))
            for name, limit in (("a", 2), ("b", 1), ("c", 1))
        ]
        self.line = PositionedSemaphore(self.replicas, self.clock, aging=30.0)
        self.held: list[Slot] = []
        self.waiting: dict[Deferred[Slot], frozenset[Replica] | None] = {}
        self.told: dict[Deferred[Slot], list[int]] = {}

    @rule(
        client=st.sampled_from(["x", "y"]),
        rank=st.integers(0, 2),
        among=st.sets(st.integers(0, 2), max_size=3),
        session=st.sampled_from([None, "s1", "s2"]),
        first=st.booleans(),
    )
    def join(
        self, client: str, rank: int, among: set[int], session: str | None, first: bool
    ) -> None:
        chosen = frozenset(self.replicas[i] for i in among) or None
        told: list[int] = []
        d = self.line.acquire_in_line(
            told.append, client=client, rank=rank, among=chosen, session=session, first=first
        )
        if d.called:
            self.held.append(d.result)
            return
        self.waiting[d] = chosen
        self.told[d] = told
        d.addCallback(self._granted, d)

    def _granted(self, slot: Slot, d: Deferred[Slot]) -> Slot:
        among = self.waiting.pop(d)
        assert among is None or slot.replica in among, "a slot outside the waiter's replicas"
        self.held.append(slot)
        return slot

    @precondition(lambda self: self.held)
    @rule(index=st.integers(0, 100), verdict=st.sampled_from(["none", "ok", "failed"]))
    def release(self, index: int, verdict: str) -> None:
        slot = self.held.pop(index % len(self.held))
        if verdict == "ok":
            slot.succeeded()
        elif verdict == "failed":
            slot.failed("refused")
        slot.release()

    @precondition(lambda self: self.waiting)
    @rule(index=st.integers(0, 100))
    def cancel(self, index: int) -> None:
        d = list(self.waiting)[index % len(self.waiting)]
        del self.waiting[d]
        d.addErrback(lambda f: f.trap(CancelledError))
        d.cancel()

    @rule(seconds=st.sampled_from([0.1, 0.5, 5.0, 10.0, 31.0]))
    def wait(self, seconds: float) -> None:
        self.clock.advance(seconds)

    @rule(index=st.integers(0, 2))
    def probe(self, index: int) -> None:
        self.line.recovered(self.replicas[index])

    @invariant()
    def no_replica_over_its_slots(self) -> None:
        for replica in self.replicas:
            assert 0 <= replica.held <= replica.limit
            assert replica.held == sum(1 for s in self.held if s.replica is replica)

    @invariant()
    def nobody_waits_for_a_slot_it_could_take(self) -> None:
        now = self.clock.seconds()
        assert len(self.line.waiting) == len(self.waiting)
        for among in self.waiting.values():
            usable = among or frozenset(self.replicas)
            assert not any(r.open_at(now) for r in usable), (among, self.replicas)

    @invariant()
    def no_position_told_is_better_than_the_truth(self) -> None:
        order = list(self.line.dispatch.order(self.clock.seconds()))
        for d, told in self.told.items():
            if d in self.waiting and told:
                assert told[-1] >= order.index(d) + 1, (told, order.index(d) + 1)

    def teardown(self) -> None:
        self.line.close()


LineOfReplicasMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=40)
TestLineOfReplicas = LineOfReplicasMachine.TestCase


@given(st.one_of(st.text(min_size=1), st.binary(min_size=1)))
def test_a_session_key_has_one_size_whatever_the_client_sent(session: str | bytes) -> None:
    key = session_key(session)
    assert key is not None and len(key) == 32
    assert key == session_key(session)
    assert session_key("") is None and session_key(None) is None


def test_a_session_from_a_header_and_from_the_body_are_one_session() -> None:
    assert session_key(b"s-1") == session_key("s-1") != session_key("s-2")
