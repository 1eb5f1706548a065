"""A line shared by several gateways through Redis: the same line, the same surfaces.

`SharedSemaphore` is a `limiter.PositionedSemaphore` whose state (the fair `line.Line`, the
replicas' held slots and health, the sessions) is a copy: it changes only by replaying the
events that the Lua scripts (`scripts`) append to one Redis stream, in the stream's order and
at the time Redis stamped on each, so every gateway's copy is the same line. A waiter of
another gateway is a `Remote` in the copy: it counts in every position, it is never told one.

What stays local: the Deferreds of this gateway's waiters, their position reports (the
limiter's coalescing, unchanged), timers. What goes through Redis: every change. A request
joins with one script call (`join`: a free slot at once if nobody waits); a free slot is then
claimed (`grant`) for the waiter that this gateway's copy puts first, by every gateway that
sees it free: Redis takes the first claim and refuses the rest, so the cap holds whoever
claims, and a waiter whose gateway is slow or dead is still served in its turn. A slot given
back (`release`), a waiter that gives up (`leave`), a replica's verdict or probe (`note`) are
events like the others.

While Redis cannot be reached (`lost`) nothing can be granted without risking the cap: this
gateway's waiters get 529 with retry-after, new requests too, and requests holding a slot run
to their end; their releases are sent when Redis is back. Then `rebuild` makes the copy anew
from a snapshot; a running slot Redis no longer knows (it lost its data) is counted again.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IDelayedCall
from twisted.logger import Logger
from twisted.python.failure import Failure

from homelab_gateway.core.line import Grant, Line
from homelab_gateway.core.replicas import UP, choose
from homelab_gateway.line.cluster import Cluster
from homelab_gateway.line.limiter import (
    ANONYMOUS,
    NORMAL,
    PositionedSemaphore,
    PositionListener,
    Replica,
    Slot,
    Unavailable,
    _Want,
)

log = Logger()
CLAIM_RETRY = 0.2
"""After a refused claim (another gateway's claim won, or this copy was a step behind), look
again this much later at the latest: the event that explains the refusal usually comes first."""


def _ignore(failure: Failure) -> None:
    """A script call whose failure changes nothing here: a lost link is seen by the reader,
    and the line is rebuilt from Redis when it is back."""


class Remote:
    """A waiter of another gateway, in this gateway's copy of the line."""

    __slots__ = ("id",)

    def __init__(self, id: str) -> None:
        self.id = id

    def __repr__(self) -> str:
        return f"Remote({self.id!r})"


class SharedClock:
    """The reactor's clock, set to Redis's: events are stamped by Redis, and the line compares
    those stamps with `seconds()` (ageing, hold times, estimates)."""

    def __init__(self, reactor: Any) -> None:
        self.reactor = reactor
        self.offset = 0.0

    def seconds(self) -> float:
        return self.reactor.seconds() + self.offset

    def callLater(self, delay: float, f: Any, *args: Any, **kwargs: Any) -> IDelayedCall:
        return self.reactor.callLater(delay, f, *args, **kwargs)

    def getDelayedCalls(self) -> Any:
        return self.reactor.getDelayedCalls()


@dataclass(slots=True)
class _Request:
    """What this gateway knows of one of its waiters, from its `acquire_in_line`."""

    client: str
    rank: int
    want: _Want | None
    first: bool
    listener: PositionListener | None

    def info(self) -> bytes:
        want = self.want
        fields: dict[str, Any] = {"c": self.client, "k": self.rank}
        if want is not None:
            if want.among is not None:
                fields["a"] = sorted(m.name for m in want.among)
            if want.avoid:
                fields["v"] = sorted(m.name for m in want.avoid)
            if want.session is not None:
                fields["s"] = want.session
        if self.first:
            fields["f"] = 1
        return orjson.dumps(fields)


def _preferences(ranked: list[Replica]) -> bytes:
    """The replicas a script may take a slot on, in order, as it reads them: [name, slots, ...]."""
    return orjson.dumps([x for m in ranked for x in (m.name, m.limit)])


class SharedSemaphore(PositionedSemaphore):
    """The slots of `members` and their line, shared with every gateway of `cluster`."""

    def __init__(
        self, tokens: Sequence[Replica], reactor: Any, *, cluster: Cluster, **settings: Any
    ) -> None:
        super().__init__(tokens, SharedClock(reactor), **settings)
        self.reactor = reactor
        self.cluster = cluster
        self.member_names = sorted(m.name for m in self.members)
        self.key = "+".join(self.member_names)  # the same on every gateway, whatever the order
        self._local: dict[str, Deferred[Slot]] = {}  # this gateway's waiters, until granted
        self._requests: dict[str, _Request] = {}
        self._cancelled: set[str] = set()  # this gateway's, given up: their leave is on its way
        self._items: dict[str, Any] = {}  # every waiter in the copy, by id
        self._ids: dict[Any, str] = {}  # and back (this gateway's from their acquire on)
        self._slots: dict[str, Slot] = {}  # every slot taken, by id
        self._mine: dict[str, Slot] = {}  # those this gateway's requests hold
        self._claiming: set[str] = set()
        self._look_again: IDelayedCall | None = None
        self._replaying = False
        self.since = 0  # the number of the last event its copy was rebuilt with
        cluster.add(self)

    def _ours(self, w: str) -> bool:
        return w.startswith(self.cluster.instance + "/")

    def _member(self, name: str) -> Replica | None:
        return next((m for m in self.members if m.name == name), None)

    # -- this gateway's requests ---------------------------------------------------------------

    def acquire_in_line(
        self,
        on_position: PositionListener | None = None,
        *,
        client: str = ANONYMOUS,
        rank: int = NORMAL,
        among: frozenset[Replica] | None = None,
        avoid: frozenset[Replica] = frozenset(),
        session: str | None = None,
        first: bool = False,
    ) -> Deferred[Slot]:
        """As `PositionedSemaphore.acquire_in_line`; the slot or the place comes back from
        Redis. Raises Unavailable while Redis cannot be reached."""
        if not self.cluster.live:
            if not self.cluster.config.fallback_share:
                raise Unavailable(f"the shared line is unreachable: {self.cluster.last_error}")
            return super().acquire_in_line(
                on_position,
                client=client,
                rank=rank,
                among=among,
                avoid=avoid,
                session=session,
                first=first,
            )
        if not first:
            self._check_room(client)
        want = self._want(among, avoid, session)
        return self._ask(_Request(client, rank, want, first, on_position))

    def _ask(
        self,
        request: _Request,
        arrived: float | None = None,
        d: Deferred[Slot] | None = None,
    ) -> Deferred[Slot]:
        """Join the shared line with `request` (under a new id); `arrived` and `d` for a
        waiter a reload moves here from another line, with its place in time."""
        if d is None:
            d = Deferred(canceller=self._cancelAcquire)
            if request.listener is not None:
                d.addBoth(self._leave_line, d)
        want = request.want
        ranked = self._ranked(
            self._open_for(want, self.clock.seconds()), want.session if want else None
        )
        # Every argument is made before anything is kept for the waiter: a failure here
        # leaves nothing behind.
        w = self.cluster.new_id()
        args = (w, request.info(), "" if arrived is None else repr(arrived), _preferences(ranked))
        self._local[w] = d
        self._ids[d] = w
        self._requests[w] = request
        self.cluster.line_call(self, "join", *args).addErrback(self._not_asked, w)
        return d

    def _not_asked(self, failure: Failure, w: str) -> None:
        """The join's reply never came: Redis may have run it (its event may even be replayed
        already) or not. The waiter leaves either way, as one that gives up does, and hears
        why."""
        d = self._local.get(w)
        self._give_up(w)
        if d is not None and not d.called:
            reason = failure.getErrorMessage()
            d.errback(Unavailable(f"the shared line is unreachable: {reason}"))

    def _ranked(self, candidates: list[Replica], session: str | None) -> list[Replica]:
        """`candidates` best first: the one `replicas.choose` takes, then the most free."""
        if not candidates:
            return []
        best = choose(candidates, self.sessions.get(session), self._turn)
        self._turn += 1
        return [best, *sorted((m for m in candidates if m is not best), key=lambda m: -m.free)]

    def _cancelAcquire(self, d: Deferred[Slot]) -> None:  # type: ignore[override]
        moved = self._moved.get(d)
        if moved is not None:
            moved._cancelAcquire(d)
            return
        if d in self.line and not self.cluster.live:  # waiting in the fallback share
            super()._cancelAcquire(d)
            return
        w = self._ids.get(d)
        if w is None:
            return
        self._give_up(w)

    def _give_up(self, w: str) -> None:
        """This gateway's waiter `w` leaves; the copy drops it when the leave comes back (a
        slot granted meanwhile is given back at once)."""
        d = self._local.pop(w, None)
        self._cancelled.add(w)
        self._requests.pop(w, None)
        if d is not None and self._items.get(w) is not d:
            self._ids.pop(d, None)
        self.cluster.line_call(self, "leave", w).addCallbacks(self._left, _ignore, (w,))

    def _left(self, result: object, w: str) -> None:
        """Redis never had `w` (its join did not run): no leave event will forget it."""
        if result == "unknown":
            self._cancelled.discard(w)

    def _released(self, slot: Slot) -> None:
        self._mine.pop(slot.id, None)
        args = (slot.replica.name, "1" if slot.trial and not slot.judged else "")
        if not self.cluster.live:  # the copy is this gateway's own until Redis is back
            self.cluster.unsent[(self.key, slot.id)] = args
            self._slots.pop(slot.id, None)
            super()._released(slot)
            return
        if slot.on_release is not None:
            slot.on_release(self.clock.seconds() - slot.granted_at)

        def unsent(failure: Failure) -> None:
            self.cluster.unsent[(self.key, slot.id)] = args

        self.cluster.line_call(self, "release", slot.id, *args).addErrback(unsent)

    def _judged(self, slot: Slot, failure: str | None) -> None:
        circuit = slot.replica.circuit
        if failure is None and circuit.state == UP and not circuit.failures:
            return  # nothing for anyone to change
        if not self.cluster.live:
            super()._judged(slot, failure)
            return
        event: dict[str, Any] = {"op": "verdict", "r": slot.replica.name}
        if failure is not None:
            event["why"] = failure
        self.cluster.line_call(self, "note", orjson.dumps(event)).addErrback(_ignore)

    def recovered(self, replica: Replica) -> None:
        if replica.circuit.state == UP:
            return
        if not self.cluster.live:
            super().recovered(replica)
            return
        event = orjson.dumps({"op": "probed", "r": replica.name})
        self.cluster.line_call(self, "note", event).addErrback(_ignore)

    def fail_waiting(self, reason: Exception) -> None:
        """This gateway's waiters fail with `reason` (shutdown) and leave the shared line."""
        if not self.cluster.live:  # those waiting for the fallback share wait here alone
            super().fail_waiting(reason)
        for w, d in list(self._local.items()):
            self._give_up(w)
            if not d.called:
                d.errback(reason)

    # -- claims --------------------------------------------------------------------------------

    def _hand_over(self) -> bool:
        """Slots are granted by Redis: claim what this copy shows free (after a batch of
        events, not in its middle). Never moves anyone itself. Cut off from Redis, the
        fallback share is granted here, as in process."""
        if not self.cluster.live:
            return super()._hand_over()
        if not self._replaying:
            self._claim()
        return False

    def _grant(
        self, candidates: list[Replica], want: _Want | None, grant: Grant, now: float
    ) -> Slot:
        """A slot of the fallback share: it gets an id, to be counted in Redis when it is
        back (`rebuild`)."""
        slot = super()._grant(candidates, want, grant, now)
        slot.id = self.cluster.new_id()
        self._mine[slot.id] = slot
        self._slots[slot.id] = slot
        return slot

    def _claim(self) -> None:
        if not self.cluster.live or not self.waiting:
            return
        now = self.clock.seconds()
        budget = {m: m.free for m in self.members if m.open_at(now)}
        spare = sum(budget.values()) - len(self._claiming)
        if spare <= 0:
            return
        # A claim is for the first waiters not yet claimed for: the walk stops after a few.
        for item in self._order(now):
            w = self._ids[item]
            if w in self._claiming:
                continue
            want = self._wants.get(item)
            candidates = [m for m in self._open_for(want, now) if budget[m] > 0]
            if not candidates:
                continue
            ranked = self._ranked(candidates, want.session if want else None)
            budget[ranked[0]] -= 1
            spare -= 1
            self._claiming.add(w)
            self.cluster.line_call(self, "grant", w, _preferences(ranked)).addBoth(self._claimed, w)
            if spare <= 0:
                return

    def _claimed(self, result: object, w: str) -> None:
        self._claiming.discard(w)
        if (result is None or isinstance(result, Failure)) and self._look_again is None:
            self._look_again = self.reactor.callLater(CLAIM_RETRY, self._again)

    def _again(self) -> None:
        self._look_again = None
        self._claim()

    # -- replaying the stream ------------------------------------------------------------------

    def apply(self, event: Mapping[str, Any]) -> None:
        """One event of the stream, in its order."""
        self._replaying = True
        handler = getattr(self, "_on_" + event["op"], None)
        if handler is not None:
            handler(event, float(event["t"]))

    def applied(self) -> None:
        """The end of a batch of events: claim what is free now."""
        self._replaying = False
        self._count()
        self._claim()

    def _want_of(self, info: Mapping[str, Any]) -> _Want | None:
        names = info.get("a")
        among = None if names is None else frozenset(m for m in self.members if m.name in names)
        if among is not None and len(among) == len(self.members):
            among = None
        avoid = frozenset(m for m in self.members if m.name in info.get("v", ()))
        session = info.get("s")
        if among is None and not avoid and session is None:
            return None
        return _Want(among, avoid, session)

    def _on_join(self, event: Mapping[str, Any], t: float) -> None:
        w = event["w"]
        info = orjson.loads(event["i"])
        item: Any = self._local.get(w) or Remote(w)
        self._items[w] = item
        self._ids[item] = w
        first = bool(info.get("f"))
        self._enqueue(item, info["c"], info["k"], float(event["a"]), self._want_of(info), first)
        request = self._requests.get(w)
        if request is not None and request.listener is not None:
            self._listeners[item] = request.listener
            self._reported[item] = 0
        if item in self._listeners and self.line.queues == 1 and not self._first:
            self._tell(item, len(self.line))  # a plain FIFO: the newcomer is its tail
        elif item in self._listeners or (self._listeners and (self._first or self.line.queues > 1)):
            self._place(item, t)
        self._watch_aging(t)

    def _on_admit(self, event: Mapping[str, Any], t: float) -> None:
        info = orjson.loads(event["i"])
        grant, moved = self.line.admit(info["c"], info["k"], t)
        self._hold(event["w"], event["r"], grant, t, info)
        if moved:
            self._tell_rises(t)
            self._changed()

    def _on_grant(self, event: Mapping[str, Any], t: float) -> None:
        w = event["w"]
        info = orjson.loads(event["i"])
        item = self._items.pop(w, None)
        if item is None:  # not in this copy (it cannot be, but the slot must count)
            grant, _ = self.line.admit(info["c"], info["k"], t)
            moved = False
        else:
            self._ids.pop(item, None)
            grant, moved = self._take_out(item, t)
        self._hold(w, event["r"], grant, t, info)
        if moved:
            self._tell_rises(t)
        self._changed()

    def _hold(
        self, w: str, replica_name: str, grant: Grant, t: float, info: Mapping[str, Any]
    ) -> None:
        replica = self._member(replica_name)
        if replica is None:  # an upstream this gateway does not have in this line
            if self._ours(w):  # another gateway's config gave it one: it cannot be used here
                self.cluster.line_call(self, "release", w, replica_name, "").addErrback(_ignore)
                d = self._local.pop(w, None)
                if d is not None and not d.called:
                    log.warn(
                        "granted a slot of {upstream}, which this gateway's line {line} does not "
                        "have: the gateways' configs differ",
                        upstream=replica_name,
                        line=self.key,
                    )
                    d.errback(Unavailable(f"the shared line {self.key} is configured differently"))
            return
        slot = Slot(self, grant, t, replica, id=w)
        slot.trial = replica.circuit.begin()
        self.sessions.served(info.get("s"), replica.name)
        self._add_slot(slot)
        self._count()
        if not self._ours(w):
            return
        self._mine[w] = slot
        self._requests.pop(w, None)
        d = self._local.pop(w, None)
        if d is None or d.called:  # it gave up meanwhile: the slot goes straight back
            self._cancelled.discard(w)
            slot.release()
            return
        d.callback(slot)

    def _on_release(self, event: Mapping[str, Any], t: float) -> None:
        w = event["w"]
        slot = self._slots.get(w)
        if slot is None:
            return
        if w in self._mine:  # swept while this gateway's request runs: count it again
            self._restore(slot)
            return
        reordered = self.line.settle(slot.grant, t - slot.granted_at)
        self.holds.add(t - slot.granted_at)
        if event.get("x"):
            slot.replica.circuit.abandoned()
        self._drop_slot(w)
        if reordered:
            self._tell_rises(t)
        self._changed()
        group = slot.replica.group
        if group is not self and group is not None:  # a reload moved the upstream since
            group.refresh()

    def _add_slot(self, slot: Slot) -> None:
        """Count `slot` as taken in this copy (`_drop_slot` is its inverse)."""
        self._slots[slot.id] = slot
        self._holding[slot] = None
        slot.replica.held += 1

    def _slot_from(self, w: str, request: str, granted_at: float, replica: Replica) -> Slot:
        """A slot this copy learns from Redis whole (a snapshot, a restore): its request's
        client and class, and no charge to settle."""
        info = orjson.loads(request)
        return Slot(self, Grant(info["c"], info["k"], 0.0), granted_at, replica, id=w)

    def _drop_slot(self, w: str) -> None:
        slot = self._slots.pop(w, None)
        if slot is not None:
            self._holding.pop(slot, None)
            slot.replica.held -= 1

    def _restore(self, slot: Slot) -> None:
        info = orjson.dumps({"c": slot.grant.client, "k": slot.grant.rank})
        self.cluster.line_call(
            self, "restore", slot.id, slot.replica.name, repr(slot.granted_at), info
        ).addErrback(_ignore)

    def _on_restore(self, event: Mapping[str, Any], t: float) -> None:
        w = event["w"]
        if w in self._slots:
            return
        replica = self._member(event["r"])
        if replica is not None:
            self._add_slot(self._slot_from(w, event["i"], float(event["g"]), replica))

    def _on_leave(self, event: Mapping[str, Any], t: float) -> None:
        w = event["w"]
        item = self._items.pop(w, None)
        if item is None:
            return
        self._ids.pop(item, None)
        self._cancelled.discard(w)
        reordered = self._dequeue(item)
        d = self._local.pop(w, None)
        if d is not None and not d.called:  # swept: Redis took this gateway for dead
            self._requests.pop(w, None)
            d.errback(Unavailable("this gateway's lease on the shared line expired"))
        if reordered:
            self._tell_rises(t)
        self._changed()

    def _on_verdict(self, event: Mapping[str, Any], t: float) -> None:
        replica = self._member(event["r"])
        if replica is None:
            return
        reason = event.get("why")
        if reason is None:
            change = replica.circuit.succeeded()
        else:
            change = replica.circuit.failed(t, reason)
        if change is not None:
            self._health_changed(replica, change, reason)

    def _on_probed(self, event: Mapping[str, Any], t: float) -> None:
        replica = self._member(event["r"])
        if replica is not None:
            change = replica.circuit.probed()
            if change is not None:
                self._health_changed(replica, change, None)

    def _on_idle(self, event: Mapping[str, Any], t: float) -> None:
        """Nobody waits and no slot is held: every gateway starts the fair share afresh here,
        so one that joined later (with no history) has the same line from now on."""
        if not self.waiting and not self._slots:
            self.line = Line(aging=self.line.aging, weights=self.line.weights)

    # -- losing Redis and coming back ----------------------------------------------------------

    def _forget_copy(self) -> None:
        self._replaying = False
        self.line = Line(aging=self.line.aging, weights=self.line.weights)
        self.waiting = []
        self._first.clear()
        self._retrying.clear()
        self._wants.clear()
        self._choosy = 0
        self._items.clear()
        self._ids = {d: w for w, d in self._local.items()}
        self._claiming.clear()
        self._slots, self._holding = {}, {}
        for member in self.members:
            member.held = 0

    def lost(self) -> None:
        """Redis is out of reach: the copy keeps only this gateway's running requests, which
        run on. Its waiters get 529, or, with a `fallback_share`, wait on in their order for
        that share of each upstream's slots, granted here."""
        now = self.clock.seconds()
        share = self.cluster.config.fallback_share
        staying = [self._waiting_entry(d, now) for d in self._order(now) if self._waits_here(d)]
        local, self._local = self._local, {}
        self._requests.clear()
        self._cancelled.clear()
        self._forget_copy()
        for slot in self._mine.values():
            self._add_slot(slot)
        for member in self.members:
            member.share = share
        for d, request, arrived in staying if share else ():
            self._enqueue(d, request.client, request.rank, arrived, request.want, request.first)
        self._count()
        for d in local.values():
            if not d.called and d not in self.line:
                d.errback(Unavailable("lost the shared line"))
        super()._hand_over()
        self._tell_all(now)

    def _waits_here(self, item: Any) -> bool:
        w = self._ids.get(item)
        return w is not None and self._local.get(w) is item and w not in self._cancelled

    def _waiting_entry(self, d: Any, now: float) -> tuple[Any, _Request, float]:
        """One of this gateway's waiters, to move between the shared line and the fallback
        share in its place: what it asked for and when it arrived."""
        if d in self._retrying:
            client, rank = self._retrying[d]
            return d, _Request(client, rank, self._wants.get(d), True, None), now
        client, rank, arrived = self.line.arrived(d)
        return d, _Request(client, rank, self._wants.get(d), False, None), arrived

    def rebuild(
        self, now: float, waiting: Mapping[str, str], slots: Mapping[str, Mapping[str, str]]
    ) -> None:
        """Make the copy anew from a snapshot taken at Redis time `now`. Fair-share history
        starts afresh (until the line is next idle, this copy may order clients differently
        from the others': claims stay safe, Redis takes one per slot)."""
        self.clock.offset = now - self.reactor.seconds()
        waited = (
            [] if self.cluster.live else [self._waiting_entry(d, now) for d in self._order(now)]
        )
        for member in self.members:
            member.share = None
        self._forget_copy()
        for name, entries in slots.items():
            replica = self._member(name)
            if replica is None:
                continue
            for w, raw in entries.items():
                slot = self._mine.get(w)
                if slot is None:
                    entry = orjson.loads(raw)
                    slot = self._slot_from(w, entry["i"], float(entry["t"]), replica)
                self._add_slot(slot)
                if self._ours(w) and w not in self._mine:
                    d = self._local.pop(w, None)
                    if d is not None and not d.called:  # admitted just before the snapshot
                        self._mine[w] = slot
                        self._requests.pop(w, None)
                        d.callback(slot)
                    else:
                        self._mine[w] = slot
                        slot.release()
        for w, slot in self._mine.items():
            if w not in self._slots:  # Redis lost it while its request runs
                self._add_slot(slot)
                self._restore(slot)
        arrivals = sorted(waiting.items(), key=lambda kv: float(orjson.loads(kv[1])["a"]))
        for w, raw in arrivals:
            entry = orjson.loads(raw)
            if self._ours(w) and w not in self._local:
                self.cluster.line_call(self, "leave", w).addErrback(_ignore)
            self._on_join({"w": w, "i": entry["i"], "a": entry["a"]}, now)
        for d, request, arrived in waited:  # waited in the fallback share: back in line
            request.listener = self._listeners.get(d)
            self._ask(request, arrived, d)
        self._count()
        self._tell_all(now)

    def adopt(self, old: PositionedSemaphore) -> None:
        """A reload gave a model more replicas: this gateway's waiters of `old` whose replicas
        are now this line's leave `old` and join this one, keeping their arrival time."""
        assert isinstance(old, SharedSemaphore)
        for w, d in list(old._local.items()):
            request = old._requests.get(w)
            if request is None or d.called:
                continue
            adoptable, want = self._want_here(request.want)
            if not adoptable:
                continue
            request.want = want
            item = old._items.get(w)
            arrived = old.line.arrived(item)[2] if item in old.line else None
            old._give_up(w)
            old._listeners.pop(d, None)
            old._reported.pop(d, None)
            self._moved_from(old, d)
            self._ask(request, arrived, d)
        old.members = [m for m in old.members if m.group is old]
        old._count()
        self.refresh()

    def close(self) -> None:
        super().close()
        if self._look_again is not None and self._look_again.active():
            self._look_again.cancel()
        self._look_again = None
