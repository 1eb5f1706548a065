"""Per-upstream slots: a DeferredSemaphore whose waiters learn their place in line.

Who gets a freed slot is `line.Line`'s decision (classes, aging, fair share, FIFO within a
client); this module is the Twisted layer around it: Deferreds, the clock, position reports.

The guarantee: a reported position is never lower than the truth, at any moment, and a fall is
told within `report_interval` (0.4 s).

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
walks nothing extra. A newcomer is told its exact position at once,
and the waiter that gets a slot is told position 1 first if it had not been, so a client always
sees its position reach 1 before its answer starts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

from twisted.internet.defer import Deferred, DeferredSemaphore, succeed
from twisted.internet.interfaces import IDelayedCall, IReactorTime

from homelab_gateway.line import CLASS_RANK, DEFAULT_CLASS, Grant, Line

PositionListener = Callable[[int], None]
ANONYMOUS = ""  # the client of a plain `acquire`
NORMAL = CLASS_RANK[DEFAULT_CLASS]


class QueueFull(Exception):
    """The queue already holds `queue_limit` waiters."""


class ClientQueueFull(QueueFull):
    """This client already has `max_waiting` waiters; others may still queue."""

    def __init__(self, client: str, limit: int) -> None:
        super().__init__(client, limit)
        self.client = client
        self.limit = limit


@dataclass
class Slot:
    """One granted slot. `release` gives it back once and settles its client's fair share with
    the time it was really held."""

    semaphore: PositionedSemaphore
    grant: Grant
    granted_at: float
    on_release: Callable[[float], None] | None = None  # told the seconds the slot was held
    released: bool = False

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        held = self.semaphore.clock.seconds() - self.granted_at
        reordered = self.semaphore.line.settle(self.grant, held)
        if self.on_release is not None:
            self.on_release(held)
        self.semaphore._give_back(reordered)


class PositionedSemaphore(DeferredSemaphore):
    """Slots with an ordered line and position reports. Keeps the base class's `limit`,
    `tokens` (free slots) and `waiting` (the waiters' Deferreds, in arrival order) meaningful for
    readers, and `acquire`/`release` working as DeferredSemaphore's."""

    def __init__(
        self,
        tokens: int,
        clock: IReactorTime,
        *,
        queue_limit: int | None = None,
        report_interval: float = 0.4,
        aging: float | None = None,
        weights: Mapping[str, float] = {},
        max_waiting: Mapping[str, int] = {},
    ) -> None:
        super().__init__(tokens)
        self.clock = clock
        self.queue_limit = queue_limit
        self.report_interval = report_interval
        self.max_waiting = dict(max_waiting)
        self.line: Line[Deferred[Slot]] = Line(aging=aging, weights=weights)
        self._held = 0
        self._listeners: dict[Deferred[Slot], PositionListener] = {}
        self._reported: dict[Deferred[Slot], int] = {}
        self._pass: IDelayedCall | None = None
        self._aging: IDelayedCall | None = None
        self.reports = 0  # position reports made: how many frames the coalescing saves

    @property
    def in_use(self) -> int:
        return self._held

    def resize(self, limit: int) -> None:
        """Change the number of slots (config reload): more slots are granted at once to the
        waiters next in line; fewer take effect as held slots are released, never revoked."""
        self.limit = limit
        self.tokens = max(0, limit - self._held)
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
    ) -> Deferred[Slot]:
        """A slot for `client`'s request of class `rank`, telling `on_position` the waiter's
        1-based place while it waits.

        Raises QueueFull (ClientQueueFull for the client's own cap), without queueing, when no
        slot is free and the line (or the client's share of it) is full.
        """
        now = self.clock.seconds()
        if self.tokens:
            self.tokens -= 1
            self._held += 1
            return succeed(Slot(self, self.line.admit(client, rank, now), now))
        if self.queue_limit is not None and len(self.line) >= self.queue_limit:
            raise QueueFull()
        limit = self.max_waiting.get(client)
        if limit is not None and self.line.waiting_for(client) >= limit:
            raise ClientQueueFull(client, limit)
        d: Deferred[Slot] = Deferred(canceller=self._cancelAcquire)
        self.line.join(d, client, rank, now)
        self.waiting.append(d)
        if on_position is None and not self._listeners:
            return d
        if on_position is not None:
            self._listeners[d] = on_position
            d.addBoth(self._leave_line, d)
        if self.line.queues == 1:  # a plain FIFO: the newcomer is its tail
            if on_position is not None:
                self._tell(d, len(self.line))
        else:
            self._place(d, now)
        self._watch_aging(now)
        return d

    def _place(self, d: Deferred[Slot], now: float) -> None:
        """Tell a newcomer its place and, in the same walk, those it went ahead of their new
        one: nobody ahead of it moved."""
        places = enumerate(self.line.order(now), start=1)
        position = next(place for place, waiter in places if waiter is d)
        if d in self._listeners:
            self._tell(d, position)
        if position < len(self.line):
            self._raise(places)
            self._changed()  # its client's later waiters went back: others may have moved up

    def release(self) -> None:
        """Free one slot: the line's next waiter gets it at once (synchronously)."""
        self._give_back(reordered=False)

    def _give_back(self, reordered: bool) -> None:
        """`release`, after a `Line.settle` that may have `reordered` the line: then those
        moved back learn it now (a grant itself moves nobody back)."""
        assert self._held > 0, "release without a held slot"
        self._held -= 1
        self.tokens = max(0, self.limit - self._held)
        self._hand_over()
        if reordered:
            self._tell_rises(self.clock.seconds())
        self._changed()

    def _hand_over(self) -> None:
        now = self.clock.seconds()
        while self.tokens and len(self.line):
            popped = self.line.pop(now)
            assert popped is not None
            d, grant = popped
            self._remove_waiting(d)
            self.tokens -= 1
            self._held += 1
            d.callback(Slot(self, grant, now))

    def _remove_waiting(self, d: Deferred[Slot]) -> None:
        if self.waiting[0] is d:
            del self.waiting[0]
        else:
            self.waiting.remove(d)

    def _cancelAcquire(self, d: Deferred[Slot]) -> None:  # type: ignore[override]
        reordered = self.line.leave(d)
        self._remove_waiting(d)
        if reordered:
            self._tell_rises(self.clock.seconds())
        self._changed()

    def _leave_line(self, result: object, d: Deferred[Slot]) -> object:
        listener = self._listeners.pop(d)
        last = self._reported.pop(d)
        if last != 1 and isinstance(result, Slot):
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
        listeners, reported = self._listeners, self._reported
        for position, d in enumerate(self.line.order(self.clock.seconds()), start=1):
            if d in listeners and reported[d] != position:
                self._tell(d, position)

    def _tell_rises(self, now: float) -> None:
        """After an event that may have moved waiters back: tell those now."""
        if self._listeners and self.line.queues > 1:
            self._raise(enumerate(self.line.order(now), start=1))

    def _raise(self, places: Iterator[tuple[int, Deferred[Slot]]]) -> None:
        """Tell each listening waiter whose place is now higher than its last report; falls
        wait for the coalesced pass."""
        reported = self._reported
        for position, d in places:
            if reported.get(d, position) < position:
                self._tell(d, position)

    def _watch_aging(self, now: float) -> None:
        """Wake when the next waiter ages into a better class, if that can reorder."""
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

    def fail_waiting(self, reason: Exception) -> None:
        """Empty the line, failing every waiter with `reason` (shutdown)."""
        waiting, self.waiting = self.waiting, []
        for d in waiting:
            self.line.leave(d)
        for d in waiting:
            d.errback(reason)

    def close(self) -> None:
        """Stop the pending renumbering pass and aging timer (service shutdown, test cleanup)."""
        for call in (self._pass, self._aging):
            if call is not None and call.active():
                call.cancel()
        self._pass = self._aging = None
