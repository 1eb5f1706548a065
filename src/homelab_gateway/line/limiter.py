"""Slots and their line: a DeferredSemaphore whose waiters learn their place in line.

One line serves the slots of one or more upstreams (`Replica`): a model with several replicas
waits in one line and takes the first slot that frees on any of its replicas in rotation, and
an upstream that serves several models shares its slots among them through that same line.
Who gets a freed slot, and where, is `dispatch.Dispatch`'s decision. This module is the
Twisted layer around it: Deferreds, the clock, position reports, cool-down timers; and the
in-process source of the line's changes (`InProcess`), which applies each at once. A line
shared through Redis has another source (`shared.RedisSource`) behind the same interface.

The guarantee: a reported position is never lower than the truth, at any moment, and a fall is
told within `report_interval`. Falls are the common case (a slot frees, a waiter ahead gives
up) and are coalesced into one renumbering pass `report_interval` later: renumbering every
waiter on every change would cost a frame per waiter per change (`python -m bench.frames`:
5,000 waiters behind 2 slots). A rise cannot wait, or the
client would be shown a better place than it has; the line says which changes may cause one
(a newcomer that does not go last, an aging moment, a release or a cancel while more than one
client waits) and each is followed, in the same reactor turn, by one walk that tells only the
waiters whose position rose. The waiter that gets a slot is told position 1 first if it had
not been, so a client always sees its position reach 1 before its answer starts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

from twisted.internet.defer import Deferred, DeferredSemaphore, succeed
from twisted.internet.interfaces import IDelayedCall, IReactorTime

from homelab_gateway.core.dispatch import Dispatch, Replica, Start, Want
from homelab_gateway.core.estimate import HoldTimes, Waits
from homelab_gateway.core.line import CLASS_RANK, DEFAULT_CLASS, Grant, Line
from homelab_gateway.core.replicas import DOWN, UP, Sessions
from homelab_gateway.line.refusals import ClientQueueFull, QueueFull

PositionListener = Callable[[int], None]
HealthListener = Callable[[Replica, str, "str | None"], None]  # replica, new state, reason
ANONYMOUS = ""  # the client of a plain `acquire`
NORMAL = CLASS_RANK[DEFAULT_CLASS]
REPORT_INTERVAL = 1.0
"""How long a fall in position may wait to be told: while the line moves a waiter gets about one
queue frame per second of waiting, and its position is never more than a second behind."""


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
        self.line().source.judge(self, None)

    def failed(self, reason: str) -> None:
        self.judged = True
        self.line().source.judge(self, reason)

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        self.semaphore.source.release(self)

    def line(self) -> PositionedSemaphore:
        """The line its replica is in now (a reload may have moved it)."""
        return self.replica.line or self.semaphore


@dataclass(slots=True)
class Request:
    """What a waiter asked for (`acquire_in_line`)."""

    client: str
    rank: int
    want: Want | None
    retry: bool  # a retried request: it waits ahead of the line, past its limits
    listener: PositionListener | None


class Source(Protocol):
    """Where a line's changes come from: each call asks for one, and the source applies it to
    the line (`PositionedSemaphore.wait`, `start`, `dequeue`, `give_back`, `judge`) when it
    happens: at once in process, when Redis's stream says so for a shared line."""

    def ask(self, request: Request) -> Deferred[Slot]: ...
    def give_up(self, d: Deferred[Slot]) -> None: ...
    def release(self, slot: Slot) -> None: ...
    def judge(self, slot: Slot, failure: str | None) -> None: ...
    def probed(self, replica: Replica) -> None: ...
    def grant_free(self) -> bool: ...
    def fail_waiting(self, reason: Exception) -> None: ...
    def adopt(self, old: PositionedSemaphore) -> None: ...
    def serves(self, members: Sequence[Replica]) -> bool: ...
    def close(self) -> None: ...


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
        max_in_flight: Mapping[str, int] = {},
        on_health: HealthListener | None = None,
    ) -> None:
        members = [Replica(ANONYMOUS, tokens)] if isinstance(tokens, int) else list(tokens)
        super().__init__(max(1, sum(m.limit for m in members)))
        for member in members:
            member.line = self
        self.clock = clock
        self.queue_limit = queue_limit
        self.report_interval = report_interval
        self.max_waiting = dict(max_waiting)
        self.on_health = on_health
        # Told after every change of who waits or holds a slot: models loaded on demand
        # (`line.residency`) plan on it. None for an upstream that is always loaded.
        self.watcher: Callable[[], None] | None = None
        self.dispatch: Dispatch[Any] = Dispatch(
            members, aging=aging, weights=weights, caps=max_in_flight
        )
        self.source: Source = InProcess(self)
        self.holds = HoldTimes()
        self.holding: dict[Slot, None] = {}  # granted and not released, oldest first
        self._moved: dict[Deferred[Slot], PositionedSemaphore] = {}  # waiters a reload moved
        self._listeners: dict[Any, PositionListener] = {}
        self._reported: dict[Any, int] = {}
        self._pass: IDelayedCall | None = None
        # While a walk tells positions (`_telling`): the estimate's view of the slots, taken
        # once for the walk (None: no estimate), since nothing changes them until it ends.
        self._telling = False
        self._waits: Waits | None = None
        self._aging: IDelayedCall | None = None
        self._cooling: dict[Replica, IDelayedCall] = {}
        self.reports = 0  # position reports made: how many frames the coalescing saves
        self.count()

    @property
    def members(self) -> list[Replica]:
        return self.dispatch.members

    @members.setter
    def members(self, members: list[Replica]) -> None:
        self.dispatch.members = members

    @property
    def line(self) -> Line[Any]:
        return self.dispatch.line

    @property
    def sessions(self) -> Sessions:
        return self.dispatch.sessions

    @property
    def in_use(self) -> int:
        return sum(m.held for m in self.members)

    @property
    def name(self) -> str:
        """Its upstreams' names, joined by '+': how status and metrics name a shared line."""
        return "+".join(m.name for m in self.members)

    def count(self) -> None:
        """Bring `limit` and `tokens` up to date with the replicas."""
        self.limit, self.tokens = self.dispatch.slots()
        if self.watcher is not None:
            self.watcher()

    def retell(self) -> None:
        """Tell every listening waiter its place again: what its frame says besides its place
        (its model's state, `line.residency`) changed."""
        self._reported.clear()
        self.tell_all(self.clock.seconds())

    def resize(self, limit: int) -> None:
        """Change the number of slots of a line of one replica: more slots are granted at once
        to the waiters next in line; fewer take effect as held slots are released, never
        revoked. (A reload sets each replica's `limit` and calls `refresh`.)"""
        self.members[0].limit = limit
        self.refresh()

    def refresh(self) -> None:
        """After a change to the replicas (slots, membership, health): grant what is free."""
        if self.source.grant_free():  # out of turn, or it capped a client: some moved back
            self.tell_rises(self.clock.seconds())
        self.count()
        self.changed()

    def configure_line(
        self,
        *,
        aging: float | None,
        weights: Mapping[str, float],
        max_waiting: Mapping[str, int],
        max_in_flight: Mapping[str, int] = {},
    ) -> None:
        """New [queue] aging, client weights, max_waiting and max_in_flight (config reload);
        nobody waiting loses a place, a client now over its max_waiting keeps the requests it
        has queued, and one over its max_in_flight the slots it holds."""
        self.line.configure(aging=aging, weights=weights)
        self.dispatch.configure(max_in_flight)
        self.max_waiting = dict(max_waiting)
        now = self.clock.seconds()
        if self.waiting:  # a higher max_in_flight may let a waiter start now
            self.source.grant_free()
            self.count()
        self.tell_rises(now)
        self.changed()
        if self._aging is not None:  # a shorter period may age someone sooner
            self._aging.cancel()
            self._aging = None
        self.watch_aging(now)

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
        slot is free and the line (or the client's share of it) is full; Unavailable when a
        shared line cannot reach Redis.
        """
        now = self.clock.seconds()
        cooled = any(m.circuit.state == DOWN and m.open_at(now) for m in self.dispatch.members)
        if self.waiting and cooled and self.source.grant_free():
            # A cool-down ended in this instant, before its timer ran: those already waiting
            # got the trial first, and one granted out of turn may have moved others back.
            self.tell_rises(now)
        want = self.dispatch.want(among, avoid, session)
        return self.source.ask(Request(client, rank, want, first, on_position))

    def refuse_if_full(self, client: str) -> None:
        """Raise QueueFull (ClientQueueFull) if the line (the client's share of it) is full."""
        self.check_room(client, len(self.waiting), self.dispatch.line.waiting_for(client))

    def check_room(self, client: str, waiting: int, client_waiting: int) -> None:
        """Raise QueueFull (ClientQueueFull) if `waiting` waiters, `client_waiting` of them
        `client`'s, are as many as this line lets wait: for its own waiters, and for those of
        any other wait it bounds the same way (a count waiting for a tokenizer place)."""
        if self.queue_limit is not None and waiting >= self.queue_limit:
            raise QueueFull()
        limit = self.max_waiting.get(client)
        if limit is not None and client_waiting >= limit:
            raise ClientQueueFull(client, limit)

    def release(self) -> None:
        """Free one slot of the only replica: the line's next waiter gets it at once
        (synchronously). Slots of a plain `acquire` are alike: the oldest is the one freed."""
        assert self.holding, "release without a held slot"
        next(iter(self.holding)).release()

    def recovered(self, replica: Replica) -> None:
        """A background probe reached `replica`: back in rotation if it was out."""
        self.source.probed(replica)

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
        return Waits((s.granted_at for s in self.holding), slots, mean)

    # -- the changes a source applies ------------------------------------------------------

    def new_waiter(self, request: Request) -> Deferred[Slot]:
        """The Deferred a waiter is given: cancelling it gives up its place."""
        d: Deferred[Slot] = Deferred(canceller=self._cancelAcquire)
        if request.listener is not None:
            d.addBoth(self._leave_line, d)
        return d

    def enqueue(self, item: Any, request: Request, arrived: float) -> bool:
        """`item` waits (told nothing: `wait` tells). False if it went ahead of waiters of
        its client and class (it arrived before them: moved, or joining again)."""
        last = self.dispatch.join(
            item, request.client, request.rank, arrived, request.want, request.retry
        )
        self.waiting.append(item)
        return last

    def wait(self, item: Any, request: Request, arrived: float, now: float) -> None:
        """`item` waits: it is told its place, and those it went ahead of theirs. In a plain
        FIFO its place is the line's length, with no walk of the order (`python -m bench.burst`:
        5,000 waiters of one client would otherwise walk it once each)."""
        last = self.enqueue(item, request, arrived)
        if self.watcher is not None:
            self.watcher()
        if request.listener is not None:
            self._listeners[item] = request.listener
        if not self._listeners:
            return
        if self.dispatch.plain and last:  # a plain FIFO: the newcomer is its tail
            if request.listener is not None:
                self._tell(item, len(self.dispatch.line))
        else:
            self._place(item, now)
        self.watch_aging(now)

    def start(self, start: Start[Any], now: float, id: str = "") -> Slot:
        """A slot for what `Dispatch` started (its replica is held already; the caller
        counts)."""
        slot = Slot(self, start.grant, now, start.replica, start.trial, id=id)
        self.holding[slot] = None
        return slot

    def out_of_line(self, item: Any) -> None:
        """`item` waits no more (granted, gone): out of `waiting`."""
        if self.waiting[0] is item:
            del self.waiting[0]
        else:
            self.waiting.remove(item)

    def dequeue(self, item: Any, now: float) -> None:
        """A waiter that was not granted leaves the line; those it moved back are told."""
        moved = self.dispatch.leave(item)
        self.out_of_line(item)
        if moved:
            self.tell_rises(now)
        self.changed()
        if self.watcher is not None:
            self.watcher()

    def give_back(self, slot: Slot, held: float, now: float) -> None:
        """`slot` is free again after `held` seconds: its client's fair share is settled with
        that, and the slot goes to the next waiter of the line its replica is in now."""
        assert slot.replica.held > 0, "release without a held slot"
        line = slot.line()
        # Counted in the line its replica is in now: its client may be capped there no more.
        uncapped = line.dispatch.unhold(slot.replica, slot.grant.client)
        self.holding.pop(slot, None)
        moved = self.dispatch.line.settle(slot.grant, held)
        line.holds.add(held)
        if line is not self:  # a reload moved the replica: the settle may have moved ours
            if moved:
                self.tell_rises(now)
            self.changed()
            moved = False
        # Which counts, or its batch's end does; an uncapped client's waiters go before others.
        moved = line.source.grant_free() or moved or uncapped
        if moved:
            line.tell_rises(now)
        line.changed()

    def judge(self, replica: Replica, failure: str | None, now: float) -> None:
        """What a request met on `replica` (None: success), for its circuit."""
        if failure is None:
            change = replica.circuit.succeeded()
        else:
            change = replica.circuit.failed(now, failure)
        if change is not None:
            self._health_changed(replica, change, failure)

    def probe_reached(self, replica: Replica) -> None:
        change = replica.circuit.probed()
        if change is not None:
            self._health_changed(replica, change, None)

    def take_over(self, old: PositionedSemaphore, d: Deferred[Slot]) -> None:
        """`old`'s waiter `d` waits here now: its cancel and its end are forwarded here."""
        old._moved[d] = self
        d.addBoth(self._forget_move, old, d)

    def take_listener(self, old: PositionedSemaphore, d: Any) -> None:
        """`old`'s waiter `d` is told its place by this line from now on."""
        listener = old._listeners.pop(d, None)
        reported = old._reported.pop(d, None)
        if listener is not None:
            self._listeners[d] = listener
            if reported is not None:
                self._reported[d] = reported

    def listener_of(self, item: Any) -> PositionListener | None:
        return self._listeners.get(item)

    def forget_line(self) -> None:
        """Start afresh: nobody waits, no slot is held (a shared line's copy made anew)."""
        old = self.dispatch
        self.dispatch = Dispatch(
            old.members, aging=old.line.aging, weights=old.line.weights, caps=old.caps
        )
        self.dispatch.sessions = old.sessions  # where sessions were served is no line's state
        self.waiting = []
        self.holding = {}
        for member in self.members:
            member.held = 0
            member.clients = {}

    # -- position reports --------------------------------------------------------------------

    @staticmethod
    def _forget_move(result: Any, old: PositionedSemaphore, d: Deferred[Slot]) -> Any:
        old._moved.pop(d, None)
        return result

    def _cancelAcquire(self, d: Deferred[Slot]) -> None:  # type: ignore[override]
        moved = self._moved.get(d)
        if moved is not None:
            moved._cancelAcquire(d)
            return
        self.source.give_up(d)

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

    def _tell(self, d: Any, position: int) -> None:
        self._reported[d] = position
        self.reports += 1
        self._listeners[d](position)

    def _place(self, d: Any, now: float) -> None:
        """Tell a newcomer its place and, in the same walk, those it went ahead of their new
        one: nobody ahead of it moved. One that goes last (`Line.is_last`) moves nobody."""
        if self.dispatch.is_last(d, now):
            if d in self._listeners:
                self._tell(d, len(self.waiting))
            return
        places = enumerate(self.dispatch.order(now), start=1)
        position = next(place for place, waiter in places if waiter is d)
        if d in self._listeners:
            self._tell(d, position)
        if position < len(self.waiting):
            self._raise(places)
            self.changed()  # its client's later waiters went back: others may have moved up

    def changed(self) -> None:
        """Something moved: the coalesced pass tells the falls."""
        if self._pass is None and self._listeners:
            self._pass = self.clock.callLater(self.report_interval, self._renumber)

    def _renumber(self) -> None:
        self._pass = None
        self.tell_all(self.clock.seconds())

    def tell_all(self, now: float) -> None:
        """Tell every listening waiter whose place is not its last report its place."""
        listeners, reported = self._listeners, self._reported
        with self._telling_positions():
            for position, d in enumerate(self.dispatch.order(now), start=1):
                # `_tell`, inline: this runs once per waiter every second while the line moves.
                listener = listeners.get(d)
                if listener is not None and reported.get(d) != position:
                    reported[d] = position
                    self.reports += 1
                    listener(position)

    def tell_rises(self, now: float) -> None:
        """After an event that may have moved waiters back: tell those now."""
        if self._listeners and not self.dispatch.plain:
            self._raise(enumerate(self.dispatch.order(now), start=1))

    def _raise(self, places: Iterator[tuple[int, Any]]) -> None:
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

    def watch_aging(self, now: float) -> None:
        """Keep the aging timer no later than the next moment a waiter ages into a better
        class, if that can reorder. A timer that must come sooner is a new call, not a
        `reset`: the reactor would search all its timers for that. One sooner than needed
        (the waiter it was set for left) stays: it finds nobody to tell, and looks again."""
        if not self._listeners:
            return
        at = self.dispatch.line.next_aging(now)
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
        self.tell_rises(now)
        self.changed()
        self.watch_aging(now)

    # -- health ------------------------------------------------------------------------------

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

    # -- reloads and shutdown ----------------------------------------------------------------

    def adopt(self, old: PositionedSemaphore) -> None:
        """Take over the waiters of `old` whose replicas are now this line's (a reload that
        gave a model more replicas, or joined two lines): each keeps its class, its arrival
        time and its listener. Those whose replicas all left stay in `old`."""
        self.source.adopt(old)
        old.members = [m for m in old.members if m.line is old]
        old.count()
        self.refresh()

    def serves(self, members: Sequence[Replica]) -> bool:
        """Whether a fresh start would make this line for `members` (a reload keeps it)."""
        return set(self.members) == set(members) and self.source.serves(members)

    def fail_waiting(self, reason: Exception) -> None:
        """Empty the line, failing every waiter with `reason` (shutdown)."""
        self.source.fail_waiting(reason)

    def close(self) -> None:
        """Stop the pending renumbering pass and every timer (service shutdown, test cleanup)."""
        for call in (self._pass, self._aging, *self._cooling.values()):
            if call is not None and call.active():
                call.cancel()
        self._pass = self._aging = None
        self._cooling.clear()
        self.source.close()


class InProcess:
    """The line's changes happen here, at once: the default source, and a shared line's while
    it cannot reach Redis (its fallback share). `on_start` learns every slot it grants."""

    def __init__(
        self, line: PositionedSemaphore, on_start: Callable[[Slot], None] | None = None
    ) -> None:
        self.line = line
        self.on_start = on_start

    def ask(self, request: Request) -> Deferred[Slot]:
        line = self.line
        now = line.clock.seconds()
        start = line.dispatch.admit(request.client, request.rank, request.want, now)
        if start is not None:
            slot = self._started(start, now)
            line.count()
            if start.moved:  # others wait for replicas this one skipped
                line.tell_rises(now)
                line.changed()
            return succeed(slot)
        if not request.retry:
            line.refuse_if_full(request.client)
        d = line.new_waiter(request)
        line.wait(d, request, now, now)
        return d

    def _started(self, start: Start[Any], now: float) -> Slot:
        slot = self.line.start(start, now)
        if self.on_start is not None:
            self.on_start(slot)
        return slot

    def give_up(self, d: Deferred[Slot]) -> None:
        self.line.dequeue(d, self.line.clock.seconds())

    def release(self, slot: Slot) -> None:
        """`slot` was released: settle its client's fair share with the time it was really
        held and hand the slot on."""
        now = self.line.clock.seconds()
        held = max(0.0, now - slot.granted_at)  # a shared line's clock may step back a little
        if slot.on_release is not None:
            slot.on_release(held)
        if slot.trial and not slot.judged:
            slot.replica.circuit.abandoned()
        self.line.give_back(slot, held, now)

    def judge(self, slot: Slot, failure: str | None) -> None:
        line = slot.line()
        line.judge(slot.replica, failure, line.clock.seconds())

    def probed(self, replica: Replica) -> None:
        self.line.probe_reached(replica)

    def grant_free(self) -> bool:
        """Grant every free slot in rotation that a waiter may take, in the line's order; True
        if an out-of-turn grant may have moved someone back."""
        line = self.line
        now = line.clock.seconds()
        moved = False
        while line.waiting:
            start = line.dispatch.next(now)
            if start is None:
                break
            moved = moved or start.moved
            line.out_of_line(start.item)
            start.item.callback(self._started(start, now))
        line.count()
        return moved

    def fail_waiting(self, reason: Exception) -> None:
        line = self.line
        waiting, line.waiting = line.waiting, []
        for d in waiting:
            line.dispatch.leave(d)
        for d in waiting:
            d.errback(reason)

    def adopt(self, old: PositionedSemaphore) -> None:
        line = self.line
        now = old.clock.seconds()
        for d in list(old.dispatch.order(now)):
            adoptable, want = line.dispatch.want_here(old.dispatch.want_of(d))
            if not adoptable:
                continue
            client, rank, arrived, retry = old.dispatch.arrival(d)
            old.dispatch.leave(d)
            old.out_of_line(d)
            line.take_over(old, d)
            line.enqueue(d, Request(client, rank, want, retry, None), arrived)
            line.take_listener(old, d)
        line.tell_all(now)  # a waiter moved in may go ahead of others, in a plain FIFO too
        line.watch_aging(now)

    def serves(self, members: Sequence[Replica]) -> bool:
        return True  # a line in process has no key to keep

    def close(self) -> None:
        pass
