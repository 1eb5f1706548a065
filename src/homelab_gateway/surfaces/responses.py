"""POST /llm/v1/responses: OpenAI's Responses API (Codex CLI, the Agents SDK) over the
Messages surface's line, upstream request and translator, in `core.responses`' terms.

The upstream is always streamed to, as for /llm/v1/messages; its block events become Responses
events as each read arrives. A waiting stream gets `response.created` (status `queued`) at
once and a `response.queued` at each new place, then `response.in_progress` when its slot
comes; an error after the first event is a `response.failed` with the code the HTTP error
would have had. Nothing is stored: a response cannot be fetched again.
"""

from __future__ import annotations

from twisted.web.http_headers import Headers
from twisted.web.iweb import IRequest

from homelab_gateway.core.errors import GatewayError
from homelab_gateway.core.fields import InvalidRequest
from homelab_gateway.core.record import RequestRecord
from homelab_gateway.core.replicas import session_key
from homelab_gateway.core.response_stream import ResponseStream, new_response_id
from homelab_gateway.core.responses import ResponsesRequest, map_responses
from homelab_gateway.line.limiter import Slot
from homelab_gateway.line.pool import Pool
from homelab_gateway.surfaces.attempts import Target, answerable, attempts
from homelab_gateway.surfaces.messages import EventStream, Messages
from homelab_gateway.surfaces.openai import SESSION_HEADER, read_request, send_openai_error
from homelab_gateway.web.respond import send_error

PING_COMMENT = b": ping\n\n"
"""A silent stream's keep-alive: a comment, which every SSE parser skips (an `event:` line
with no data is an empty event, which the openai SDK fails to decode)."""


class ResponsesSurface:
    """POST /llm/v1/responses, streaming and not, with the Messages surface's models,
    replicas, line and settings (`messages`)."""

    def __init__(self, messages: Messages) -> None:
        self.messages = messages

    def resolve(self, request: IRequest, record: RequestRecord) -> tuple[Target, ResponsesRequest]:
        """The request, checked and mapped, its parsed body let go."""
        body, model = read_request(request, record, self.messages.models)
        pools = tuple(self.messages.pools[name] for name in model.replicas)
        try:
            mapped = map_responses(
                body, model, continuous_usage_stats=all(p.continuous_usage_stats for p in pools)
            )
        except InvalidRequest as e:
            raise GatewayError(400, str(e), param=e.param) from None
        except RecursionError:
            raise GatewayError(400, "request body is nested too deeply") from None
        record.stream = mapped.packed.stream
        record.input_tokens = mapped.packed.estimated_input_tokens
        session = session_key(request.getHeader(SESSION_HEADER) or mapped.session)
        return Target(model, pools, session), mapped

    async def answer(self, request: IRequest, record: RequestRecord) -> bytes | None:
        """The answer to one request: a body to send, or None once it streamed its answer."""
        if request.method != b"POST":
            request.setHeader(b"allow", b"POST")
            return send_error(request, GatewayError(405, "use POST"), shape="openai")
        messages = self.messages
        stream: EventStream | None = None
        response: ResponseStream | None = None
        try:
            try:
                target, mapped = self.resolve(request, record)
                request.requestHeaders = Headers()  # read; a waiter would keep ~1 KB of them
                response = ResponseStream(
                    mapped, response_id=new_response_id(), now=messages.clock.seconds
                )
                if not mapped.packed.stream:
                    body = await self._whole(record, target, response)
                    request.setHeader(b"content-type", b"application/json")
                    return body
                stream = EventStream(
                    request,
                    messages.clock,
                    messages.ping_interval,
                    response.queue_frame,
                    opening="response.in_progress",
                    ping=PING_COMMENT,
                )
                stream.estimator = target.pools[0].line.estimate
                await attempts(
                    messages.retries,
                    record,
                    target,
                    lambda position: _told_place(response, stream, position),
                    lambda pool, fields, slot: self._stream(
                        request, record, pool, fields, slot, response, stream
                    ),
                )
                return None
            except Exception as e:
                error = answerable(e, record)
            if error.code == "context_length_exceeded":
                error.param = "input"
            if stream is not None and stream.started and response is not None:
                message = error.message
                if error.retry_after is not None:  # the words Codex takes its delay from
                    message += f" Please try again in {error.retry_after}s."
                stream.send(response.fail(failure_code(error), message))
                return None
            return send_openai_error(request, error)
        finally:
            if stream is not None:
                stream.close()

    async def _stream(
        self,
        request: IRequest,
        record: RequestRecord,
        pool: Pool,
        fields: dict[str, object],
        slot: Slot,
        response: ResponseStream,
        stream: EventStream,
    ) -> None:
        """One attempt, its events written as each upstream read is translated."""
        if response.status == "queued":
            stream.send(response.begin())
        await self.messages.relay(
            request,
            record,
            pool,
            response.request.packed,
            fields,
            lambda events: stream.send(response.feed(events)),
            slot,
            response.call_id,
        )

    async def _whole(
        self, record: RequestRecord, target: Target, response: ResponseStream
    ) -> bytes:
        await attempts(
            self.messages.retries,
            record,
            target,
            None,
            lambda pool, fields, slot: self.messages.relay(
                None,
                record,
                pool,
                response.request.packed,
                fields,
                response.feed,
                slot,
                response.call_id,
            ),
        )
        if response.error is not None:
            raise GatewayError(502, response.error["message"])
        return response.response()


def failure_code(error: GatewayError) -> str:
    """The code of the `response.failed` that stands for `error` once events went out: the
    one its HTTP error would have had, and for any other refusal of the request itself
    `invalid_prompt`, which Codex does not retry (it would only be refused again)."""
    code = error.openai_body()["error"]["code"]
    if code is not None:
        return str(code)
    status = error.upstream_status or error.openai_status
    return "invalid_prompt" if 400 <= status < 500 else "server_error"


def _told_place(response: ResponseStream, stream: EventStream, position: int) -> None:
    """A new place in the line, told while the stream waits: never once its answer began (a
    retry goes back to the line, silently)."""
    if response.status in (None, "queued"):
        stream.queue_position(position)
