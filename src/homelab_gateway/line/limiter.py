"""Slots and their line: a DeferredSemaphore whose waiters learn their place in line.

One line serves the slots of one or more upstreams (`Replica`): a model with several replicas
waits in one line and takes the first slot that frees on any of its replicas in rotation, and
an upstream that serves several models shares its slots among them through that same line (the
service puts upstreams that share a model in one line). Who gets a freed slot is `line.Line`'s
decision (classes, aging, fair share, FIFO within a client), except that a waiter only takes a
slot of its own replicas; which replica, and whether a replica is in rotation, is
`replicas`'. This module is the Twisted layer around them: Deferreds, the clock, position
reports, cool-down timers.

A request retried after a failed attempt (`first=True`) waits ahead of the whole line: it had
already reached the head once.

The guarantee: a reported position is never lower than the truth, at any moment, and a fall is
told within `report_interval` (`REPORT_INTERVAL`, 1 s).

Falls are the common case (a slot frees, a waiter ahead gives up) and are coalesced:
renumbering every waiter on every change costs a frame per waiter per change, quadratic in the
queue length, so a change only schedules one renumbering pass `report_interval` later, which
tells each waiter whose position moved its new one. A rise cannot wait for that pass, or the
client would be shown a better place than it has. Four events can raise a position
(`line.Line` says when, and the tests hold it to that): a newcomer that does not go last (an
interactive request, a quieter client's request), a waiter ageing into a better class (a timer
at `Line.next_aging`), and, while more than one client waits, a release (its fair-share
correction) or a cancel (a client's later waiters and the virtual time move up). Each is
followed, in the same reactor turn, by one walk of the order that tells only the waiters whose
position rose (for a newcomer, only those behind it). Everything else (a grant, a newcomer that
goes last, any change while one client waits, so the plain FIFO of one client and one class)
walks nothing extra; a newcomer's own place takes a walk unless the line can tell that it goes
last (`Line.goes_last`: one client's FIFO, or many clients waiting once each). A newcomer is
told its exact position at once,
and the waiter that gets a slot is told position 1 first if it had not been, so a client always
sees its position reach 1 before its answer starts.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

from twisted.internet.defer import Deferred, DeferredSemaphore, succeed
from twisted.internet.interfaces import IDelayedCall, IReactorTime

from homelab_gateway.core.estimate import HoldTimes, Waits
from homelab_gateway.core.line import CLASS_RANK, DEFAULT_CLASS, Grant, Line
from homelab_gateway.core.replicas import DOWN, UP, Circuit, Sessions, choose

PositionListener = Callable[[int], None]
HealthListener = Callable[["Replica", str, "str | None"], None]  # replica, new state, reason
ANONYMOUS = ""  # the client of a plain `acquire`
NORMAL = CLASS_RANK[DEFAULT_CLASS]
REPORT_INTERVAL = 1.0
"""How long a fall in position may wait to be told: the coalescing pass runs at most this often,
so while the line moves a waiter gets about one queue frame per second of waiting (a frame is
a write and a send for each of thousands of waiters), and a client's position is never more
than a second behind its fall. It was 0.4 s, which sent up to 2.5 frames a second each."""


class QueueFull(Exception):
    """The queue already holds `queue_limit` waiters."""


class Unavailable(Exception):
    """The line is shared through Redis and Redis cannot be reached: no slot can be granted
    without risking the cap (`shared.SharedSemaphore`)."""


class ClientQueueFull(QueueFull):
    """This client already has `max_waiting` waiters; others may still queue."""

    def __init__(self, client: str, limit: int) -> None:
        super().__init__(client, limit)
        self.client = client
        self.limit = limit


@dataclass(eq=False)
class Replica:
    """One upstream's slots, and its health. It belongs to one line at a time (`group`); a
    reload may move it to another, with the slots it holds."""

    name: str
    limit: int
    fallback: bool = False
    circuit: Circuit = field(default_factory=Circuit)
    held: int = 0
    group: PositionedSemaphore | None = None
    owner: Any = None  # what the service keeps for this upstream (its Pool)
    share: float | None = None  # while set, only this fraction of `limit` may be held

    @property
    def usable(self) -> int:
        """The slots that may be held: all of them, or a gateway's fallback share of a shared
        upstream while it cannot reach the others (`shared.SharedSemaphore`)."""
        return self.limit if self.share is None else int(self.limit * self.share)

    @property
    def free(self) -> int:
        return max(0, self.usable - self.held)

    def open_at(self, now: float) -> bool:
        """Whether a request may start here now: a free slot, and in rotation."""
        return self.held < self.usable and self.circuit.admits(now)


@dataclass(slots=True)
class _Want:
    """What a waiter may take: slots of `among` (None: any replica of the line), preferably not
    of `avoid` (replicas it already failed on), preferably where `session` was served last."""

    among: frozenset[Replica] | None = None
    avoid: frozenset[Replica] = frozenset()
    session: str | None = None

    @property
    def choosy(self) -> bool:
        """Whether the head of the line may not be the waiter a free slot goes to."""
        return self.among is not None or bool(self.avoid)


@dataclass(eq=False)
class Slot:
    """One granted slot on `replica`. `release` gives it back once and settles its client's
    fair share with the time it was really held; `succeeded` and `failed` tell the replica's
    circuit what the request met there."""

    semaphore: PositionedSemaphore
    grant: Grant
    granted_at: float
    replica: Replica
    trial: bool = False  # the one request a half-open replica lets through
    on_release: Callable[[float], None] | None = None  # told the seconds the slot was held
    released: bool = False
    judged: bool = False
    id: str = ""  # its name in a line shared through Redis

    def succeeded(self) -> None:
        self.judged = True
        self._line()._judged(self, None)

    def failed(self, reason: str) -> None:
        self.judged = True
        self._line()._judged(self, reason)

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        self.semaphore._released(self)

    def _line(self) -> PositionedSemaphore:
        return self.replica.group or self.semaphore


class PositionedSemaphore(DeferredSemaphore):
    """Slots with an ordered line and position reports. Keeps the base class's `limit` (all
    slots), `tokens` (free slots in rotation) and `waiting` (the waiters' Deferreds, in arrival
    order) meaningful for readers, and `acquire`/`release` working as DeferredSemaphore's."""

    def __init__(
        self,
        tokens: int | Sequence[Replica],
        clock: IReactorTime,
        *,
        queue_limit: int | None = None,
        report_interval: float = REPORT_INTERVAL,
        aging: float | None = None,
        weights: Mapping[str, float] = {},
        max_waiting: Mapping[str, int] = {},
        on_health: HealthListener | None = None,
    ) -> None:
        members = [Replica(ANONYMOUS, tokens)] if isinstance(tokens, int) else list(tokens)
        super().__init__(max(1, sum(m.limit for m in members)))
        self.members = members
        for member in members:
            member.group = self
        self.clock = clock
        self.queue_limit = queue_limit
        self.report_interval = report_interval
        self.max_waiting = dict(max_waiting)
        self.on_health = on_health
        self.line: Line[Deferred[Slot]] = Line(aging=aging, weights=weights)
        self.sessions = Sessions()
        self.holds = HoldTimes()
        self._holding: dict[Slot, None] = {}  # granted and not released, oldest first
        self._first: deque[Deferred[Slot]] = deque()  # retries, served before the line
        self._retrying: dict[Deferred[Slot], tuple[str, int]] = {}  # their client and class
        self._wants: dict[Deferred[Slot], _Want] = {}
        self._choosy = 0  # waiters in `line` that cannot take every replica's slot
        self._moved: dict[Deferred[Slot], PositionedSemaphore] = {}  # waiters a reload moved
        self._turn = 0
        self._listeners: dict[Deferred[Slot], PositionListener] = {}
        self._reported: dict[Deferred[Slot], int] = {}
        self._pass: IDelayedCall | None = None
        # While a walk tells positions (`_telling`): the estimate's view of the slots, taken
        # once for the walk (None: no estimate), since nothing changes them until it ends.
        self._telling = False
        self._waits: Waits | None = None
        self._aging: IDelayedCall | None = None
        self._cooling: dict[Replica, IDelayedCall] = {}
        self.reports = 0  # position reports made: how many frames the coalescing saves
        self._count()

    @property
    def in_use(self) -> int:
        return sum(m.held for m in self.members)

    @property
    def name(self) -> str:
        """Its upstreams' names, joined by '+': how status and metrics name a shared line."""
        return "+".join(m.name for m in self.members)

    def _count(self) -> None:
        self.limit = max(1, sum(m.limit for m in self.members))
        self.tokens = sum(m.free for m in self.members if m.circuit.state == UP)

    def resize(self, limit: int) -> None:
        """Change the number of slots of a line of one replica: more slots are granted at once
        to the waiters next in line; fewer take effect as held slots are released, never
        revoked. (A reload sets each replica's `limit` and calls `refresh`.)"""
        self.members[0].limit = limit
        self.refresh()

    def refresh(self) -> None:
        """After a change to the replicas (slots, membership, health): grant what is free."""
        self._hand_over()
        self._changed()

    def configure_line(
        self, *, aging: float | None, weights: Mapping[str, float], max_waiting: Mapping[str, int]
    ) -> None:
        """New [queue] aging, client weights and max_waiting (config reload); nobody waiting
        loses a place, and a client now over its max_waiting keeps the requests it has queued."""
        self.line.configure(aging=aging, weights=weights)
        self.max_waiting = dict(max_waiting)
        now = self.clock.seconds()
        self._tell_rises(now)
        self._changed()
        if self._aging is not None:  # a shorter period may age someone sooner
            self._aging.cancel()
            self._aging = None
        self._watch_aging(now)

    def acquire(self) -> Deferred[DeferredSemaphore]:
        """DeferredSemaphore's acquire, as an anonymous `normal` waiter."""
        d = self.acquire_in_line()
        return d.addCallback(self._as_semaphore)

    def _as_semaphore(self, slot: Slot) -> DeferredSemaphore:
        return self

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
        """A slot for `client`'s request of class `rank` on one of `among` (None: any of this
        line's replicas), telling `on_position` the waiter's 1-based place while it waits.
        `first` puts a retried request ahead of the line, past its limits.

        Raises QueueFull (ClientQueueFull for the client's own cap), without queueing, when no
        slot is free and the line (or the client's share of it) is full.
        """
        now = self.clock.seconds()
        cooled = any(m.circuit.state == DOWN and m.open_at(now) for m in self.members)
        if self.waiting and cooled and self._hand_over():
            # A cool-down ended in this instant, before its timer ran: those already waiting
            # got the trial first, and one granted out of turn may have moved others back.
            self._tell_rises(now)
        want = self._want(among, avoid, session)
        candidates = self._open_for(want, now)
        if candidates:
            grant, moved = self.line.admit(client, rank, now)
            slot = self._grant(candidates, want, grant, now)
            if moved:  # others wait for replicas this one skipped
                self._tell_rises(now)
                self._changed()
            return succeed(slot)
        if not first:
            self._check_room(client)
        d: Deferred[Slot] = Deferred(canceller=self._cancelAcquire)
        self._enqueue(d, client, rank, now, want, first)
        if on_position is None and not self._listeners:
            return d
        if on_position is not None:
            self._listeners[d] = on_position
            d.addBoth(self._leave_line, d)
        if first:
            self._place(d, now)
        elif self.line.queues == 1 and not self._first:  # a plain FIFO: the newcomer is its tail
            if on_position is not None:
                self._tell(d, len(self.line))
        else:
            self._place(d, now)
        self._watch_aging(now)
        return d

    def _want(
        self, among: frozenset[Replica] | None, avoid: frozenset[Replica], session: str | None
    ) -> _Want | None:
        """What a waiter may take; None for any replica of the line, no session."""
        if among is not None and len(among) == len(self.members):
            among = None
        return _Want(among, avoid, session) if among or avoid or session else None

    def _check_room(self, client: str) -> None:
        """Raise QueueFull (ClientQueueFull) if the line (the client's share of it) is full."""
        self.check_room(client, len(self.waiting), self.line.waiting_for(client))

    def check_room(self, client: str, waiting: int, client_waiting: int) -> None:
        """Raise QueueFull (ClientQueueFull) if `waiting` waiters, `client_waiting` of them
        `client`'s, are as many as this line lets wait: for its own waiters, and for those of
        any other wait it bounds the same way (a count waiting for a tokenizer place)."""
        if self.queue_limit is not None and waiting >= self.queue_limit:
            raise QueueFull()
        limit = self.max_waiting.get(client)
        if limit is not None and client_waiting >= limit:
            raise ClientQueueFull(client, limit)

    def _open_for(self, want: _Want | None, now: float) -> list[Replica]:
        """The replicas a waiter may start on now. A retry avoids the replicas it failed on
        while another of its replicas is in rotation (busy or not)."""
        members = self.members
        if want is not None:
            if want.among is not None:
                members = [m for m in members if m in want.among]
            if want.avoid:
                fresh = [m for m in members if m not in want.avoid and m.circuit.state != DOWN]
                members = fresh or members
        return [m for m in members if m.open_at(now)]

    def _grant(
        self, candidates: list[Replica], want: _Want | None, grant: Grant, now: float
    ) -> Slot:
        session = want.session if want is not None else None
        replica = choose(candidates, self.sessions.get(session), self._turn)
        self._turn += 1
        replica.held += 1
        trial = replica.circuit.begin()
        self.sessions.served(session, replica.name)
        self._count()
        slot = Slot(self, grant, now, replica, trial)
        self._holding[slot] = None
        return slot

    def _order(self, now: float) -> Iterator[Deferred[Slot]]:
        """Everyone waiting, in the order they would be served: retries, then the line."""
        line = self.line.order(now)
        return chain(self._first, line) if self._first else line

    def _place(self, d: Deferred[Slot], now: float) -> None:
        """Tell a newcomer its place and, in the same walk, those it went ahead of their new
        one: nobody ahead of it moved. One that goes last (`Line.goes_last`) moves nobody."""
        if d in self.line and self.line.goes_last(d, now):
            if d in self._listeners:
                self._tell(d, len(self.waiting))
            return
        places = enumerate(self._order(now), start=1)
        position = next(place for place, waiter in places if waiter is d)
        if d in self._listeners:
            self._tell(d, position)
        if position < len(self.waiting):
            self._raise(places)
            self._changed()  # its client's later waiters went back: others may have moved up

    def _released(self, slot: Slot) -> None:
        """`slot` was released: settle its client's fair share with the time it was really
        held and hand the slot on."""
        held = self.clock.seconds() - slot.granted_at
        reordered = self.line.settle(slot.grant, held)
        if slot.on_release is not None:
            slot.on_release(held)
        if slot.trial and not slot.judged:
            slot.replica.circuit.abandoned()
        self._holding.pop(slot, None)
        line = slot._line()
        line.holds.add(held)
        line._give_back(slot.replica, reordered and line is self)

    def _judged(self, slot: Slot, failure: str | None) -> None:
        """What a request met on `slot`'s replica (None: success), for its circuit."""
        replica = slot.replica
        if failure is None:
            change = replica.circuit.succeeded()
        else:
            change = replica.circuit.failed(self.clock.seconds(), failure)
        if change is not None:
            self._health_changed(replica, change, failure)

    def release(self) -> None:
        """Free one slot of the only replica: the line's next waiter gets it at once
        (synchronously). Slots of a plain `acquire` are alike: the oldest is the one freed."""
        if self._holding:
            del self._holding[next(iter(self._holding))]
        self._give_back(self.members[0], reordered=False)

    def estimate(self, position: int) -> float | None:
        """Seconds the waiter at `position` is expected to wait (`estimate.Waits`), or None
        until enough slots have been held and released here, or while none is in rotation."""
        waits = self._waits if self._telling else self._current_waits()
        return None if waits is None else waits.at(position, self.clock.seconds())

    def _current_waits(self) -> Waits | None:
        mean = self.holds.mean()
        if mean is None:
            return None
        slots = sum(m.limit for m in self.members if m.circuit.state == UP)
        if not slots:
            return None
        return Waits((s.granted_at for s in self._holding), slots, mean)

    def _give_back(self, replica: Replica, reordered: bool) -> None:
        """A slot of `replica` is free again, after a `Line.settle` that may have `reordered`
        the line: then those moved back learn it now (a grant itself moves nobody back)."""
        assert replica.held > 0, "release without a held slot"
        replica.held -= 1
        reordered = self._hand_over() or reordered
        if reordered:
            self._tell_rises(self.clock.seconds())
        self._changed()

    def _hand_over(self) -> bool:
        """Grant every free slot in rotation that a waiter may take, in the line's order; True
        if an out-of-turn grant may have moved someone back."""
        now = self.clock.seconds()
        reordered = False
        while self.waiting:
            if not any(m.open_at(now) for m in self.members):
                break
            taken = self._take_next(now)
            if taken is None:
                break
            d, want, candidates, grant, moved = taken
            reordered = reordered or moved
            d.callback(self._grant(candidates, want, grant, now))
        self._count()
        return reordered

    def _take_next(
        self, now: float
    ) -> tuple[Deferred[Slot], _Want | None, list[Replica], Grant, bool] | None:
        """Take out of the line the first waiter, in order, that may start on a replica now:
        it, what it may take, the replicas it may start on, its grant, and whether taking it
        may have moved another waiter back (`_take_out`)."""
        for d in self._first:
            want = self._wants.get(d)
            candidates = self._open_for(want, now)
            if candidates:
                return d, want, candidates, *self._take_out(d, now)
        if not self._choosy:
            # Everyone may take any replica, so the head of the line gets it.
            granted = self.line.grant(now)
            if granted is None:
                return None
            d, grant, moved = granted
            want = self._out_of_line(d)
            return d, want, self._open_for(want, now), grant, moved
        # Some may take only some replicas: the first in order that may start now.
        for d in self.line.order(now):
            want = self._wants.get(d)
            candidates = self._open_for(want, now)
            if candidates:
                return d, want, candidates, *self._take_out(d, now)
        return None

    def _take_out(self, d: Any, now: float) -> tuple[Grant, bool]:
        """Take waiter `d` out of the line, granted, and charge its client as the line does (a
        retry as admitted). Also True if that may have moved another waiter back."""
        if d in self._retrying:
            self._first.remove(d)
            client, rank = self._retrying.pop(d)
            grant, moved = self.line.admit(client, rank, now)
        else:
            want = self._wants.get(d)
            if want is not None and want.choosy:
                self._choosy -= 1
            granted = self.line.grant(now, d)
            assert granted is not None
            grant, moved = granted[1], granted[2]
        self._out_of_line(d)
        return grant, moved

    def _out_of_line(self, d: Deferred[Slot]) -> _Want | None:
        """`d` waits no more (granted, gone): out of `waiting`, what it may take forgotten."""
        if self.waiting[0] is d:
            del self.waiting[0]
        else:
            self.waiting.remove(d)
        return self._wants.pop(d, None)

    def _cancelAcquire(self, d: Deferred[Slot]) -> None:  # type: ignore[override]
        moved = self._moved.get(d)
        if moved is not None:
            moved._cancelAcquire(d)
            return
        if self._dequeue(d):
            self._tell_rises(self.clock.seconds())
        self._changed()

    def _enqueue(
        self,
        d: Deferred[Slot],
        client: str,
        rank: int,
        arrived: float,
        want: _Want | None,
        first: bool,
    ) -> None:
        """Put a waiter in the line (a retry: ahead of it), with what it may take."""
        if first:
            self._first.append(d)
            self._retrying[d] = (client, rank)
        else:
            self.line.join(d, client, rank, arrived)
            if want is not None and want.choosy:
                self._choosy += 1
        if want is not None:
            self._wants[d] = want
        self.waiting.append(d)

    def _dequeue(self, d: Deferred[Slot]) -> bool:
        """Take a waiter that was not granted out of the line; True if that may have moved
        another waiter back (`Line.leave`)."""
        reordered = False
        if d in self._retrying:
            self._first.remove(d)
            del self._retrying[d]
        else:
            reordered = self.line.leave(d)
            want = self._wants.get(d)
            if want is not None and want.choosy:
                self._choosy -= 1
        self._out_of_line(d)
        return reordered

    def _leave_line(self, result: object, d: Deferred[Slot]) -> object:
        moved = self._moved.get(d)
        if moved is not None:
            return moved._leave_line(result, d)
        # A shared line's waiter may end before its place was known: no listener yet.
        listener = self._listeners.pop(d, None)
        last = self._reported.pop(d, None)
        if listener is not None and last != 1 and isinstance(result, Slot):
            listener(1)  # it was truly first in line when release handed it the slot
            self.reports += 1
        return result

    def _tell(self, d: Deferred[Slot], position: int) -> None:
        self._reported[d] = position
        self.reports += 1
        self._listeners[d](position)

    def _changed(self) -> None:
        if self._pass is None and self._listeners:
            self._pass = self.clock.callLater(self.report_interval, self._renumber)

    def _renumber(self) -> None:
        self._pass = None
        self._tell_all(self.clock.seconds())

    def _tell_all(self, now: float) -> None:
        """Tell every listening waiter whose place is not its last report its place."""
        listeners, reported = self._listeners, self._reported
        with self._telling_positions():
            for position, d in enumerate(self._order(now), start=1):
                # `_tell`, inline: this runs once per waiter every second while the line moves.
                listener = listeners.get(d)
                if listener is not None and reported.get(d) != position:
                    reported[d] = position
                    self.reports += 1
                    listener(position)

    def _tell_rises(self, now: float) -> None:
        """After an event that may have moved waiters back: tell those now."""
        if self._listeners and (self.line.queues > 1 or self._first):
            self._raise(enumerate(self._order(now), start=1))

    def _raise(self, places: Iterator[tuple[int, Deferred[Slot]]]) -> None:
        """Tell each listening waiter whose place is now higher than its last report; falls
        wait for the coalesced pass."""
        reported = self._reported
        with self._telling_positions():
            for position, d in places:
                if reported.get(d, position) < position:
                    self._tell(d, position)

    @contextmanager
    def _telling_positions(self) -> Iterator[None]:
        """A walk that tells positions: one view of the slots for every estimate it asks. A
        listener only writes (a client that left is cancelled in a later turn), so the line,
        its slots and their hold times stay as they are until the walk ends."""
        self._waits = self._current_waits()
        self._telling = True
        try:
            yield
        finally:
            self._telling = False
            self._waits = None

    def _watch_aging(self, now: float) -> None:
        """Keep the aging timer no later than the next moment a waiter ages into a better
        class, if that can reorder: `Line.next_aging` is a look at the top of a heap, so
        every join and adoption looks. A timer that must come sooner is a new call, not a
        `reset`: the reactor would search all its timers for that. One sooner than needed
        (the waiter it was set for left) stays: it finds nobody to tell, and looks again."""
        if not self._listeners:
            return
        at = self.line.next_aging(now)
        if at is None:
            return
        if self._aging is not None:
            if self._aging.getTime() <= at:
                return
            self._aging.cancel()
        self._aging = self.clock.callLater(max(0.0, at - now), self._aged)

    def _aged(self) -> None:
        self._aging = None
        now = self.clock.seconds()
        self._tell_rises(now)
        self._changed()
        self._watch_aging(now)

    def recovered(self, replica: Replica) -> None:
        """A background probe reached `replica`: back in rotation if it was out."""
        change = replica.circuit.probed()
        if change is not None:
            self._health_changed(replica, change, None)

    def _health_changed(self, replica: Replica, state: str, reason: str | None) -> None:
        timer = self._cooling.pop(replica, None)
        if timer is not None and timer.active():
            timer.cancel()
        if state == DOWN and replica.circuit.retry_at is not None:
            delay = max(0.0, replica.circuit.retry_at - self.clock.seconds())
            self._cooling[replica] = self.clock.callLater(delay, self._cooled, replica)
        if self.on_health is not None:
            self.on_health(replica, state, reason)
        self.refresh()

    def _cooled(self, replica: Replica) -> None:
        """`replica`'s cool-down is over: a waiter may take it as the trial."""
        del self._cooling[replica]
        self.refresh()

    def adopt(self, old: PositionedSemaphore) -> None:
        """Take over the waiters of `old` whose replicas are now this line's (a reload that
        gave a model more replicas, or joined two lines): each keeps its class, its arrival
        time and its listener. Those whose replicas all left stay in `old`."""
        now = old.clock.seconds()
        for d in list(old._order(now)):
            adoptable, want = self._want_here(old._wants.get(d))
            if not adoptable:
                continue
            first = d in old._retrying
            if first:
                (client, rank), arrived = old._retrying[d], now
            else:
                client, rank, arrived = old.line.arrived(d)
            old._dequeue(d)
            self._moved_from(old, d)
            self._enqueue(d, client, rank, arrived, want, first)
            listener = old._listeners.pop(d, None)
            if listener is not None:
                self._listeners[d] = listener
                self._reported[d] = old._reported.pop(d)
        old.members = [m for m in old.members if m.group is old]
        old._count()
        self._tell_rises(now)
        self._watch_aging(now)
        self.refresh()

    def _want_here(self, want: _Want | None) -> tuple[bool, _Want | None]:
        """Whether a waiter of another line (a reload) may wait in this one, and what it may
        take here: one that could take any of the old line's replicas (its model's) takes any
        of this line's; one kept to some keeps to those of them that are here."""
        want = want or _Want()
        among = frozenset(self.members) if want.among is None else want.among
        among = among.intersection(self.members)
        restricted = among if len(among) < len(self.members) else None
        moved = _Want(restricted, want.avoid, want.session)
        return bool(among), (moved if moved != _Want() else None)

    def _moved_from(self, old: PositionedSemaphore, d: Deferred[Slot]) -> None:
        """`old`'s waiter `d` waits here now: its cancel and its end are forwarded here."""
        old._moved[d] = self
        d.addBoth(self._forget_move, old, d)

    @staticmethod
    def _forget_move(result: Any, old: PositionedSemaphore, d: Deferred[Slot]) -> Any:
        old._moved.pop(d, None)
        return result

    def fail_waiting(self, reason: Exception) -> None:
        """Empty the line, failing every waiter with `reason` (shutdown)."""
        waiting, self.waiting = self.waiting, []
        for d in waiting:
            if d in self._retrying:
                del self._retrying[d]
            else:
                self.line.leave(d)
        self._first.clear()
        self._wants.clear()
        self._choosy = 0
        for d in waiting:
            d.errback(reason)

    def close(self) -> None:
        """Stop the pending renumbering pass and every timer (service shutdown, test cleanup)."""
        for call in (self._pass, self._aging, *self._cooling.values()):
            if call is not None and call.active():
                call.cancel()
        self._pass = self._aging = None
        self._cooling.clear()
