"""Every request being handled, so a client leaving cancels its work and shutdown can drain.

Each handler runs as one coroutine under `InFlight.run`: a client disconnect cancels it (the
cancel lands on whatever it awaits: its place in the queue, the upstream's headers or body),
its `RequestRecord` is finished exactly once whatever the ending, and `drain` can wait for all
of them, then cancel the stragglers the same way. A cancelled handler tells the two apart by
the record's outcome: for "shutdown" the client is still there and gets an error answer.
"""

from __future__ import annotations

from collections.abc import Coroutine
from contextlib import suppress
from typing import Any

from twisted.internet.defer import Deferred, ensureDeferred, succeed
from twisted.internet.defer import TimeoutError as DeferredTimeout
from twisted.internet.interfaces import IReactorTime
from twisted.web.iweb import IRequest

from homelab_gateway.telemetry import RequestRecord, Telemetry


class InFlight:
    def __init__(self, clock: IReactorTime, telemetry: Telemetry) -> None:
        self.clock = clock
        self.telemetry = telemetry
        self.draining = False
        self._active: dict[IRequest, tuple[RequestRecord, Deferred[Any]]] = {}
        self._idle: list[Deferred[None]] = []

    def __len__(self) -> int:
        return len(self._active)

    def run(
        self, request: IRequest, record: RequestRecord, work: Coroutine[Any, Any, Any]
    ) -> Deferred[Any]:
        d = ensureDeferred(work)
        self._active[request] = (record, d)

        def client_left(_: object) -> None:
            if record.outcome is None:
                record.outcome = "client_disconnected"
            d.cancel()  # unwinds the handler now, so the record is complete below

        def request_over(_: object) -> None:
            # After Klein wrote a returned body (or the client left): the status is final.
            record.status = request.code if request.startedWriting else None
            self.telemetry.finish(record)

        def work_done(result: object) -> object:
            del self._active[request]
            if not self._active:
                idle, self._idle = self._idle, []
                for waiter in idle:
                    waiter.callback(None)
            return result

        request.notifyFinish().addErrback(client_left)
        request.notifyFinish().addBoth(request_over)
        return d.addBoth(work_done)

    def idle(self) -> Deferred[None]:
        if not self._active:
            return succeed(None)
        d: Deferred[None] = Deferred(self._idle.remove)
        self._idle.append(d)
        return d

    async def drain(self, grace: float) -> None:
        """Let requests finish for `grace` seconds, then cancel the rest as a disconnect would,
        which cancels their upstream requests and frees their slots."""
        self.draining = True
        if self._active:
            with suppress(DeferredTimeout):
                await self.idle().addTimeout(grace, self.clock)
        for record, d in list(self._active.values()):
            record.outcome = "shutdown"
            d.cancel()
        await self.idle()
