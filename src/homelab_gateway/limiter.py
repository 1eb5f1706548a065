"""Per-upstream slots: a DeferredSemaphore whose waiters learn their place in line.

Renumbering every waiter on every release costs a frame per waiter per release, quadratic in
the queue length. Instead a change only schedules one renumbering pass `report_interval`
later, which tells each waiter whose position moved its new one. A reported position can lag
the truth by at most that interval and is never lower than the truth, because positions only
ever fall while a waiter waits. The waiter that gets a slot is told position 1 first if it had
not been, so a client always sees its position reach 1 before its answer starts.
"""

from __future__ import annotations

from collections.abc import Callable

from twisted.internet.defer import Deferred, DeferredSemaphore
from twisted.internet.interfaces import IDelayedCall, IReactorTime

PositionListener = Callable[[int], None]


class QueueFull(Exception):
    """The queue already holds `queue_limit` waiters."""


class PositionedSemaphore(DeferredSemaphore):
    """FIFO slots with position reports. Relies on, and its tests pin, the base class's
    `waiting` list (head is next), its `_cancelAcquire` canceller, and `release` handing the
    slot to the head waiter synchronously."""

    def __init__(
        self,
        tokens: int,
        clock: IReactorTime,
        *,
        queue_limit: int | None = None,
        report_interval: float = 0.4,
    ) -> None:
        super().__init__(tokens)
        self._clock = clock
        self.queue_limit = queue_limit
        self.report_interval = report_interval
        self._listeners: dict[Deferred[DeferredSemaphore], PositionListener] = {}
        self._reported: dict[Deferred[DeferredSemaphore], int] = {}
        self._pass: IDelayedCall | None = None
        self.reports = 0  # position reports made: how many frames the coalescing saves
        self._surplus = 0  # slots held beyond `limit` since a resize made it smaller

    @property
    def in_use(self) -> int:
        return self.limit - self.tokens + self._surplus

    def acquire_in_line(
        self, on_position: PositionListener | None = None
    ) -> Deferred[DeferredSemaphore]:
        """Like `acquire`, telling `on_position` the waiter's 1-based place while it waits.

        Raises QueueFull, without queueing, when no slot is free and the line is full.
        """
        if (
            not self.tokens
            and self.queue_limit is not None
            and len(self.waiting) >= self.queue_limit
        ):
            raise QueueFull()
        d = self.acquire()
        if d.called or on_position is None:
            return d
        self._listeners[d] = on_position
        self._tell(d, len(self.waiting))
        d.addBoth(self._leave_line, d)
        return d

    def release(self) -> None:
        if self._surplus:
            self._surplus -= 1  # a slot held over a smaller limit: it is not handed on
        else:
            super().release()
        self._changed()

    def resize(self, limit: int) -> None:
        """Change the number of slots for new grants (a config reload). Growing hands the new
        slots to the head of the line now; shrinking never revokes a held slot: releases are
        kept back until no more than `limit` are held."""
        held = self.in_use
        self.limit = limit
        self._surplus = max(0, held - limit)
        self.tokens = max(0, limit - held)
        while self.tokens and self.waiting:
            self.tokens -= 1
            self.waiting.pop(0).callback(self)
        self._changed()

    def _cancelAcquire(self, d: Deferred[DeferredSemaphore]) -> None:
        super()._cancelAcquire(d)
        self._changed()

    def _leave_line(self, result: object, d: Deferred[DeferredSemaphore]) -> object:
        listener = self._listeners.pop(d)
        last = self._reported.pop(d)
        if last != 1 and isinstance(result, DeferredSemaphore):
            listener(1)  # it was truly first in line when release handed it the slot
            self.reports += 1
        return result

    def _tell(self, d: Deferred[DeferredSemaphore], position: int) -> None:
        self._reported[d] = position
        self.reports += 1
        self._listeners[d](position)

    def _changed(self) -> None:
        if self._pass is None and self._listeners:
            self._pass = self._clock.callLater(self.report_interval, self._renumber)

    def _renumber(self) -> None:
        self._pass = None
        for position, d in enumerate(list(self.waiting), start=1):
            if d in self._listeners and self._reported[d] != position:
                self._tell(d, position)

    def fail_waiting(self, reason: Exception) -> None:
        """Empty the line, failing every waiter with `reason` (shutdown)."""
        waiting, self.waiting = self.waiting, []
        for d in waiting:
            d.errback(reason)

    def close(self) -> None:
        """Stop the pending renumbering pass (service shutdown, test cleanup)."""
        if self._pass is not None and self._pass.active():
            self._pass.cancel()
        self._pass = None
