"""Whom a gateway's copy of the shared line claims a free slot for: the same waiters, in the same
order, with the same preferred upstreams, as a walk of its whole order (`Dispatch.order`),
which `_claim` stops after a few. No Redis: the copy is driven by the events
Redis would append, and its claims are answered by hand."""

from __future__ import annotations

import itertools
from typing import Any

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.task import Clock
from twisted.trial.unittest import TestCase

from homelab_gateway.line.limiter import PositionedSemaphore, Replica
from homelab_gateway.line.refusals import Unavailable
from homelab_gateway.line.shared import RedisSource, shared_line
from homelab_gateway.line.wire import preferences
from testsupport.helpers import FakeCluster


def walked_claims(line: PositionedSemaphore, now: float) -> list[tuple[str, bytes]]:
    """The claims `_claim` makes by walking the whole order (`Dispatch.order`: retries, then
    `Line.order`), each with its preferences, leaving the copy as it was."""
    source, dispatch = source_of(line), line.dispatch
    turn = dispatch._turn
    budget = {m: m.free for m in line.members if m.open_at(now)}
    spare = sum(budget.values()) - len(source._claiming)
    claims: list[tuple[str, bytes]] = []
    if spare <= 0 or not line.waiting:
        return claims
    for item in list(dispatch.order(now)):
        w = source._ids[item]
        if w in source._claiming:
            continue
        want = dispatch.want_of(item)
        candidates = [m for m in dispatch.open_for(want, now) if budget[m] > 0]
        if not candidates:
            continue
        ranked = dispatch.ranked(candidates, want.session if want else None)
        budget[ranked[0]] -= 1
        spare -= 1
        claims.append((w, preferences(ranked)))
        if spare <= 0:
            break
    dispatch._turn = turn
    return claims


def source_of(line: PositionedSemaphore) -> RedisSource:
    assert isinstance(line.source, RedisSource)
    return line.source


NAMES = ("r0", "r1", "r2")


class Copy:
    """One gateway's copy of a line of three upstreams, driven by events as Redis appends
    them; every claim checked against the walk."""

    def __init__(self, test: TestCase, limits: tuple[int, int, int], aging: float | None) -> None:
        self.test = test
        self.clock = Clock()
        self.clock.advance(100.0)
        self.cluster = FakeCluster()
        replicas = [Replica(name, limit) for name, limit in zip(NAMES, limits, strict=True)]
        self.line = shared_line(
            replicas,
            self.clock,
            cluster=self.cluster,  # type: ignore[arg-type]
            aging=aging,
        )
        test.addCleanup(self.line.close)
        self.source = source_of(self.line)
        self.n = 0
        self.held: list[str] = []

    def event(self, op: str, **fields: Any) -> None:
        """One event, then the end of its batch without the claim that `applied` makes: the
        test makes it (`claim`)."""
        self.source.apply({"op": op, "t": repr(self.clock.seconds()), **fields})
        self.source._replaying = False
        self.line.count()

    def join(
        self, client: str, rank: int, among: int, avoid: int, first: bool, session: bool
    ) -> None:
        self.n += 1
        info: dict[str, Any] = {"c": client, "k": rank}
        if among:
            info["a"] = [name for bit, name in enumerate(NAMES) if among >> bit & 1]
        if avoid:
            info["v"] = [name for bit, name in enumerate(NAMES) if avoid >> bit & 1]
        if first:
            info["f"] = 1
        if session:
            info["s"] = client
        w = f"there/1/{self.n}"
        self.event("join", w=w, i=orjson.dumps(info), a=repr(self.clock.seconds()))

    def admit(self, replica: int) -> None:
        member = self.line.members[replica]
        if member.free:
            self.n += 1
            w = f"there/1/{self.n}"
            self.event("admit", w=w, r=member.name, i=orjson.dumps({"c": "z", "k": 1}))
            self.held.append(w)

    def release(self, index: int) -> None:
        if self.held:
            self.event("release", w=self.held.pop(index % len(self.held)))

    def leave(self, index: int) -> None:
        waiting = list(self.source._items)
        if waiting:
            self.event("leave", w=waiting[index % len(waiting)])

    def claim(self, claiming: list[int], answers: list[bool]) -> list[str]:
        """Some waiters already being claimed for, then a claim checked against the walk;
        the claims are then granted or refused (another gateway's claim won) as `answers` say.
        Returns the waiters claimed for."""
        line, source = self.line, self.source
        waiting = list(source._items)
        pretend = {waiting[i % len(waiting)] for i in claiming} if waiting else set()
        pretend -= source._claiming
        source._claiming |= pretend
        now = self.clock.seconds()
        expected = walked_claims(line, now)
        source._claim()
        made = [(w, prefs) for w, prefs, _ in self.cluster.claims]
        self.test.assertEqual(made, expected)
        source._claiming -= pretend
        claims, self.cluster.claims = self.cluster.claims, []
        for (w, prefs, d), granted in zip(claims, itertools.cycle(answers or [True]), strict=False):
            if granted and w in source._items:
                replica = orjson.loads(prefs)[0]
                self.event("grant", w=w, r=replica, i=orjson.dumps({"c": "x", "k": 1}))
                self.held.append(w)
            d.callback(1 if granted else None)
        return [w for w, _ in made]

    def do(self, step: tuple[Any, ...]) -> None:
        kind, *args = step
        if kind == "wait":
            self.clock.advance(args[0])  # a refused claim looks again: not checked, answered
            for _, _, d in self.cluster.claims:
                if not d.called:
                    d.callback(None)
            self.cluster.claims.clear()
        else:
            getattr(self, kind)(*args)


