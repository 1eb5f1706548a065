"""One upstream with its slots (a `Pool`), and holding a slot on one of a model's replicas."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from twisted.internet.defer import CancelledError, DeferredSemaphore
from twisted.internet.defer import TimeoutError as DeferredTimeout
from twisted.internet.interfaces import IReactorTime

from homelab_gateway.core.errors import GatewayError
from homelab_gateway.core.line import CLASS_RANK, CLASSES, DEFAULT_CLASS
from homelab_gateway.core.record import RequestRecord
from homelab_gateway.core.replicas import UP
from homelab_gateway.line.limiter import PositionedSemaphore, PositionListener, Replica, Slot
from homelab_gateway.line.refusals import ClientQueueFull, QueueFull, Unavailable
from homelab_gateway.upstream.client import Upstream
from homelab_gateway.upstream.kinds import KINDS, Kind

QUEUE_FULL_RETRY_AFTER = 5
TOKENIZE_CONCURRENCY = 4
"""At most this many tokenize requests in flight per upstream (`Kind.tokenize`: count_tokens,
an overflow's count). Tokenizing runs in vLLM's API server, not its engine, so it takes no
generation slot (a count must not wait minutes behind generations); but it is still bounded, so
a burst of count_tokens cannot open a connection each, and so are the counts waiting for a place
(`Pool.hold_tokenizer`)."""


class OnDemand(Protocol):
    """An upstream loaded on demand, as the rest of the gateway sees it (`line.residency`)."""

    @property
    def state(self) -> str:
        """`loaded`, `loading`, `unloading`, `unloaded` or `failed`."""
        ...

    @property
    def load_seconds(self) -> float | None:
        """How long its last load took, if it was ever loaded."""
        ...


@dataclass(eq=False)
class Pool:
    """One upstream: its client, its slots and health (`replica`), its kind of server, and its
    settings. Its line (`slots`) is shared with the upstreams it serves a model with."""

    upstream: Upstream
    replica: Replica
    queue_timeout: float
    kind: Kind = KINDS["vllm"]
    continuous_usage_stats: bool = True  # configured, and its kind takes it
    forward_priority: bool = False
    tokenizer: DeferredSemaphore = field(
        default_factory=lambda: DeferredSemaphore(TOKENIZE_CONCURRENCY)
    )
    counting: Counter[str] = field(default_factory=Counter)  # counts waiting, by client
    # Loaded on demand (`line.residency`): its server and state; None when always loaded.
    resident: OnDemand | None = None
    # While it cools down after failed starts: the answer to every request for it.
    refusal: GatewayError | None = None

    def __post_init__(self) -> None:
        self.replica.owner = self

    @property
    def line(self) -> PositionedSemaphore:
        """The line this upstream's slots are handed out in."""
        assert self.replica.line is not None
        return self.replica.line

    async def hold_slot(
        self,
        clock: IReactorTime,
        record: RequestRecord,
        on_position: PositionListener | None = None,
    ) -> Slot:
        """A slot on this upstream alone (a proxy route); see `hold_slot`."""
        slot, _ = await hold_slot((self,), clock, record, on_position)
        return slot

    def upstream_fields(self, record: RequestRecord) -> dict[str, int]:
        """Fields the upstream request carries for the line: the kind's `priority` (with
        `forward_priority`, which the config allows only where the kind has one) for the class
        the request was served as, so the engine's own scheduler keeps the gateway's order."""
        priority = self.kind.priority
        if not self.forward_priority or priority is None or record.served_as is None:
            return {}
        return {"priority": priority[record.served_as]}

    async def hold_tokenizer(self, clock: IReactorTime, client: str) -> DeferredSemaphore | None:
        """One of the upstream's TOKENIZE_CONCURRENCY places (FIFO) for `client`'s count, or
        None (the caller then answers with its estimate): at once when as many counts wait as
        the line lets requests wait (its queue_limit, the client's max_waiting), else after
        waiting `connect_timeout`. The caller releases."""
        tokenizer = self.tokenizer
        if not tokenizer.tokens:
            try:
                self.line.check_room(client, len(tokenizer.waiting), self.counting[client])
            except QueueFull:
                return None
        d = tokenizer.acquire()
        d.addTimeout(self.upstream.connect_timeout, clock)
        self.counting[client] += 1
        try:
            return await d
        except DeferredTimeout:
            return None
        finally:
            self.counting[client] -= 1
            if not self.counting[client]:
                del self.counting[client]


async def hold_slot(
    pools: Sequence[Pool],
    clock: IReactorTime,
    record: RequestRecord,
    on_position: PositionListener | None = None,
    *,
    session: str | None = None,
    avoid: frozenset[Replica] = frozenset(),
    deadline: float | None = None,
) -> tuple[Slot, Pool]:
    """Wait for a slot on one of `pools` (a model's replicas, which share one line), in the
    line's order, bounded by the line's queue_limit, the client's max_waiting and the
    replicas' longest queue_timeout (or `deadline`); the caller releases.

    The record says who asks (`client`) and at which class (`priority`); the class the request
    was served as (aging included) goes back into it. A retry passes the replicas it failed on
    (`avoid`) and the `deadline` of its first wait, and waits ahead of the line. Cancelling the
    awaiting Deferred removes the waiter from the line. The wait adds to the record's.
    """
    line = pools[0].line
    if all(p.refusal is not None for p in pools):
        raise pools[0].refusal  # type: ignore[misc]
    names = "/".join(p.upstream.name for p in pools)
    started = clock.seconds()
    timeout = max(p.queue_timeout for p in pools)
    if deadline is not None:
        timeout = max(0.0, deadline - started)
    try:
        d = line.acquire_in_line(
            on_position,
            client=record.client,
            rank=CLASS_RANK.get(record.priority, CLASS_RANK[DEFAULT_CLASS]),
            among=frozenset(p.replica for p in pools),
            avoid=avoid,
            session=session,
            first=deadline is not None,
        )
    except ClientQueueFull as e:
        raise GatewayError(
            529,
            f"upstream {names} is busy: client {e.client} already has {e.limit} requests waiting",
            retry_after=QUEUE_FULL_RETRY_AFTER,
            outcome="rejected_client_queue_full",
        ) from None
    except QueueFull:
        raise GatewayError(
            529,
            f"upstream {names} is busy: its queue is full ({line.queue_limit} waiting)",
            retry_after=QUEUE_FULL_RETRY_AFTER,
            outcome="rejected_queue_full",
        ) from None
    except Unavailable as e:
        raise _unavailable(names, e) from None
    # One timer that cancels the wait, not `Deferred.addTimeout`, which also adds three
    # closures and two callbacks to every waiter (~0.7 KB each while thousands wait); none at
    # all when the slot was free.
    timer = None if d.called else clock.callLater(timeout, d.cancel)
    try:
        slot = await d
    except Unavailable as e:
        raise _unavailable(names, e) from None
    except CancelledError:
        if timer is None or timer.active():
            raise  # not the timer: the request itself was cancelled
        message = f"waited {max(p.queue_timeout for p in pools):g}s for a slot on upstream {names}"
        errors = [p.replica.circuit.last_error for p in pools if p.replica.circuit.state != UP]
        if len(errors) == len(pools):
            message += f", out of rotation: {errors[-1]}"
        raise GatewayError(
            529, message, retry_after=QUEUE_FULL_RETRY_AFTER, outcome="queue_timeout"
        ) from None
    finally:
        if timer is not None and timer.active():
            timer.cancel()
        record.queue_wait = (record.queue_wait or 0.0) + clock.seconds() - started
    record.served_as = CLASSES[slot.grant.rank]

    def held(seconds: float) -> None:
        record.slot_seconds = seconds

    slot.on_release = held
    pool = slot.replica.owner  # one of `pools`, or one a reload gave the model since
    assert isinstance(pool, Pool)
    return slot, pool


def _unavailable(names: str, e: Unavailable) -> GatewayError:
    """Redis, which the gateways share the line through, is away: nobody may be granted a
    slot without risking the cap, so the request is refused as overloaded, to be retried."""
    return GatewayError(
        529,
        f"upstream {names}: {e}",
        retry_after=QUEUE_FULL_RETRY_AFTER,
        outcome="rejected_cluster_unavailable",
    )
