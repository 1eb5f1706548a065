"""The OpenAI surfaces under /llm: chat completions, completions and embeddings, in the same
line as the Messages surface, over the sans-IO `core.openai`.

Nothing is translated: the request goes to the upstream's own endpoint, and its answer comes
back per read, renamed (`StreamRelay`, `WholeRelay`). A waiting stream is told its place in SSE
comment lines, which no client's parser shows; an error after those is a `data: {"error": ...}`
line, what the OpenAI SDKs raise on.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import orjson
from twisted.internet.defer import CancelledError
from twisted.web.http_headers import Headers
from twisted.web.iweb import IRequest, IResponse

from homelab_gateway.config import ModelConfig
from homelab_gateway.core.errors import (
    RETRIED_STATUSES,
    GatewayError,
    context_overflow,
    upstream_http_error,
    upstream_message,
)
from homelab_gateway.core.fields import InvalidRequest
from homelab_gateway.core.mapping import find_model, request_model
from homelab_gateway.core.openai import (
    PATHS,
    PROMPTS,
    OpenAIRequest,
    StreamRelay,
    WholeRelay,
    cached_tokens,
    error_document,
    error_line,
    map_openai,
    renamed,
)
from homelab_gateway.core.record import RequestRecord
from homelab_gateway.core.replicas import session_key
from homelab_gateway.core.text import finite_float, refuse_constant
from homelab_gateway.line.limiter import Slot
from homelab_gateway.line.pool import Pool
from homelab_gateway.surfaces.attempts import Target, answerable, attempts
from homelab_gateway.surfaces.messages import (
    OPENAI_QUEUE,
    EventStream,
    Messages,
)
from homelab_gateway.upstream.client import AnswerComplete, Backpressure, UpstreamBroken
from homelab_gateway.web.respond import send_error

SESSION_HEADER = b"x-session-id"
"""A session header for OpenAI clients, ahead of `prompt_cache_key` and `user`."""
PASSED_HEADERS = (b"content-type", b"metadata")
"""What a whole answer keeps of the upstream's headers: the body says the rest, but for vLLM's
binary embeddings (`encoding_format` `bytes`), whose JSON `metadata` header names the model."""


def read_request(
    request: IRequest, record: RequestRecord, models: Mapping[str, ModelConfig]
) -> tuple[Any, ModelConfig]:
    """The request's JSON body and the model it names, its raw body let go; a 400 or a 404 in
    OpenAI's words where it has neither."""
    raw = request.content.read()
    request.content.close()
    try:
        body = json.loads(raw, parse_constant=refuse_constant, parse_float=finite_float)
        name = request_model(body)
    except RecursionError:
        raise GatewayError(400, "request body is nested too deeply") from None
    except InvalidRequest as e:
        raise GatewayError(400, str(e), param="model") from None
    except ValueError as e:
        raise GatewayError(400, f"request body is not valid JSON: {e}") from None
    record.model = name
    model = find_model(models, name)
    if model is None:
        known = ", ".join(sorted(models))
        raise GatewayError(
            404,
            f"The model `{name}` does not exist here (models: {known})",
            param="model",
            code="model_not_found",
        )
    record.served_model = model.name
    record.upstream = model.upstream
    return body, model


class _Over(Exception):
    """The stream ended in failure: stop reading the upstream and close it at once."""


