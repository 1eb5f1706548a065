"""The Anthropic Messages surface under /llm: the Twisted wiring around the sans-IO core.

A request flows route -> slot (limiter) -> upstream (treq) -> SSE parser -> translator ->
`EventStream`, each upstream read translated and written as it arrives. Each request is one
coroutine driven by a Deferred that is cancelled when the client disconnects; the cancellation
lands on whatever it awaits (its place in the queue, the upstream's headers, the upstream's
body) and every resource is given back in a `finally`, so no exit path can keep a slot.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass
from typing import Any

from twisted.internet.defer import Deferred, DeferredSemaphore, ensureDeferred
from twisted.internet.defer import TimeoutError as DeferredTimeout
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.web.iweb import IRequest

from homelab_gateway.config import ModelConfig
from homelab_gateway.errors import GatewayError, upstream_http_error
from homelab_gateway.limiter import PositionedSemaphore, QueueFull
from homelab_gateway.mapping import InvalidRequest, MappedRequest, map_request, request_model
from homelab_gateway.sse import SSEParser, encode_event
from homelab_gateway.translator import (
    Event,
    IncompleteMessage,
    MessageBuilder,
    Phase,
    StreamTranslator,
    error_event,
)
from homelab_gateway.upstream import Backpressure, Upstream, UpstreamBroken

PING: Event = {"type": "ping"}
QUEUE_FULL_RETRY_AFTER = 5


@dataclass
class Pool:
    """One upstream with its slots: what a model or a route sends its requests to."""

    upstream: Upstream
    slots: PositionedSemaphore
    queue_timeout: float
    continuous_usage_stats: bool = True

    async def hold_slot(
        self, clock: IReactorTime, on_position: Callable[[int], None] | None = None
    ) -> DeferredSemaphore:
        """Wait for a slot (FIFO, bounded by queue_limit and queue_timeout); the caller releases.

        Cancelling the awaiting Deferred removes the waiter from the line.
        """
        try:
            d = self.slots.acquire_in_line(on_position)
        except QueueFull:
            raise GatewayError(
                529,
                f"upstream {self.upstream.name} is busy: its queue is full "
                f"({self.slots.queue_limit} waiting)",
                retry_after=QUEUE_FULL_RETRY_AFTER,
            ) from None
        d.addTimeout(self.queue_timeout, clock)
        try:
            return await d
        except DeferredTimeout:
            raise GatewayError(
                529,
                f"waited {self.queue_timeout:g}s for a slot on upstream {self.upstream.name}",
                retry_after=QUEUE_FULL_RETRY_AFTER,
            ) from None


def run_cancellable(request: IRequest, work: Coroutine[Any, Any, Any]) -> Deferred[Any]:
    """Drive `work`, cancelling it the moment the client goes away.

    Klein does the same, but the guarantee that an abandoned request frees its upstream is the
    product, so it is made here rather than left to a framework detail.
    """
    d = ensureDeferred(work)
    request.notifyFinish().addErrback(lambda _: d.cancel())
    return d


def new_request_id() -> str:
    return "req_" + secrets.token_hex(12)


def send_json(request: IRequest, status: int, document: Any) -> bytes:
    request.setResponseCode(status)
    request.setHeader(b"content-type", b"application/json")
    return json.dumps(document, ensure_ascii=False).encode()


def send_error(request: IRequest, error: GatewayError) -> bytes:
    if error.retry_after is not None:
        request.setHeader(b"retry-after", str(error.retry_after).encode())
    return send_json(request, error.status, error.anthropic_body())


class EventStream:
    """The client side of one streamed answer: `text/event-stream` frames, flushed per write.

    Nothing is sent before the first frame, so an upstream that refuses early can still get an
    HTTP error. While silent for `ping_interval` it repeats a keep-alive: the last queue frame
    while queued, a `ping` once the message has started. It never writes to a gone client.
    """

    def __init__(self, request: IRequest, clock: IReactorTime, ping_interval: float) -> None:
        self.request = request
        self.clock = clock
        self.ping_interval = ping_interval
        self.started = False
        self.gone = False
        self._keepalive: Event | None = None
        self._timer: IDelayedCall | None = None
        request.notifyFinish().addErrback(self._client_left)

    def send(self, events: list[Event]) -> None:
        if self.gone or not events:
            return
        if not self.started:
            self.started = True
            self.request.setResponseCode(200)
            self.request.setHeader(b"content-type", b"text/event-stream; charset=utf-8")
            self.request.setHeader(b"cache-control", b"no-cache")
            self.request.setHeader(b"x-accel-buffering", b"no")  # nginx: do not buffer SSE
        if any(event["type"] == "message_start" for event in events):
            self._keepalive = PING
        self.request.write(b"".join(encode_event(event) for event in events))
        self._rearm()

    def queue_position(self, position: int) -> None:
        self._keepalive = {"type": "queue", "position": position}
        self.send([self._keepalive])

    def _rearm(self) -> None:
        if self._timer is not None and self._timer.active():
            self._timer.reset(self.ping_interval)
        elif self._keepalive is not None:
            self._timer = self.clock.callLater(self.ping_interval, self._keep_alive)

    def _keep_alive(self) -> None:
        self._timer = None
        if self._keepalive is not None:
            self.send([self._keepalive])

    def _client_left(self, _: object) -> None:
        self.gone = True
        self.close()

    def close(self) -> None:
        if self._timer is not None and self._timer.active():
            self._timer.cancel()
        self._timer = None


class _TranslationOver(Exception):
    """The translator has said its last word; stop reading the upstream."""


class Messages:
    """POST /llm/v1/messages, streaming and not."""

    def __init__(
        self,
        *,
        models: Mapping[str, ModelConfig],
        pools: Mapping[str, Pool],
        clock: IReactorTime,
        ping_interval: float,
        max_body_bytes: int,
    ) -> None:
        self.models = models
        self.pools = pools
        self.clock = clock
        self.ping_interval = ping_interval
        self.max_body_bytes = max_body_bytes

    def read_body(self, request: IRequest) -> Any:
        length = request.getHeader(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            raise GatewayError(413, f"request body exceeds {self.max_body_bytes} bytes")
        raw = request.content.read(self.max_body_bytes + 1)
        if len(raw) > self.max_body_bytes:
            raise GatewayError(413, f"request body exceeds {self.max_body_bytes} bytes")
        try:
            return json.loads(raw)
        except RecursionError:
            raise GatewayError(400, "request body is nested too deeply") from None
        except ValueError as e:
            raise GatewayError(400, f"request body is not valid JSON: {e}") from None

    def resolve(
        self, request: IRequest, *, count_only: bool = False
    ) -> tuple[ModelConfig, Pool, MappedRequest]:
        body = self.read_body(request)
        try:
            name = request_model(body)
            model = self.models.get(name)
            if model is None:
                known = ", ".join(sorted(self.models))
                raise GatewayError(404, f"model: {name!r} is not served here (models: {known})")
            pool = self.pools[model.upstream]
            mapped = map_request(
                body,
                model,
                continuous_usage_stats=pool.continuous_usage_stats,
                count_only=count_only,
            )
        except InvalidRequest as e:
            raise GatewayError(400, str(e)) from None
        except RecursionError:
            raise GatewayError(400, "request body is nested too deeply") from None
        return model, pool, mapped

    def render(self, request: IRequest) -> Deferred[Any]:
        request_id = new_request_id()
        request.setHeader(b"request-id", request_id.encode())
        return run_cancellable(request, self._answer(request))

    async def _answer(self, request: IRequest) -> bytes | None:
        if request.method != b"POST":
            request.setHeader(b"allow", b"POST")
            return send_error(request, GatewayError(405, "use POST for /v1/messages"))
        try:
            _, pool, mapped = self.resolve(request)
            if mapped.stream:
                await self._stream(request, pool, mapped)
                return None
            return send_json(request, 200, await self._whole(pool, mapped))
        except GatewayError as e:
            return send_error(request, e)

    async def _stream(self, request: IRequest, pool: Pool, mapped: MappedRequest) -> None:
        stream = EventStream(request, self.clock, self.ping_interval)
        try:
            slot = await pool.hold_slot(self.clock, stream.queue_position)
            try:
                await self._relay(request, pool, mapped, stream.send, stream)
            finally:
                slot.release()
        except GatewayError as e:
            if not stream.started:
                raise
            stream.send([error_event(e.error_type, e.message)])
        finally:
            stream.close()

    async def _whole(self, pool: Pool, mapped: MappedRequest) -> dict[str, Any]:
        builder = MessageBuilder()
        slot = await pool.hold_slot(self.clock)
        try:
            await self._relay(None, pool, mapped, builder.add, None)
        finally:
            slot.release()
        try:
            return builder.message()
        except IncompleteMessage as e:
            raise GatewayError(
                529 if e.error_type == "overloaded_error" else 502, e.message
            ) from None

    async def _relay(
        self,
        request: IRequest | None,
        pool: Pool,
        mapped: MappedRequest,
        emit: Callable[[list[Event]], None],
        stream: EventStream | None,
    ) -> None:
        """Send the upstream request and pour its translated stream into `emit`.

        Raises GatewayError while nothing has been emitted (the client can still get an HTTP
        error); after that every failure is an error event through `emit`.
        """
        upstream = pool.upstream
        body = json.dumps(mapped.body).encode()
        headers = {b"content-type": [b"application/json"], b"accept": [b"text/event-stream"]}
        response = await upstream.open("POST", upstream.url + "/chat/completions", headers, body)
        if response.code != 200:
            error_body = await upstream.read_limited(response)
            retry_after = response.headers.getRawHeaders(b"retry-after", [None])[0]
            raise upstream_http_error(
                response.code, error_body, retry_after.decode() if retry_after else None
            )
        translator = StreamTranslator(
            model=mapped.model,
            input_tokens=mapped.estimated_input_tokens,
            stop_sequences=mapped.stop_sequences,
        )
        parser = SSEParser()
        emitted = False

        def deliver(events: list[Event]) -> None:
            nonlocal emitted
            if not events:
                return
            if not emitted and events[0]["type"] == "error":
                error = events[0]["error"]
                status = 529 if error["type"] == "overloaded_error" else 502
                raise GatewayError(status, error["message"])
            emitted = True
            emit(events)

        def on_data(data: bytes) -> None:
            for sse in parser.feed(data):
                if sse.data == "[DONE]":
                    deliver(translator.end())
                    continue
                try:
                    chunk = json.loads(sse.data)
                except ValueError:
                    deliver(translator.fail("api_error", "upstream sent a line that is not JSON"))
                else:
                    deliver(translator.feed(chunk))
                if translator.phase is Phase.FAILED:
                    raise _TranslationOver()

        backpressure = Backpressure(request) if request is not None else None
        try:
            await upstream.stream(response, on_data, backpressure)
        except _TranslationOver:
            return
        except UpstreamBroken as e:
            deliver(translator.fail("api_error", str(e)))
            return
        finally:
            if backpressure is not None:
                backpressure.release()
        deliver(
            translator.fail(
                "api_error", f"upstream {upstream.name} closed the stream before [DONE]"
            )
        )
