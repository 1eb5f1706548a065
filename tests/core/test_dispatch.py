"""Who starts where (`core.dispatch`), on plain values: no Clock, no Deferred."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.trial.unittest import TestCase

from homelab_gateway.core.dispatch import Dispatch, Replica, Want
from homelab_gateway.core.line import CLASS_RANK
from homelab_gateway.core.replicas import DOWN

NORMAL = CLASS_RANK["normal"]


def replicas(*limits: int) -> list[Replica]:
    return [Replica(f"r{i}", limit) for i, limit in enumerate(limits)]


class Decisions(TestCase):
    def test_a_newcomer_starts_at_once_where_a_slot_is_free(self) -> None:
        dispatch: Dispatch[str] = Dispatch(replicas(1, 2))
        start = dispatch.admit("a", NORMAL, None, 0.0)
        assert start is not None
        self.assertEqual((start.item, start.replica.name, start.replica.held), (None, "r1", 1))

    def test_a_newcomer_kept_to_a_full_replica_waits(self) -> None:
        a, b = members = replicas(1, 1)
        dispatch: Dispatch[str] = Dispatch(members)
        a.held = 1
        want = dispatch.want(frozenset({a}), frozenset(), None)
        self.assertIsNone(dispatch.admit("x", NORMAL, want, 0.0))
        self.assertIsNotNone(dispatch.admit("y", NORMAL, None, 0.0))
        self.assertEqual(b.held, 1)

    def test_a_retry_starts_before_the_line_and_away_from_where_it_failed(self) -> None:
        a, b = members = replicas(1, 1)
        a.held = b.held = 1
        dispatch: Dispatch[str] = Dispatch(members)
        dispatch.join("first", "c", NORMAL, 0.0, None, retry=False)
        dispatch.join("retry", "c", NORMAL, 1.0, dispatch.want(None, frozenset({a}), None), True)
        self.assertEqual(list(dispatch.order(1.0)), ["retry", "first"])
        a.held = 0
        start = dispatch.next(1.0)
        assert start is not None
        self.assertEqual((start.item, start.replica), ("first", a), "b is busy, not out")
        a.held = 0
        b.circuit.state = DOWN
        b.circuit.retry_at = None
        start = dispatch.next(1.0)
        assert start is not None
        self.assertEqual((start.item, start.replica), ("retry", a), "b is out of rotation")

    def test_a_waiter_kept_to_a_busy_replica_lets_those_behind_it_pass(self) -> None:
        a, b = members = replicas(1, 1)
        a.held = b.held = 1
        dispatch: Dispatch[str] = Dispatch(members)
        dispatch.join(
            "on-a", "x", NORMAL, 0.0, dispatch.want(frozenset({a}), frozenset(), None), False
        )
        dispatch.join("anywhere", "y", NORMAL, 1.0, None, False)
        b.held = 0
        start = dispatch.next(2.0)
        assert start is not None
        self.assertEqual((start.item, start.replica, start.moved), ("anywhere", b, False))
        self.assertEqual(list(dispatch.order(2.0)), ["on-a"])

    def test_a_waiter_kept_to_replicas_this_line_has_none_of_never_starts(self) -> None:
        """A shared line's waiter named upstreams this gateway's line does not have (its
        config differs): it may take nothing here, not anything."""
        dispatch: Dispatch[str] = Dispatch(replicas(1, 1))
        nothing = dispatch.want(frozenset(), frozenset(), None)
        self.assertIsNone(dispatch.admit("x", NORMAL, nothing, 0.0))
        dispatch.join("x1", "x", NORMAL, 0.0, nothing, False)
        self.assertIsNone(dispatch.next(0.0))

    def test_a_session_goes_back_where_it_was_served(self) -> None:
        members = replicas(2, 2)
        dispatch: Dispatch[str] = Dispatch(members)
        want = dispatch.want(None, frozenset(), "s")
        first = dispatch.admit("a", NORMAL, want, 0.0)
        again = dispatch.admit("a", NORMAL, want, 0.0)
        assert first is not None and again is not None
        self.assertIs(first.replica, again.replica)

    def test_a_waiter_of_another_line_keeps_to_the_replicas_it_may_take_here(self) -> None:
        a, b, c = members = replicas(1, 1, 1)
        dispatch: Dispatch[str] = Dispatch([a, b])
        self.assertEqual(dispatch.want_here(None), (True, None))
        self.assertEqual(dispatch.want_here(Want(frozenset({b, c}))), (True, Want(frozenset({b}))))
        self.assertFalse(dispatch.want_here(Want(frozenset({c})))[0])
        self.assertEqual(len(members), 3)


@st.composite
def situations(draw: Any) -> tuple[list[Replica], list[tuple[str, int, int, int, bool]], float]:
    """Replicas (limits, held, some down), and waiters: client, class, among, avoid, retry."""
    members = replicas(*draw(st.lists(st.integers(1, 3), min_size=1, max_size=3)))
    for member in members:
        member.held = draw(st.integers(0, member.limit))
        if draw(st.booleans()) and draw(st.booleans()):
            member.circuit.state = DOWN
            member.circuit.retry_at = draw(st.sampled_from([None, 0.0, 10.0]))
    masks = st.integers(0, 2 ** len(members) - 1)
    waiters = draw(
        st.lists(
            st.tuples(st.sampled_from("abc"), st.integers(0, 2), masks, masks, st.booleans()),
            max_size=12,
        )
    )
    return members, waiters, draw(st.sampled_from([1.0, 5.0]))


class NextIsTheFirstInOrderThatMayStart(TestCase):
    @settings(max_examples=300)
    @given(situations(), st.data())
    def test_any_situation(
        self,
        situation: tuple[list[Replica], list[tuple[str, int, int, int, bool]], float],
        data: Any,
    ) -> None:
        """Whatever the replicas, the waiters' wants and the clients' max_in_flight (some of
        them at it already): the first in order whose client may take a slot starts, where
        it may, and the waiters of capped clients are last in the order."""
        members, waiters, now = situation
        caps = data.draw(st.dictionaries(st.sampled_from("abc"), st.integers(1, 2)))
        dispatch: Dispatch[int] = Dispatch(members, aging=2.0, caps=caps)
        for member in members:  # its held slots, each some client's
            held, member.held = member.held, 0
            for _ in range(held):
                dispatch.hold(member, data.draw(st.sampled_from("abc")))
        for n, (client, rank, among, avoid, retry) in enumerate(waiters):
            pick = lambda mask: frozenset(m for i, m in enumerate(members) if mask >> i & 1)  # noqa: E731
            want = dispatch.want(pick(among) or None, pick(avoid), None)
            dispatch.join(n, client, rank, n * 0.5, want, retry)
        clients = {n: w[0] for n, w in enumerate(waiters)}
        while True:
            order = list(dispatch.order(now))
            capped = [n for n in order if dispatch.capped(clients[n])]
            self.assertEqual(order[len(order) - len(capped) :], capped, "capped ones last")
            may = [
                n
                for n in order
                if not dispatch.capped(clients[n]) and dispatch.open_for(dispatch.want_of(n), now)
            ]
            start = dispatch.next(now)
            if not may:
                self.assertIsNone(start)
                break
            assert start is not None
            self.assertEqual(start.item, may[0])
            self.assertLessEqual(start.replica.held, start.replica.usable)
            client = clients[start.item]
            self.assertLessEqual(dispatch.in_flight[client], caps.get(client, len(waiters) + 9))
            self.assertNotIn(start.item, dispatch)
            self.assertEqual(len(dispatch), len(order) - 1)


class MaxInFlight(TestCase):
    """A client holding its `max_in_flight` slots of the line is passed over, in place."""

    def test_a_capped_client_waits_behind_others_and_starts_when_alone(self) -> None:
        (r,) = members = replicas(3)
        dispatch: Dispatch[str] = Dispatch(members, caps={"batch": 1})
        first = dispatch.admit("batch", NORMAL, None, 0.0)
        assert first is not None
        self.assertIsNone(dispatch.admit("batch", NORMAL, None, 0.0), "its second waits")
        dispatch.join("b2", "batch", NORMAL, 0.0, None, retry=False)
        dispatch.join("c1", "chat", NORMAL, 1.0, None, retry=False)
        self.assertEqual(list(dispatch.order(1.0)), ["c1", "b2"])
        self.assertFalse(dispatch.is_last("c1", 1.0), "the capped waiter is behind it")
        start = dispatch.next(1.0)
        assert start is not None
        self.assertEqual(start.item, "c1")
        self.assertIsNone(dispatch.next(1.0), "a slot is free, and only batch waits")
        self.assertEqual((r.held, dispatch.in_flight), (2, {"batch": 1, "chat": 1}))
        self.assertTrue(dispatch.unhold(r, "batch"), "its waiter may start now")
        start = dispatch.next(2.0)
        assert start is not None
        self.assertEqual((start.item, dispatch.in_flight["batch"]), ("b2", 1))

    def test_the_grant_that_caps_a_client_says_its_waiters_moved_back(self) -> None:
        dispatch: Dispatch[str] = Dispatch(replicas(1), caps={"a": 1})
        dispatch.join("a1", "a", NORMAL, 0.0, None, retry=False)
        dispatch.join("a2", "a", NORMAL, 0.0, None, retry=False)
        dispatch.join("b1", "b", NORMAL, 1.0, None, retry=False)
        start = dispatch.next(1.0)
        assert start is not None
        self.assertEqual((start.item, start.moved), ("a1", True))
        self.assertEqual(list(dispatch.order(1.0)), ["b1", "a2"])

    def test_a_reload_that_lowers_a_cap_revokes_nothing(self) -> None:
        (r,) = members = replicas(4)
        dispatch: Dispatch[str] = Dispatch(members, caps={"a": 3})
        for _ in range(3):
            self.assertIsNotNone(dispatch.admit("a", NORMAL, None, 0.0))
        dispatch.configure({"a": 1})
        self.assertTrue(dispatch.capped("a"))
        for _ in range(2):
            dispatch.unhold(r, "a")
        self.assertTrue(dispatch.capped("a"), "one held, one allowed")
        dispatch.unhold(r, "a")
        self.assertFalse(dispatch.capped("a"))
        self.assertEqual(dispatch.in_flight, {})
        dispatch.configure({})
        self.assertIsNotNone(dispatch.admit("a", NORMAL, None, 0.0))
