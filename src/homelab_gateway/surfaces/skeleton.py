"""The flow every surface under /llm runs, written once: read and check the body, resolve the
model, wait in the line with retries (`attempts`), open the upstream, pour the answer, fill the
request record; an error before the first byte is an HTTP answer in the surface's shape, after
it the surface's own error event.

A surface (`Surface`) holds only what differs: how it maps its request (`map`), how it answers
whole (`whole`), how it writes its stream (`event_stream`, `pour`), its error event once the
stream began (`late_error`; before that, the HTTP error in its row's shape). Each request is
one coroutine run by `InFlight`, cancelled when the client disconnects; the cancel lands on
whatever it awaits (its place in the line, the upstream's headers, its body) and every
resource is given back in a `finally`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from twisted.internet.defer import CancelledError
from twisted.internet.interfaces import IReactorTime
from twisted.web.http_headers import Headers
from twisted.web.iweb import IRequest, IResponse

from homelab_gateway.config import ModelConfig
from homelab_gateway.core.errors import (
    RETRIED_STATUSES,
    ContextOverflow,
    GatewayError,
    upstream_http_error,
)
from homelab_gateway.core.fields import InvalidRequest
from homelab_gateway.core.mapping import PackedRequest, find_model, request_model
from homelab_gateway.core.record import RequestRecord
from homelab_gateway.core.replicas import session_key
from homelab_gateway.core.surfaces import SurfaceRow
from homelab_gateway.core.text import finite_float, refuse_constant
from homelab_gateway.line.limiter import PositionListener, Slot
from homelab_gateway.line.pool import Pool
from homelab_gateway.line.residency import load_wait, waiting_state
from homelab_gateway.surfaces.attempts import Retries, Target, answerable, attempts
from homelab_gateway.surfaces.stream import EventStream
from homelab_gateway.web.respond import send_error

MODEL_ECHO = 200
"""Characters of an unknown model's name a 404 repeats: enough to spot a typo, never a
client's megabyte."""


@dataclass(frozen=True, slots=True)
class SurfaceSettings:
    """What every surface reads: the models and their replicas, the clock, the stream's
    keep-alive and write stall, the upstream's own window, and how attempts go."""

    models: Mapping[str, ModelConfig]
    pools: Mapping[str, Pool]
    clock: IReactorTime
    ping_interval: float
    write_stall_timeout: float
    retries: Retries
    upstream_window: Callable[[str, str], int | None] = lambda upstream, model: None

    def context_window(self, model: ModelConfig) -> int | None:
        """The model's window: what its upstream's /models says (vLLM), else the config's."""
        window = self.upstream_window(model.upstream, model.model_on(model.upstream))
        return window if window is not None else model.context_window


def read_body(request: IRequest) -> Any:
    """The request's JSON body; the raw body is let go once read (from 100 KB twisted.web keeps
    it in a temporary file, a descriptor per waiter). The channel has already bounded its
    size."""
    raw = request.content.read()
    request.content.close()
    return json.loads(raw, parse_constant=refuse_constant, parse_float=finite_float)