class OpenAISurface:
    """POST /llm/v1/chat/completions, /llm/v1/completions and /llm/v1/embeddings, with the
    Messages surface's models, replicas, line and settings (`messages`)."""

    def __init__(self, messages: Messages) -> None:
        self.messages = messages

    def resolve(
        self, request: IRequest, record: RequestRecord, kind: str
    ) -> tuple[Target, OpenAIRequest]:
        """The request, checked and packed, its parsed body let go."""
        body, model = read_request(request, record, self.messages.models)
        try:
            mapped = map_openai(kind, body, model)
        except InvalidRequest as e:
            raise GatewayError(400, str(e), param=e.param) from None
        except RecursionError:
            raise GatewayError(400, "request body is nested too deeply") from None
        record.stream = mapped.packed.stream
        record.input_tokens = mapped.packed.estimated_input_tokens
        pools = tuple(self.messages.pools[name] for name in model.replicas)
        session = session_key(request.getHeader(SESSION_HEADER) or mapped.session)
        return Target(model, pools, session), mapped

    async def answer(self, request: IRequest, record: RequestRecord, kind: str) -> bytes | None:
        """The answer to one request: a body to send, or None once it was written."""
        if request.method != b"POST":
            request.setHeader(b"allow", b"POST")
            return send_error(request, GatewayError(405, "use POST"), shape="openai")
        messages = self.messages
        stream: EventStream | None = None
        try:
            try:
                target, mapped = self.resolve(request, record, kind)
                request.requestHeaders = Headers()  # read; a waiter would keep ~1 KB of them
                if not mapped.packed.stream:
                    await attempts(
                        messages.retries,
                        record,
                        target,
                        None,
                        lambda pool, fields, slot: self._whole(
                            request, record, pool, mapped, fields, slot
                        ),
                    )
                    return None
                stream = EventStream(
                    request,
                    messages.clock,
                    messages.ping_interval,
                    OPENAI_QUEUE,
                )
                stream.estimator = target.pools[0].line.estimate
                await attempts(
                    messages.retries,
                    record,
                    target,
                    stream.queue_position,
                    lambda pool, fields, slot: self._stream(
                        request, record, pool, mapped, fields, slot, stream
                    ),
                )
                return None
            except Exception as e:
                error = answerable(e, record)
            if stream is not None and stream.started:  # too late for an HTTP error
                stream.relay(error_line(error_document(error)))
                return None
            if request.startedWriting:  # a whole answer cut short: only a cut says so
                request.channel.transport.abortConnection()
                return None
            return send_openai_error(request, error)
        finally:
            if stream is not None:
                stream.close()

    async def _open(
        self,
        pool: Pool,
        record: RequestRecord,
        mapped: OpenAIRequest,
        fields: dict[str, Any],
        slot: Slot,
    ) -> IResponse:
        """Send the upstream request; its response once it answered 200, else the error.

        A whole answer's headers come only once it is generated: it may take the upstream's
        idle_timeout, as a silence in a stream may."""
        upstream = pool.upstream
        headers = {b"content-type": [b"application/json"]}
        within = None
        if mapped.packed.stream:
            headers[b"accept"] = [b"text/event-stream"]
        else:
            within = max(upstream.connect_timeout, upstream.idle_timeout)
        try:
            response = await upstream.open(
                "POST",
                upstream.url + PATHS[mapped.kind],
                headers,
                mapped.packed.body(**fields),
                within,
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
        if context_overflow(body) is not None:
            raise GatewayError(
                400,
                upstream_message(body),
                param=PROMPTS[mapped.kind],
                code="context_length_exceeded",
            )
        retry_after = response.headers.getRawHeaders(b"retry-after", [None])[0]
        raise upstream_http_error(
            response.code, body, retry_after.decode() if retry_after else None
        )

    async def _stream(
        self,
        request: IRequest,
        record: RequestRecord,
        pool: Pool,
        mapped: OpenAIRequest,
        fields: dict[str, Any],
        slot: Slot,
        stream: EventStream,
    ) -> None:
        """Relay one attempt's stream into `stream`, read by read."""
        clock = self.messages.clock
        sent_at = clock.seconds()
        response = await self._open(pool, record, mapped, fields, slot)
        relay = StreamRelay(mapped.packed.model, mapped.include_usage)

        def on_data(data: bytes) -> None:
            out = relay.feed(data)
            if out:
                early_failure(relay, stream, out)
                if record.first_token is None and relay.started:
                    record.first_token = clock.seconds() - sent_at
                record.output_tokens = relay.output_tokens
                stream.relay(out)
            if relay.done:
                raise AnswerComplete()  # `[DONE]`: the answer is over, and so is the slot
            if relay.failed:
                raise _Over()

        backpressure = Backpressure(request, clock, self.messages.write_stall_timeout)
        upstream = pool.upstream
        try:
            await upstream.stream(response, on_data, backpressure)
        except _Over:
            pass
        except UpstreamBroken as e:
            out = relay.fail(str(e))
            early_failure(relay, stream, out)
            stream.relay(out)
        except CancelledError:
            record.upstream_cancelled = True
            raise
        finally:
            backpressure.release()
            record.input_tokens = relay.input_tokens or record.input_tokens
            record.cached_tokens = cached_tokens(relay.usage)
            record.output_tokens = relay.output_tokens
            record.stop_reason = relay.finish_reason
        if not relay.over:
            out = relay.eof(upstream.name)
            early_failure(relay, stream, out)
            stream.relay(out)
        if relay.failed:
            record.outcome = record.outcome or "upstream_error"

    async def _whole(
        self,
        request: IRequest,
        record: RequestRecord,
        pool: Pool,
        mapped: OpenAIRequest,
        fields: dict[str, Any],
        slot: Slot,
    ) -> None:
        """Relay one attempt's whole answer as it arrives, its model renamed."""
        response = await self._open(pool, record, mapped, fields, slot)
        request.setResponseCode(200)
        for name in PASSED_HEADERS:
            values = response.headers.getRawHeaders(name)
            if values:
                renamed = [_renamed_header(value, mapped.packed.model) for value in values]
                request.responseHeaders.setRawHeaders(name, renamed)
        content_type = (response.headers.getRawHeaders(b"content-type") or [b""])[0]
        relay = WholeRelay(mapped.packed.model, rename=b"json" in content_type.lower())

        def on_data(data: bytes) -> None:
            out = relay.feed(data)
            if out:
                request.write(out)

        backpressure = Backpressure(request, self.messages.clock, self.messages.write_stall_timeout)
        try:
            await pool.upstream.stream(response, on_data, backpressure)
        except UpstreamBroken as e:
            raise GatewayError(502, str(e)) from None
        except CancelledError:
            record.upstream_cancelled = True
            raise
        finally:
            backpressure.release()
        rest = relay.end()
        if rest or not request.startedWriting:
            request.write(rest)
        usage = relay.usage or {}
        for name, field in (
            ("prompt_tokens", "input_tokens"),
            ("completion_tokens", "output_tokens"),
        ):
            if isinstance(usage.get(name), int):
                setattr(record, field, usage[name])
        record.cached_tokens = cached_tokens(usage)


def early_failure(relay: StreamRelay, stream: EventStream, out: bytes) -> None:
    """A stream whose failure would be the first bytes its client gets (`out`, what is to be
    written, all error line) fails as an HTTP error instead: its upstream's own status where
    its error says one, else 502."""
    error = relay.error
    if not relay.failed or stream.started or error is None or out != error_line({"error": error}):
        return
    code = error.get("code")
    status = code if isinstance(code, int) and 400 <= code < 600 else 502
    message = error.get("message")
    failed = GatewayError(status, message if isinstance(message, str) else "upstream failed")
    failed.upstream_body, failed.upstream_status = orjson.dumps({"error": error}), status
    raise failed


def _renamed_header(value: bytes, name: str) -> bytes:
    """A header's value, its top-level model renamed where it is a JSON object."""
    try:
        document = orjson.loads(value)
    except ValueError:
        return value
    return renamed(value, document, name)


def send_openai_error(request: IRequest, error: GatewayError) -> bytes:
    """An upstream's own refusal passes on with its status and body; any other error is the
    gateway's, in OpenAI's shape."""
    if error.upstream_body is None or error.upstream_status is None:
        return send_error(request, error, shape="openai")
    if error.retry_after is not None:
        request.setHeader(b"retry-after", str(error.retry_after).encode())
    request.setResponseCode(error.upstream_status)
    try:
        json.loads(error.upstream_body)
        content_type = b"application/json"
    except ValueError:
        content_type = b"text/plain; charset=utf-8"
    request.setHeader(b"content-type", content_type)
    return error.upstream_body
