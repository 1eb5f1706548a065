"""POST /llm/v1/responses: OpenAI's Responses API (Codex CLI, the Agents SDK) translated
as the Messages surface's is (`TranslatedSurface`), in `core.responses`' terms.

The upstream is always streamed to, as for /llm/v1/messages; its block events become Responses
events as each read arrives. A waiting stream gets `response.created` (status `queued`) at
once and a `response.queued` at each new place, then `response.in_progress` when its slot
comes; an error after the first event is a `response.failed` with the code the HTTP error
would have had. Nothing is stored: a response cannot be fetched again.
"""

from __future__ import annotations

from typing import Any

from twisted.web.iweb import IRequest

from homelab_gateway.config import ModelConfig
from homelab_gateway.core.errors import GatewayError
from homelab_gateway.core.mapping import PackedRequest
from homelab_gateway.core.record import RequestRecord
from homelab_gateway.core.response_stream import ResponseStream, new_response_id
from homelab_gateway.core.responses import map_responses
from homelab_gateway.line.limiter import PositionListener, Slot
from homelab_gateway.line.pool import Pool
from homelab_gateway.surfaces.attempts import Target, attempts
from homelab_gateway.surfaces.stream import EventStream
from homelab_gateway.surfaces.translated import TranslatedSurface, continuous_usage_stats

PING_COMMENT = b": ping\n\n"
"""A silent stream's keep-alive: a comment, which every SSE parser skips (an `event:` line
with no data is an empty event, which the openai SDK fails to decode)."""


class ResponsesSurface(TranslatedSurface):
    """POST /llm/v1/responses, streaming and not. What a request waits as is its
    `ResponseStream`: the mapped request and the events it has told."""

    prompt_param = "input"

    def map(
        self, body: Any, model: ModelConfig, pools: tuple[Pool, ...]
    ) -> tuple[ResponseStream, str | None]:
        mapped = map_responses(body, model, continuous_usage_stats=continuous_usage_stats(pools))
        response = ResponseStream(
            mapped, response_id=new_response_id(), now=self.settings.clock.seconds
        )
        return response, mapped.session

    def packed(self, mapped: ResponseStream) -> PackedRequest:
        return mapped.request.packed

    def late_error(self, stream: EventStream, mapped: ResponseStream, error: GatewayError) -> None:
        message = error.message
        if error.retry_after is not None:  # the words Codex takes its delay from
            message += f" Please try again in {error.retry_after}s."
        stream.send(mapped.fail(failure_code(error), message))

    def event_stream(self, request: IRequest, mapped: ResponseStream) -> EventStream:
        return EventStream(
            request,
            self.settings.clock,
            self.settings.ping_interval,
            mapped.queue_frame,
            opening="response.in_progress",
            ping=PING_COMMENT,
        )

    def on_position(self, stream: EventStream, mapped: ResponseStream) -> PositionListener:
        return lambda position: _told_place(mapped, stream, position)

    async def pour(
        self,
        request: IRequest,
        record: RequestRecord,
        pool: Pool,
        mapped: ResponseStream,
        fields: dict[str, Any],
        slot: Slot,
        stream: EventStream,
    ) -> None:
        """One attempt, its events written as each upstream read is translated."""
        if mapped.status == "queued":
            stream.send(mapped.begin())
        await self.relay(
            request,
            record,
            pool,
            mapped.request.packed,
            fields,
            lambda events: stream.send(mapped.feed(events)),
            slot,
            mapped.call_id,
        )

    async def whole(
        self, request: IRequest, record: RequestRecord, target: Target, mapped: ResponseStream
    ) -> bytes:
        await attempts(
            self.settings.retries,
            record,
            target,
            None,
            lambda pool, fields, slot: self.relay(
                None,
                record,
                pool,
                mapped.request.packed,
                fields,
                mapped.feed,
                slot,
                mapped.call_id,
            ),
        )
        if mapped.error is not None:
            raise GatewayError(502, mapped.error["message"])
        body = mapped.response()
        request.setHeader(b"content-type", b"application/json")
        return body


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
