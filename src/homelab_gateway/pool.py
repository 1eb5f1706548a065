"""One upstream with its slots: what a model or a route sends its requests to."""

from __future__ import annotations

from dataclasses import dataclass, field

from twisted.internet.defer import DeferredSemaphore
from twisted.internet.defer import TimeoutError as DeferredTimeout
from twisted.internet.interfaces import IReactorTime

from homelab_gateway.errors import GatewayError
from homelab_gateway.limiter import (
    ClientQueueFull,
    PositionedSemaphore,
    PositionListener,
    QueueFull,
    Slot,
)
from homelab_gateway.line import CLASS_RANK, CLASSES, DEFAULT_CLASS
from homelab_gateway.telemetry import RequestRecord
from homelab_gateway.upstream import Upstream

QUEUE_FULL_RETRY_AFTER = 5
# vLLM's `priority` request field: lower is served earlier, 0 is its default (and what requests
# that bypass the gateway get), so `normal` maps to 0.
VLLM_PRIORITY = {"interactive": -1, "normal": 0, "batch": 1}
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
    forward_priority: bool = False
    tokenizer: DeferredSemaphore = field(
        default_factory=lambda: DeferredSemaphore(TOKENIZE_CONCURRENCY)
    )

    async def hold_slot(
        self,
        clock: IReactorTime,
        record: RequestRecord,
        on_position: PositionListener | None = None,
    ) -> Slot:
        """Wait for a slot (in the line's order, bounded by queue_limit, the client's
        max_waiting and queue_timeout); the caller releases.

        The record says who asks (`client`) and at which class (`priority`); the class the
        request was served as (aging included) goes back into it. Cancelling the awaiting
        Deferred removes the waiter from the line. The wait goes into the record either way.
        """
        started = clock.seconds()
        try:
            d = self.slots.acquire_in_line(
                on_position,
                client=record.client,
                rank=CLASS_RANK.get(record.priority, CLASS_RANK[DEFAULT_CLASS]),
            )
        except ClientQueueFull as e:
            raise GatewayError(
                529,
                f"upstream {self.upstream.name} is busy: client {e.client} already has "
                f"{e.limit} requests waiting",
                retry_after=QUEUE_FULL_RETRY_AFTER,
                outcome="rejected_client_queue_full",
            ) from None
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
            slot = await d
        except DeferredTimeout:
            raise GatewayError(
                529,
                f"waited {self.queue_timeout:g}s for a slot on upstream {self.upstream.name}",
                retry_after=QUEUE_FULL_RETRY_AFTER,
                outcome="queue_timeout",
            ) from None
        finally:
            record.queue_wait = clock.seconds() - started
        record.served_as = CLASSES[slot.grant.rank]

        def held(seconds: float) -> None:
            record.slot_seconds = seconds

        slot.on_release = held
        return slot

    def upstream_fields(self, record: RequestRecord) -> dict[str, int]:
        """Fields the upstream request carries for the line: vLLM's `priority` (with
        `forward_priority`), the class the request was served as, so the engine's own scheduler
        keeps the gateway's order."""
        if not self.forward_priority or record.served_as is None:
            return {}
        return {"priority": VLLM_PRIORITY[record.served_as]}

    async def hold_tokenizer(self, clock: IReactorTime) -> DeferredSemaphore | None:
        """One of the upstream's TOKENIZE_CONCURRENCY places (FIFO), or None after waiting
        `connect_timeout`: the caller then answers with its estimate. The caller releases."""
        d = self.tokenizer.acquire()
        d.addTimeout(self.upstream.connect_timeout, clock)
        try:
            return await d
        except DeferredTimeout:
            return None