clients = st.sampled_from(["a", "b", "c", "d"])
join = st.tuples(
    st.just("join"),
    clients,
    st.integers(0, 2),
    st.sampled_from([0, 0, 0, 1, 2, 3, 4, 6]),  # among: mostly any upstream
    st.sampled_from([0, 0, 0, 1, 2]),  # avoid
    st.sampled_from([False, False, False, True]),  # a retry, ahead of the line
    st.booleans(),  # a session
)
step = st.one_of(
    join,
    join,
    join,
    st.tuples(st.just("admit"), st.integers(0, 2)),
    st.tuples(st.just("release"), st.integers(0, 50)),
    st.tuples(st.just("release"), st.integers(0, 50)),
    st.tuples(st.just("leave"), st.integers(0, 50)),
    st.tuples(
        st.just("claim"),
        st.lists(st.integers(0, 50), max_size=3),
        st.lists(st.booleans(), max_size=3),
    ),
    st.tuples(st.just("wait"), st.sampled_from([0.0, 0.3, 1.0, 2.5])),
)


class ClaimsAreTheWalks(TestCase):
    @settings(max_examples=300)
    @given(
        st.lists(step, max_size=80),
        st.sampled_from([(1, 1, 1), (2, 1, 0), (3, 2, 1), (4, 3, 0), (1, 0, 0)]),
        st.sampled_from([None, 1.0]),
    )
    def test_any_sequence(
        self, steps: list[Any], limits: tuple[int, int, int], aging: float | None
    ) -> None:
        copy = Copy(self, limits, aging)
        for one in steps:
            copy.do(one)

    def test_the_retry_first_then_the_line_past_a_head_kept_to_a_busy_upstream(self) -> None:
        """Two slots free on r0, r1 busy: the retry is claimed for first, the head of the line
        (kept to r1) is skipped, the next in the line's order gets the other slot."""
        copy = Copy(self, (2, 1, 0), None)
        for replica in (0, 0, 1):  # there/1/1..3 hold every slot
            copy.admit(replica)
        copy.join("a", 1, 0b010, 0, False, False)  # there/1/4: the head, kept to r1
        for client in "bcdb":  # there/1/5..8: many clients, the order is a merge of FIFOs
            copy.join(client, 1, 0, 0, False, False)
        copy.join("e", 1, 0, 0, True, False)  # there/1/9: a retry
        copy.release(0)
        copy.release(0)
        self.assertEqual(copy.claim([], []), ["there/1/9", "there/1/5"])

    def test_the_heads_claim_out_and_several_spare_slots(self) -> None:
        """Four slots free and the head's claim still out: the next three of the order, which
        aging and classes made other than the arrival order."""
        copy = Copy(self, (2, 1, 1), 1.0)
        for client, rank in [("a", 2), ("b", 1), ("a", 1), ("c", 1), ("b", 0), ("d", 1)]:
            copy.join(client, rank, 0, 0, False, False)
            copy.clock.advance(0.4)
        order = [copy.source._ids[d] for d in copy.line.line.order(copy.clock.seconds())]
        self.assertNotEqual(order, sorted(order, key=lambda w: int(w.rsplit("/", 1)[1])))
        copy.source._claiming.add(order[0])
        self.assertEqual(copy.claim([], [True]), order[1:4])


