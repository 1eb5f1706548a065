"""Where a request runs: a slot on one of its model's replicas, and the retries after a
failure that is safe to retry. Every surface under /llm waits in the line through here."""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from twisted.internet.defer import CancelledError
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

from homelab_gateway.config import ModelConfig
from homelab_gateway.core.errors import GatewayError, internal_error, shutdown_error
from homelab_gateway.core.record import RequestRecord
from homelab_gateway.core.replicas import DOWN
from homelab_gateway.line.limiter import PositionListener, Replica, Slot
from homelab_gateway.line.pool import Pool, hold_slot
from homelab_gateway.quotas import Quotas

log = Logger()
CANCELLED = ("client_disconnected", "shutdown")  # outcomes InFlight sets before it cancels
# Shared: CPython has no empty-frozenset singleton, and `frozenset()` is 216 bytes that each
# waiting request would hold for its whole wait.
NO_REPLICAS: frozenset[Replica] = frozenset()

Relay = Callable[[Pool, dict[str, Any], Slot], Awaitable[None]]
"""One attempt on the replica `pool` holding `slot`, with the upstream body's fields for that
replica (its model name, the class it forwards): raises GatewayError while the client can still
be told with an HTTP error."""


def _in_rotation(pools: Iterable[Pool]) -> bool:
    return any(p.replica.circuit.state != DOWN for p in pools)


@dataclasses.dataclass(frozen=True, slots=True)
class Target:
    """Where a request for `model` may run: its replicas, and its session (the replica that
    served the session last has its prefix cached)."""

    model: ModelConfig
    pools: tuple[Pool, ...]
    session: str | None


@dataclasses.dataclass(frozen=True, slots=True)
class Retries:
    """How a surface's attempts go: the clients' `quotas`, checked before the first; at most
    `answered` retries of attempts an upstream answered, and `on_retry(failed upstream,
    fault, whether the retry may go elsewhere)`."""

    clock: IReactorTime
    answered: int = 2
    on_retry: Callable[[str, str, bool], None] = lambda upstream, fault, elsewhere: None
    quotas: Quotas | None = None


async def attempts(
    retries: Retries,
    record: RequestRecord,
    target: Target,
    on_position: PositionListener | None,
    relay: Relay,
) -> None:
    """Hold a slot on one of the target's replicas and `relay` the answer there; after a
    failure that is safe to retry (see `GatewayError.retry`: nothing reached the client and
    the upstream cannot have run the request), again on another replica, ahead of the line.

    An attempt that could not even connect costs nothing and is always retried, within the
    request's queue_timeout: that is how a request waits out a box that restarts. Those
    the upstream answered with a 502/503/504 are retried at most `retries.answered` times, and
    only on a replica not tried yet and in rotation.
    """
    if retries.quotas is not None:
        await retries.quotas.check(record)
    clock = retries.clock
    avoid: frozenset[Replica] = NO_REPLICAS  # every replica tried: tried last, if at all
    pools = target.pools  # less those that refused it (502/503/504): never again
    refusal: GatewayError | None = None  # the last such refusal
    deadline: float | None = None
    started = clock.seconds()
    answered = 0  # retried attempts that an upstream answered
    while True:
        slot, pool = await hold_slot(
            pools,
            clock,
            record,
            on_position,
            session=target.session,
            avoid=avoid,
            deadline=deadline,
        )
        try:  # from here on, whatever happens gives the slot back
            if retries.quotas is not None:
                await retries.quotas.admit(record, target.model.max_tokens)
            record.upstream = pool.upstream.name
            fields = {
                "model": target.model.model_on(pool.upstream.name),
                **pool.upstream_fields(record),
            }
            await relay(pool, fields, slot)
            return
        except GatewayError as e:
            if record.outcome in CANCELLED:
                # The cancel arrived while connecting, and Twisted reported it as the
                # connect failure it caused (a DNS lookup that failed): no fault of the
                # replica's, and nobody left to retry for.
                raise CancelledError() from None
            if e.fault is not None:
                slot.failed(e.message)
            fault = e.fault or ""
            if not e.retry:
                raise
            if fault == "connect" and refusal is not None and not _in_rotation(pools):
                # A replica refused it and the others are down: its refusal is the
                # answer, rather than a wait for boxes that may not come back soon.
                raise refusal from None
            if fault != "connect":
                refusal = e
                pools = tuple(p for p in pools if p.replica is not slot.replica)
                untried = [p for p in pools if p.replica not in avoid]
                if answered >= retries.answered or not _in_rotation(untried):
                    raise  # an answered refusal is only worth sending to another box
                answered += 1
        finally:
            slot.release()
        avoid = avoid | {slot.replica}
        retries.on_retry(pool.upstream.name, fault, any(p.replica not in avoid for p in pools))
        if deadline is None:
            deadline = started + max(p.queue_timeout for p in target.pools)


def answerable(e: Exception, record: RequestRecord) -> GatewayError:
    """What a request's client hears of `e`, its handler's failure: a shutdown's cut, the
    GatewayError itself, or the gateway's own 500 for an exception nobody expected, after one
    traceback in the log (what the request held was given back on the way here). A cancel that
    is the client leaving is raised again: nobody is left to answer. What it answers holds no
    traceback: nothing of the request outlives its answer."""
    if isinstance(e, CancelledError):
        if record.outcome != "shutdown":
            raise e
        return shutdown_error()
    if isinstance(e, GatewayError):
        record.outcome = record.outcome or e.outcome
        # The handler keeps the error past its `except`, in a frame its traceback holds: a
        # cycle that, through the traceback's frames and the error it replaced (`__context__`),
        # would keep the request's raw and parsed body until a full collection.
        e.__traceback__ = e.__context__ = e.__cause__ = None
        return e
    log.failure("Unhandled error answering {request_id}", request_id=record.request_id)
    error = internal_error()
    record.outcome = error.outcome
    return error
