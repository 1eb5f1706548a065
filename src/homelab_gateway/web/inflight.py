"""Every request being handled, so a client leaving cancels its work and shutdown can drain.

Each handler runs as one coroutine under `InFlight.run`: a client disconnect cancels it (the
cancel lands on whatever it awaits: its place in the queue, the upstream's headers or body),
its `RequestRecord` is finished exactly once whatever the ending, and `drain` can wait for all
of them, then cancel the stragglers the same way. A cancelled handler tells the two apart by
the record's outcome: for "shutdown" the client is still there and gets an error answer.

A request counts as in flight until twisted.web has finished it (`notifyFinish`), not until
its handler returns: Klein (or, for `/llm/v1/messages`, the flight itself) writes a returned
body after the handler's Deferred fires, so a drain that ended with the handler would let the
process exit before the answer was written.
"""

from __future__ import annotations

from collections.abc import Coroutine
from contextlib import suppress
from typing import Any

from twisted.internet.defer import CancelledError, Deferred, ensureDeferred, succeed
from twisted.internet.defer import TimeoutError as DeferredTimeout
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.iweb import IRequest

from homelab_gateway.core.errors import internal_error, shutdown_error
from homelab_gateway.core.record import RequestRecord
from homelab_gateway.telemetry import Telemetry
from homelab_gateway.web.respond import Shape, send_error

log = Logger()


class InFlight:
    def __init__(self, clock: IReactorTime, telemetry: Telemetry) -> None:
        self.clock = clock
        self.telemetry = telemetry
        self.draining = False
        self._active: dict[IRequest, _Flight] = {}
        self._idle: list[Deferred[None]] = []
        self._grace: Deferred[None] | None = None

    def __len__(self) -> int:
        return len(self._active)

    def run(
        self,
        request: IRequest,
        record: RequestRecord,
        work: Coroutine[Any, Any, Any],
        *,
        shape: Shape = "anthropic",
        respond: bool = False,
    ) -> Deferred[Any]:
        """Drive `work` for `request`; a shutdown that cuts a handler before it answered gets
        the 503 in the surface's `shape`, whatever the handler did, and
        an exception no handler expected gets a 500 in that shape (`_Flight.answer_failure`).

        With `respond`, the flight also writes what the handler returns and finishes the
        request, as Klein does with a route's Deferred (see `web.AnsweredByItsFlight`); without
        it, the caller (Klein) does."""
        flight = _Flight(self, request, record, ensureDeferred(work), shape)
        self._active[request] = flight
        request.notifyFinish().addBoth(flight.over)
        if respond:
            return flight.d.addCallbacks(flight.write, flight.failed)
        return flight.d.addErrback(flight.answer_failure)

    def _done(self, request: IRequest) -> None:
        del self._active[request]
        if not self._active:
            idle, self._idle = self._idle, []
            for waiter in idle:
                waiter.callback(None)

    def idle(self) -> Deferred[None]:
        """Fires once no request is in flight (every answer handed to its transport)."""
        if not self._active:
            return succeed(None)
        d: Deferred[None] = Deferred(self._idle.remove)
        self._idle.append(d)
        return d

    async def drain(self, grace: float) -> None:
        """Let requests finish for `grace` seconds (or until `cut_short`), then cancel the rest
        as a disconnect would, which cancels their upstream requests and frees their slots."""
        self.draining = True
        if self._active:
            self._grace = self.idle().addTimeout(grace, self.clock)
            with suppress(DeferredTimeout, CancelledError):
                await self._grace
            self._grace = None
        for flight in list(self._active.values()):
            if not flight.d.called:
                flight.record.outcome = "shutdown"
                flight.d.cancel()
        await self.idle()

    def cut_short(self) -> bool:
        """End the grace period now (a second SIGTERM); False if no grace is running."""
        if self._grace is None:
            return False
        self._grace.cancel()
        return True


class _Flight:
    """One request in flight: what its two callbacks need, in one small object rather than
    closures and a second `notifyFinish` (thousands of them live while a queue is long)."""

    __slots__ = ("d", "ended", "inflight", "record", "request", "shape")

    def __init__(
        self,
        inflight: InFlight,
        request: IRequest,
        record: RequestRecord,
        d: Deferred[Any],
        shape: Shape,
    ) -> None:
        self.inflight = inflight
        self.request = request
        self.record = record
        self.d = d
        self.shape = shape
        self.ended = False  # twisted.web finished the request, or the client left

    def over(self, result: object) -> None:
        """twisted.web finished the request: after Klein wrote a returned body, or the client
        left. Then the status is final, and the answer's last byte is with the transport."""
        self.ended = True
        record, request = self.record, self.request
        if isinstance(result, Failure):  # the client left
            if record.outcome is None:
                record.outcome = "client_disconnected"
            self.d.cancel()  # unwinds the handler now, so the record is complete below
        record.status = request.code if request.startedWriting else None
        self.inflight.telemetry.finish(record)
        self.inflight._done(request)

    def answer_failure(self, failure: Failure) -> Any:
        """The answer to a handler's failure while its client is still there: a shutdown's cut
        its 503, anything else (an exception no handler expected) its 500, after one traceback
        in the log. Once the answer has begun, only a cut connection can tell the client that
        the body is incomplete."""
        if self.ended:
            return failure  # the client left: nobody to answer
        if failure.check(CancelledError) and self.record.outcome == "shutdown":
            error = shutdown_error()
        else:
            log.failure(
                "Unhandled error answering {request_id}", failure, request_id=self.record.request_id
            )
            self.record.outcome = "internal_error"
            error = internal_error()
        if self.request.startedWriting:
            self.request.channel.transport.abortConnection()
            return None
        return send_error(self.request, error, shape=self.shape)

    # What Klein's `KleinResource.render` does with a route's Deferred, for a flight that
    # answers its request itself (`respond`): one callback pair on the handler's Deferred
    # where Klein's chain, kept while the request waits, would have four and five closures.

    def write(self, body: bytes | str | None) -> None:
        """Write the handler's answer, if any, and finish the request unless twisted.web
        already has (the handler finished it, or the client left)."""
        request = self.request
        try:
            if isinstance(body, str):
                body = body.encode("utf-8")
            if isinstance(body, bytes):
                request.write(body)
            if not self.ended:
                request.finish()
        except Exception:
            log.failure(
                "Unhandled error writing the answer to {request_id}",
                request_id=self.record.request_id,
            )

    def failed(self, failure: Failure) -> None:
        """A failure of a request still open is answered (`answer_failure`); once the request
        is over, only an unexpected failure is worth a log line (a client that left cancels its
        handler)."""
        if not self.ended:
            self.write(self.answer_failure(failure))
        elif not failure.check(CancelledError):
            log.failure(
                "Unhandled error after {request_id} ended",
                failure,
                request_id=self.record.request_id,
            )