class Surface:
    """One surface of the table (`row`); a subclass fills in what differs from the flow."""

    session_header = b"x-session-id"
    """A header naming the client's session, ahead of what the body says (`map`)."""

    def __init__(self, settings: SurfaceSettings, row: SurfaceRow) -> None:
        self.settings = settings
        self.row = row

    # What a surface fills in.

    def map(self, body: Any, model: ModelConfig, pools: tuple[Pool, ...]) -> tuple[Any, str | None]:
        """The request as it waits (its parsed body let go) and the session its body names;
        raises InvalidRequest naming the field."""
        raise NotImplementedError

    def packed(self, mapped: Any) -> PackedRequest:
        """The upstream request of `mapped`."""
        raise NotImplementedError

    def not_served(self, name: str, known: str) -> GatewayError:
        """The 404 for a model not served here (`name` already bounded), in the surface's
        words."""
        if self.row.shape == "openai":
            return GatewayError(
                404,
                f"The model `{name}` does not exist here (models: {known})",
                param="model",
                code="model_not_found",
            )
        return GatewayError(404, f"model: {name!r} is not served here (models: {known})")

    async def whole(
        self, request: IRequest, record: RequestRecord, target: Target, mapped: Any
    ) -> bytes | None:
        """The whole answer: a body to send, or None once it was written."""
        raise NotImplementedError

    def event_stream(self, request: IRequest, mapped: Any) -> EventStream:
        """The stream the answer is written to: its queue frame, opening event, keep-alive."""
        raise NotImplementedError

    def on_position(self, stream: EventStream, mapped: Any) -> PositionListener:
        """What a waiting stream is told of its place in the line."""
        return stream.queue_position

    async def pour(
        self,
        request: IRequest,
        record: RequestRecord,
        pool: Pool,
        mapped: Any,
        fields: dict[str, Any],
        slot: Slot,
        stream: EventStream,
    ) -> None:
        """One attempt on `pool`, its answer written into `stream` as it arrives."""
        raise NotImplementedError

    def late_error(self, stream: EventStream, mapped: Any, error: GatewayError) -> None:
        """`error` once the stream has begun: too late for an HTTP error."""
        raise NotImplementedError

    async def overflow_error(
        self,
        pool: Pool,
        record: RequestRecord,
        packed: PackedRequest,
        fields: dict[str, Any],
        overflow: ContextOverflow,
        body: bytes,
    ) -> GatewayError:
        """The upstream's "the prompt does not fit the window" (`body`), in the surface's words."""
        raise NotImplementedError

    # The flow.

    def resolve(self, request: IRequest, record: RequestRecord) -> tuple[Target, Any]:
        """The request, validated and mapped, as it waits; its parsed body let go. The session
        is kept as its `session_key`: a client picks its size."""
        models = self.settings.models
        try:
            body = read_body(request)
            name = request_model(body)
            record.model = name
            model = find_model(models, name)
            if model is None:
                raise self.not_served(name[:MODEL_ECHO], ", ".join(sorted(models)))
            record.served_model = model.name  # a pattern, never the client's string: bounded
            record.upstream = model.upstream
            pools = tuple(self.settings.pools[name] for name in model.replicas)
            mapped, session = self.map(body, model, pools)
        except RecursionError:
            raise GatewayError(400, "request body is nested too deeply") from None
        except InvalidRequest as e:
            raise GatewayError(400, str(e), param=e.param) from None
        except ValueError as e:
            raise GatewayError(400, f"request body is not valid JSON: {e}") from None
        packed = self.packed(mapped)
        record.stream = packed.stream
        record.input_tokens = packed.estimated_input_tokens
        session = session_key(request.getHeader(self.session_header) or session)
        return Target(model, pools, session), mapped

    async def answer(self, request: IRequest, record: RequestRecord) -> bytes | None:
        """The answer to one request: a body to send, or None once it was written.

        A stream is handled here rather than in a coroutine of its own: every waiting stream
        would hold that coroutine's frame (~0.3 KB) for its whole wait."""
        if request.method != b"POST":
            request.setHeader(b"allow", b"POST")
            return send_error(request, GatewayError(405, "use POST"), shape=self.row.shape)
        stream: EventStream | None = None
        mapped: Any = None
        try:
            try:
                target, mapped = self.resolve(request, record)
                # Its headers are read (the access checks, the session) and the answer needs
                # none of them: a request may wait minutes in the line, ~1 KB of headers each.
                request.requestHeaders = Headers()
                if not record.stream:
                    return await self.whole(request, record, target, mapped)
                stream = self.event_stream(request, mapped)
                stream.estimator = target.pools[0].line.estimate
                if any(pool.resident is not None for pool in target.pools):
                    on_demand(stream, target.pools, self.settings.clock)
                await attempts(
                    self.settings.retries,
                    record,
                    target,
                    self.on_position(stream, mapped),
                    lambda pool, fields, slot: self.pour(
                        request, record, pool, mapped, fields, slot, stream
                    ),
                )
                return None
            except Exception as e:
                error = answerable(e, record)
            if stream is not None and stream.started:  # too late for an HTTP error
                self.late_error(stream, mapped, error)
                return None
            if request.startedWriting:  # a whole answer cut short: only a cut says so
                request.channel.transport.abortConnection()
                return None
            return send_error(request, error, shape=self.row.shape)
        finally:
            if stream is not None:
                stream.close()

    async def open_upstream(
        self,
        pool: Pool,
        record: RequestRecord,
        slot: Slot,
        path: str,
        packed: PackedRequest,
        fields: dict[str, Any],
        *,
        whole: bool = False,
    ) -> IResponse:
        """Send the upstream request (`packed` with this attempt's `fields`) to `path`; its
        response once it answered 200, else the error. Tells `slot` whether the replica
        answered (any status but 502, 503 and 504). No frame here keeps the body it sends: the
        frames of an answer that ended with an exception live on in a cycle until the
        collector comes, and a long conversation's body is megabytes.

        A `whole` answer's headers come only once it is generated: it may take the upstream's
        idle_timeout, as a silence in a stream may."""
        upstream = pool.upstream
        headers = {b"content-type": [b"application/json"]}
        within = None
        if whole:
            within = max(upstream.connect_timeout, upstream.idle_timeout)
        else:
            headers[b"accept"] = [b"text/event-stream"]
        try:
            response = await upstream.open(
                "POST", upstream.url + path, headers, packed.body(**fields), within
            )
        except CancelledError:
            record.upstream_cancelled = True
            raise
        except GatewayError as e:
            if within is None or e.fault != "timeout":
                raise
            # It took the request and is generating: no fault of the replica's.
            raise GatewayError(
                504,
                f"{e.message}: a whole answer comes only once it is generated; stream it, or "
                "raise the upstream's idle_timeout",
            ) from None
        if response.code not in RETRIED_STATUSES:
            slot.succeeded()  # it answered, even if with the request's own error
        if response.code == 200:
            return response
        body = await upstream.read_limited(response)
        overflow = pool.kind.overflow(body)
        if overflow is not None:
            raise await self.overflow_error(pool, record, packed, fields, overflow, body)
        retry_after = response.headers.getRawHeaders(b"retry-after", [None])[0]
        raise upstream_http_error(
            response.code, body, retry_after.decode() if retry_after else None
        )


def on_demand(stream: EventStream, pools: Sequence[Pool], clock: IReactorTime) -> None:
    """A waiting stream for a model loaded on demand: its frames say the model's state while it
    is not loaded, and their estimate adds the load."""
    line_estimate = stream.estimator

    def estimate(position: int) -> float | None:
        wait = line_estimate(position) if line_estimate is not None else None
        if waiting_state(pools) is None:
            return wait
        load = load_wait(pools, clock.seconds())
        if load is None:
            return wait
        return load + (wait or 0.0)

    stream.estimator = estimate
    stream.waiting_state = lambda: waiting_state(pools)