class AJoinThatFails(TestCase):
    """This gateway keeps a waiter of the shared line only once its join is on its way to
    Redis, and forgets it if the join fails: a request that cannot join leaves nothing."""

    def setUp(self) -> None:
        self.cluster = FakeCluster()
        self.line = shared_line([Replica("r0", 1)], Clock(), cluster=self.cluster)  # type: ignore[arg-type]
        self.source = source_of(self.line)

    def kept(self) -> list[Any]:
        return [self.source._local, self.source._ids, self.source._requests]

    def test_one_whose_join_cannot_be_written(self) -> None:
        with self.assertRaises(TypeError):  # a session that is no text (a header's bytes)
            self.line.acquire_in_line(session=b"s-1")  # type: ignore[arg-type]
        self.assertEqual(self.kept(), [{}, {}, {}])

    def test_one_whose_join_fails_waits_on_while_the_link_is_made_anew(self) -> None:
        """Redis may have run the join or not: the link is dropped, to rebuild the copy from
        Redis, and the waiter waits on in it meanwhile (`rebuild` finds it there or joins it
        again with its arrival)."""
        self.cluster.line_call = lambda *args: fail(ConnectionError("gone"))  # type: ignore[method-assign]
        d = self.line.acquire_in_line(session="0" * 32)
        self.assertNoResult(d)
        self.assertEqual(self.cluster.dropped, ["gone"])
        self.assertEqual(self.line.waiting, [d])
        (w,) = self.source._local
        self.assertEqual((self.source._local[w], self.source._ids[d]), (d, w))

    def test_one_whose_join_ran_but_whose_reply_was_lost_is_in_the_copy_once(self) -> None:
        joins: list[tuple[tuple[Any, ...], Deferred[Any]]] = []

        def line_call(line: Any, script: str, *args: Any) -> Deferred[Any]:
            if script == "join":
                joins.append((args, Deferred()))
                return joins[-1][1]
            return succeed("left")

        self.cluster.line_call = line_call  # type: ignore[method-assign]
        waiter = self.line.acquire_in_line(session="0" * 32)
        (w, info, *_), reply = joins[0]
        self.source.apply({"op": "join", "t": "1.0", "w": w, "i": info, "a": "1.0"})
        self.source.applied()
        reply.errback(ConnectionError("the reply timed out"))
        self.assertNoResult(waiter)
        self.assertEqual(self.cluster.dropped, ["the reply timed out"])
        self.assertEqual(self.line.waiting, [waiter])

    def test_one_whose_join_met_a_bug_leaves_and_hears_why(self) -> None:
        self.cluster.line_call = lambda line, script, *args: (  # type: ignore[method-assign]
            fail(KeyError("a bug")) if script == "join" else succeed("unknown")
        )
        self.failureResultOf(self.line.acquire_in_line(), Unavailable)
        self.assertEqual(self.kept(), [{}, {}, {}])
        self.assertEqual((self.source._cancelled, self.cluster.dropped), (set(), []))


class ALinkThatGoesDownMidBatch(TestCase):
    """The reader replays the batch it has read even once the link is marked down (a clean
    stop): what it replays grants nothing here, where the copy holds other gateways' waiters."""

    def test_a_replayed_release_grants_no_other_gateways_waiter(self) -> None:
        cluster = FakeCluster()
        line = shared_line([Replica("r0", 1)], Clock(), cluster=cluster)  # type: ignore[arg-type]
        source = source_of(line)
        info = orjson.dumps({"c": "a", "k": 1})
        source.apply({"op": "admit", "w": "there/1/1", "r": "r0", "i": info, "t": "1.0"})
        source.apply({"op": "join", "w": "there/1/2", "i": info, "a": "1.0", "t": "1.0"})
        source.applied()
        cluster.live = False
        source.apply({"op": "release", "w": "there/1/1", "t": "2.0"})
        source.applied()
        self.assertEqual((len(line.waiting), line.in_use), (1, 0))
