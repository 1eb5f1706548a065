"""One upstream with its slots: what a model or a route sends its requests to."""

from __future__ import annotations

from dataclasses import dataclass

from twisted.internet.defer import DeferredSemaphore
from twisted.internet.defer import TimeoutError as DeferredTimeout
from twisted.internet.interfaces import IReactorTime

from homelab_gateway.errors import GatewayError
from homelab_gateway.limiter import PositionedSemaphore, PositionListener, QueueFull
from homelab_gateway.telemetry import RequestRecord
from homelab_gateway.upstream import Upstream

QUEUE_FULL_RETRY_AFTER = 5


@dataclass
class Pool:
    upstream: Upstream
    slots: PositionedSemaphore
    queue_timeout: float
    continuous_usage_stats: bool = True

    async def hold_slot(
        self,
        clock: IReactorTime,
        record: RequestRecord,
        on_position: PositionListener | None = None,
    ) -> DeferredSemaphore:
        """Wait for a slot (FIFO, bounded by queue_limit and queue_timeout); the caller releases.

        Cancelling the awaiting Deferred removes the waiter from the line. The wait goes into
        the record either way.
        """
        started = clock.seconds()
        try:
            d = self.slots.acquire_in_line(on_position)
        except QueueFull:
            raise GatewayError(
                529,
                f"upstream {self.upstream.name} is busy: its queue is full "
                f"({self.slots.queue_limit} waiting)",
                retry_after=QUEUE_FULL_RETRY_AFTER,
                outcome="rejected_queue_full",
            ) from None
        d.addTimeout(self.queue_timeout, clock)
        try:
            return await d
        except DeferredTimeout:
            raise GatewayError(
                529,
                f"waited {self.queue_timeout:g}s for a slot on upstream {self.upstream.name}",
                retry_after=QUEUE_FULL_RETRY_AFTER,
                outcome="queue_timeout",
            ) from None
        finally:
            record.queue_wait = clock.seconds() - started
