"""One upstream with its slots: what a model or a route sends its requests to."""

from __future__ import annotations

from dataclasses import dataclass, field

from twisted.internet.defer import DeferredSemaphore
from twisted.internet.defer import TimeoutError as DeferredTimeout
from twisted.internet.interfaces import IReactorTime

from homelab_gateway.errors import GatewayError
from homelab_gateway.limiter import PositionedSemaphore, PositionListener, QueueFull
from homelab_gateway.telemetry import RequestRecord
from homelab_gateway.upstream import Upstream

QUEUE_FULL_RETRY_AFTER = 5
TOKENIZE_CONCURRENCY = 4
"""At most this many `/tokenize` requests in flight per upstream (count_tokens). Tokenizing
runs in vLLM's API server, not its engine, so it takes no generation slot (a count must not
wait minutes behind generations); but it is still bounded, so a burst of count_tokens cannot
open a connection each."""


@dataclass
class Pool:
    upstream: Upstream
    slots: PositionedSemaphore
    queue_timeout: float
    continuous_usage_stats: bool = True
    tokenizer: DeferredSemaphore = field(
        default_factory=lambda: DeferredSemaphore(TOKENIZE_CONCURRENCY)
    )

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

    async def hold_tokenizer(self, clock: IReactorTime) -> DeferredSemaphore | None:
        """One of the upstream's TOKENIZE_CONCURRENCY places (FIFO), or None after waiting
        `connect_timeout`: the caller then answers with its estimate. The caller releases."""
        d = self.tokenizer.acquire()
        d.addTimeout(self.upstream.connect_timeout, clock)
        try:
            return await d
        except DeferredTimeout:
            return None
