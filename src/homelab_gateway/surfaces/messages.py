"""The Anthropic Messages surface under /llm: the Twisted wiring around the sans-IO core.

A request flows route -> slot (limiter) -> upstream (treq) -> SSE parser -> translator ->
`EventStream`, each upstream read translated and written as it arrives. Each request is one
coroutine run by `InFlight`, cancelled when the client disconnects; the cancellation lands on
whatever it awaits (its place in the queue, the upstream's headers, the upstream's body) and
every resource is given back in a `finally`, so no exit path can keep a slot.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from typing import Any

from twisted.internet.defer import CancelledError
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.web.http_headers import Headers
from twisted.web.iweb import IRequest

from homelab_gateway.config import ModelConfig
from homelab_gateway.core.errors import (
    RETRIED_STATUSES,
    ContextOverflow,
    GatewayError,
    context_overflow,
    error_event,
    upstream_http_error,
)
from homelab_gateway.core.fields import InvalidRequest
from homelab_gateway.core.mapping import (
    MappedRequest,
    PackedRequest,
    find_model,
    map_request,
    request_model,
    tokenize_request,
)
from homelab_gateway.core.record import RequestRecord
from homelab_gateway.core.replicas import UP, session_key
from homelab_gateway.core.sse import encode_event
from homelab_gateway.core.text import finite_float, refuse_constant
from homelab_gateway.core.translator import (
    Event,
    IncompleteMessage,
    MessageBuilder,
    Phase,
    StreamTranslator,
    UpstreamDecoder,
)
from homelab_gateway.line.limiter import Slot
from homelab_gateway.line.pool import Pool
from homelab_gateway.quotas import Quotas
from homelab_gateway.surfaces.attempts import Retries, Target, answerable, attempts
from homelab_gateway.upstream.client import AnswerComplete, Backpressure, UpstreamBroken
from homelab_gateway.web.respond import send_error, send_json

TOKENIZE_BODY_LIMIT = 8 * 1024 * 1024
"""vLLM's /tokenize answer lists every token id (about 7 bytes each): 8 MiB covers a
million-token prompt, where the 64 KiB error-body limit would cut a long prompt's answer
short and fall back to the estimate."""
PING_FRAME = encode_event({"type": "ping"})
SESSION_HEADER = b"x-claude-code-session-id"
# Queue frames are the hot path while thousands wait: a template, not json.dumps. A test pins
# it to exactly what encode_event writes for {"type": "queue", "position": n}.
QUEUE_FRAME = b'event: queue\ndata: {"type":"queue","position":%d}\n\n'
ESTIMATED_QUEUE_FRAME = (
    b'event: queue\ndata: {"type":"queue","position":%d,"estimated_wait_s":%.1f}\n\n'
)
# On the OpenAI surfaces the same JSON goes in a comment line, which every SSE parser skips.
QUEUE_COMMENT = b': queue {"type":"queue","position":%d}\n\n'
ESTIMATED_QUEUE_COMMENT = b': queue {"type":"queue","position":%d,"estimated_wait_s":%.1f}\n\n'

QueueFrame = Callable[[int, float | None], bytes]
"""The bytes that tell a waiting stream its place, given the wait it means, where known."""


def templated(plain: bytes, estimated: bytes) -> QueueFrame:
    """A `QueueFrame` from two templates, without and with the estimate."""

    def frame(position: int, estimate: float | None) -> bytes:
        return plain % position if estimate is None else estimated % (position, estimate)

    return frame


ANTHROPIC_QUEUE = templated(QUEUE_FRAME, ESTIMATED_QUEUE_FRAME)
OPENAI_QUEUE = templated(QUEUE_COMMENT, ESTIMATED_QUEUE_COMMENT)


class EventStream:
    """The client side of one streamed answer: `text/event-stream` frames, flushed per write.

    Nothing is sent before the first frame, so an upstream that refuses early can still get an
    HTTP error. While silent for `ping_interval` it repeats a keep-alive: the last queue frame
    while queued, `ping` once the answer has started (the `opening` event went out). It never
    writes to a gone client: the client leaving cancels the handler (`InFlight`), whose
    `finally` closes the stream, in the same turn, and twisted.web drops a write to a
    disconnected request (no `notifyFinish` of its own, which would be one more Deferred for
    each of thousands of waiters).
    """

    __slots__ = (
        "_frame",
        "_keepalive",
        "_opening",
        "_ping",
        "_position",
        "_timer",
        "clock",
        "estimator",
        "ping_interval",
        "request",
        "started",
    )

    def __init__(
        self,
        request: IRequest,
        clock: IReactorTime,
        ping_interval: float,
        queue_frame: QueueFrame = ANTHROPIC_QUEUE,
        *,
        opening: str = "message_start",
        ping: bytes = PING_FRAME,
    ) -> None:
        self.request = request
        self._frame = queue_frame
        self._opening = opening
        self._ping = ping
        self.clock = clock
        self.ping_interval = ping_interval
        self.started = False
        self._keepalive: bytes | None = None  # once started: the ping
        self._timer: IDelayedCall | None = None
        # While queued: the place, whose frame is made again for each keep-alive (with a new
        # estimate), so no waiter holds a copy of its last frame.
        self._position: int | None = None
        # The wait a position means (`PositionedSemaphore.estimate`), where one is known.
        self.estimator: Callable[[int], float | None] | None = None

    def send(self, events: list[Event]) -> None:
        if not events:
            return
        if self._keepalive is None and any(e["type"] == self._opening for e in events):
            self._keepalive = self._ping
            self._position = None
        self._write(b"".join(map(encode_event, events)))

    def relay(self, data: bytes) -> None:
        """Bytes an upstream sent, as they are (the OpenAI surfaces): no keep-alive of the
        gateway's follows them, the upstream's own silence is its own."""
        if data:
            self._position = None
            self.close()
            self._write(data)

    def queue_position(self, position: int) -> None:
        self._position = position
        self._write(self._queue_frame(position))

    def _queue_frame(self, position: int) -> bytes:
        estimate = self.estimator(position) if self.estimator is not None else None
        return self._frame(position, estimate)

    def _write(self, frames: bytes) -> None:
        if not self.started:
            self.started = True
            self.request.setResponseCode(200)
            self.request.setHeader(b"content-type", b"text/event-stream; charset=utf-8")
            self.request.setHeader(b"cache-control", b"no-cache")
            self.request.setHeader(b"x-accel-buffering", b"no")  # nginx: do not buffer SSE
            self.request.write(frames)
            # The head is on the wire and twisted.web never reads these headers again; a
            # queued stream would keep them (~1 KB) for its whole wait.
            self.request.responseHeaders = Headers()
        else:
            self.request.write(frames)
        if self._timer is not None and self._timer.active():
            self._timer.reset(self.ping_interval)
        elif self._keepalive is not None or self._position is not None:
            self._timer = self.clock.callLater(self.ping_interval, self._keep_alive)

    def _keep_alive(self) -> None:
        self._timer = None
        if self._position is not None:  # the same place, but time went by: a new estimate
            self._write(self._queue_frame(self._position))
        elif self._keepalive is not None:
            self._write(self._keepalive)

    def close(self) -> None:
        if self._timer is not None and self._timer.active():
            self._timer.cancel()
        self._timer = None


class _TranslationOver(Exception):
    """The translator failed the stream: stop reading the upstream and close it at once."""


class Messages:
    """POST /llm/v1/messages, streaming and not."""

    def __init__(
        self,
        *,
        models: Mapping[str, ModelConfig],
        pools: Mapping[str, Pool],
        clock: IReactorTime,
        ping_interval: float,
        write_stall_timeout: float,
        upstream_window: Callable[[str, str], int | None] = lambda upstream, model: None,
        retries: int = 2,
        on_retry: Callable[[str, str, bool], None] = lambda upstream, fault, elsewhere: None,
        quotas: Quotas | None = None,
    ) -> None:
        self.models = models
        self.pools = pools
        self.clock = clock
        self.ping_interval = ping_interval
        self.write_stall_timeout = write_stall_timeout
        self.upstream_window = upstream_window
        self.retries = Retries(clock, retries, on_retry, quotas)

    def context_window(self, model: ModelConfig) -> int | None:
        """The model's window: what its upstream's /models says (vLLM), else the config's."""
        window = self.upstream_window(model.upstream, model.model_on(model.upstream))
        return window if window is not None else model.context_window

    async def tokenize(
        self, pool: Pool, payload: bytes, client: str
    ) -> tuple[int | None, int | None]:
        """vLLM's exact prompt count and window from its /tokenize (beside /v1) for `payload`
        (`mapping.tokenize_request`): (None, None) where there is no such endpoint (llama.cpp's
        takes other fields, Ollama has none), or when no tokenizer place came free
        (`Pool.hold_tokenizer`)."""
        upstream = pool.upstream
        base = upstream.url.removesuffix("/v1")
        headers = {b"content-type": [b"application/json"]}
        place = await pool.hold_tokenizer(self.clock, client)
        if place is None:
            return None, None
        try:
            response = await upstream.open("POST", base + "/tokenize", headers, payload)
            text = await upstream.read_limited(response, TOKENIZE_BODY_LIMIT)
        except GatewayError:
            return None, None
        finally:
            place.release()
        if response.code != 200:
            return None, None
        try:
            answer = json.loads(text)
        except ValueError:
            return None, None
        if not isinstance(answer, dict):
            return None, None
        count, window = answer.get("count"), answer.get("max_model_len")
        return (
            count if isinstance(count, int) and count >= 0 else None,
            window if isinstance(window, int) and window > 0 else None,
        )

    async def _overflow_error(
        self,
        pool: Pool,
        record: RequestRecord,
        packed: PackedRequest,
        sent: bytes,
        overflow: ContextOverflow,
    ) -> tuple[GatewayError, int]:
        """Fill in the numbers the upstream left out, then say it in Anthropic's words.

        vLLM 0.32 stops counting one token past the window ("at least 2049") and Ollama gives
        no number: the prompt's real count comes from /tokenize where there is one, the window
        from /tokenize, /models or the config. With no count at all the gateway's estimate
        stands in. `sent` is the upstream body the refusal answered. Answers the error and the
        prompt's count, for the request's record.
        """
        prompt, limit = overflow.prompt_tokens, overflow.limit
        if prompt is None or overflow.at_least:
            payload = tokenize_request(json.loads(sent))
            count, window = await self.tokenize(pool, payload, record.client)
            if count is not None:
                prompt = max(count, prompt or 0)
            limit = limit or window
        if limit is None:
            model = find_model(self.models, packed.model)
            limit = self.context_window(model) if model is not None else None
        if prompt is None:
            prompt = packed.estimated_input_tokens
        return dataclasses.replace(overflow, prompt_tokens=prompt, limit=limit).error(), prompt

    def resolve(self, request: IRequest, record: RequestRecord) -> tuple[Target, PackedRequest]:
        """The request, validated and mapped, as it waits: packed (`MappedRequest.packed`), its
        parsed body let go."""
        target, mapped = self._parse(request, record, count_only=False)
        return target, mapped.packed()

    def count_request(self, request: IRequest, record: RequestRecord) -> tuple[Pool, bytes, int]:
        """For count_tokens: the replica to count on (one in rotation, if any), its /tokenize
        body and the gateway's estimate; the parsed body is let go before the count waits for
        a tokenizer place."""
        target, mapped = self._parse(request, record, count_only=True)
        pool = next((p for p in target.pools if p.replica.circuit.state == UP), target.pools[0])
        body = {**mapped.body, "model": target.model.model_on(pool.upstream.name)}
        return pool, tokenize_request(body), mapped.estimated_input_tokens

    def _parse(
        self, request: IRequest, record: RequestRecord, *, count_only: bool
    ) -> tuple[Target, MappedRequest]:
        """Parse and map the request body; the channel has already bounded its size.

        The raw body is let go once read (from 100 KB on twisted.web keeps it in a temporary
        file, a descriptor per waiter). The session is kept as its `session_key`: a client
        picks its size."""
        raw = request.content.read()
        request.content.close()
        try:
            body = json.loads(raw, parse_constant=refuse_constant, parse_float=finite_float)
            name = request_model(body)
            record.model = name
            model = find_model(self.models, name)
            if model is None:
                known = ", ".join(sorted(self.models))
                raise GatewayError(404, f"model: {name!r} is not served here (models: {known})")
            record.served_model = model.name  # a pattern, never the client's string: bounded
            record.upstream = model.upstream
            pools = tuple(self.pools[name] for name in model.replicas)
            mapped = map_request(
                body,
                model,
                continuous_usage_stats=all(p.continuous_usage_stats for p in pools),
                count_only=count_only,
            )
        except RecursionError:
            raise GatewayError(400, "request body is nested too deeply") from None
        except InvalidRequest as e:
            raise GatewayError(400, str(e)) from None
        except ValueError as e:
            raise GatewayError(400, f"request body is not valid JSON: {e}") from None
        record.stream = mapped.stream
        record.input_tokens = mapped.estimated_input_tokens
        session = session_key(request.getHeader(SESSION_HEADER) or mapped.body.get("user"))
        return Target(model, pools, session), mapped

    async def answer(self, request: IRequest, record: RequestRecord) -> bytes | None:
        """The answer to one request: a body to send, or None once it streamed its answer.

        A stream is handled here rather than in a coroutine of its own: every waiting stream
        would hold that coroutine's frame (~0.3 KB) for its whole wait."""
        if request.method != b"POST":
            request.setHeader(b"allow", b"POST")
            return send_error(request, GatewayError(405, "use POST for /v1/messages"))
        stream: EventStream | None = None
        try:
            try:
                target, packed = self.resolve(request, record)
                # Its headers are read (the access checks, the session) and the answer needs
                # none of them: a request may wait minutes in the line, ~1 KB of headers each.
                request.requestHeaders = Headers()
                if not packed.stream:
                    return send_json(request, 200, await self._whole(record, target, packed))
                stream = EventStream(request, self.clock, self.ping_interval)
                stream.estimator = target.pools[0].line.estimate
                await attempts(
                    self.retries,
                    record,
                    target,
                    stream.queue_position,
                    lambda pool, fields, slot: self.relay(
                        request, record, pool, packed, fields, stream.send, slot
                    ),
                )
                return None
            except Exception as e:
                error = answerable(e, record)
            if stream is not None and stream.started:  # too late for an HTTP error
                stream.send([error_event(error.error_type, error.message)])
                return None
            return send_error(request, error)
        finally:
            if stream is not None:
                stream.close()

    async def _whole(
        self, record: RequestRecord, target: Target, packed: PackedRequest
    ) -> dict[str, Any]:
        builder = MessageBuilder()
        await attempts(
            self.retries,
            record,
            target,
            None,
            lambda pool, fields, slot: self.relay(
                None, record, pool, packed, fields, builder.add, slot
            ),
        )
        try:
            return builder.message()
        except IncompleteMessage as e:
            raise GatewayError(
                529 if e.error_type == "overloaded_error" else 502, e.message
            ) from None

    async def relay(
        self,
        request: IRequest | None,
        record: RequestRecord,
        pool: Pool,
        packed: PackedRequest,
        fields: dict[str, Any],
        emit: Callable[[list[Event]], None],
        slot: Slot,
        tool_id: Callable[[Any], str] | None = None,
    ) -> None:
        """Send the upstream request (`packed` with this attempt's `fields`) and pour its
        translated stream into `emit`; tell `slot` whether the replica answered (any status
        but 502, 503 and 504). No frame here keeps the body it sends: the frames of an answer
        that ended with an exception live on in a cycle until the collector comes, and a long
        conversation's body is megabytes.

        Raises GatewayError while nothing has been emitted (the client can still get an HTTP
        error); after that every failure is an error event through `emit`. With a `request`,
        the client's connection is backpressure on the upstream's.
        """
        upstream = pool.upstream
        headers = {b"content-type": [b"application/json"], b"accept": [b"text/event-stream"]}
        sent_at = self.clock.seconds()
        try:
            response = await upstream.open(
                "POST", upstream.url + "/chat/completions", headers, packed.body(**fields)
            )
        except CancelledError:
            record.upstream_cancelled = True
            raise
        if response.code not in RETRIED_STATUSES:
            slot.succeeded()  # it answered, even if with the request's own error
        if response.code != 200:
            error_body = await upstream.read_limited(response)
            overflow = context_overflow(error_body)
            if overflow is not None:
                error, record.input_tokens = await self._overflow_error(
                    pool, record, packed, packed.body(**fields), overflow
                )
                raise error
            retry_after = response.headers.getRawHeaders(b"retry-after", [None])[0]
            raise upstream_http_error(
                response.code, error_body, retry_after.decode() if retry_after else None
            )
        translator = StreamTranslator(
            model=packed.model,
            input_tokens=packed.estimated_input_tokens,
            stop_sequences=packed.stop_sequences,
            show_reasoning=packed.show_reasoning,
            tool_id=tool_id,
        )
        decoder = UpstreamDecoder(translator)
        emitted = False

        def deliver(events: list[Event]) -> None:
            nonlocal emitted
            if not events:
                return
            if not emitted and events[0]["type"] == "error":
                error = events[0]["error"]
                status = 529 if error["type"] == "overloaded_error" else 502
                raise GatewayError(status, error["message"])
            if record.first_token is None and any(
                e["type"] == "content_block_delta" for e in events
            ):
                record.first_token = self.clock.seconds() - sent_at
            emitted = True
            record.output_tokens = translator.final_output_tokens  # the status page's count
            emit(events)

        def on_data(data: bytes) -> None:
            deliver(decoder.feed(data))
            if translator.phase is Phase.DONE:
                # `[DONE]` (vLLM, Ollama and llama.cpp all send it, after the finish chunk and
                # the usage chunk): the answer is over, whatever the body does next.
                raise AnswerComplete()
            if translator.phase is Phase.FAILED:
                raise _TranslationOver()

        backpressure = (
            Backpressure(request, self.clock, self.write_stall_timeout)
            if request is not None
            else None
        )
        try:
            await upstream.stream(response, on_data, backpressure)
        except _TranslationOver:
            pass
        except UpstreamBroken as e:
            deliver(translator.fail("api_error", str(e)))
        except CancelledError:
            record.upstream_cancelled = True
            raise
        finally:
            if backpressure is not None:
                backpressure.release()
            record.input_tokens = translator.input_tokens
            # As the client is told it (`cache_read_input_tokens`): never more than the prompt.
            record.cached_tokens = min(translator.cached_tokens, translator.input_tokens)
            record.output_tokens = translator.final_output_tokens
            record.stop_reason = translator.stop_reason
        deliver(decoder.eof(upstream.name))
        if translator.phase is Phase.FAILED:
            record.outcome = record.outcome or "upstream_error"
