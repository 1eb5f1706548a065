"""The Anthropic Messages surface: POST /llm/v1/messages and its count_tokens.

A request is mapped to an upstream chat request (`core.mapping`), and the upstream's stream is
translated into Anthropic's events as each read arrives (`TranslatedSurface.relay`); a whole
answer is built from the same events (`MessageBuilder`).
"""

from __future__ import annotations

import json
from typing import Any

from twisted.web.iweb import IRequest

from homelab_gateway.config import ModelConfig
from homelab_gateway.core.errors import GatewayError, error_event
from homelab_gateway.core.mapping import PackedRequest, map_request
from homelab_gateway.core.record import RequestRecord
from homelab_gateway.core.replicas import UP
from homelab_gateway.core.translator import IncompleteMessage, MessageBuilder
from homelab_gateway.line.limiter import Slot
from homelab_gateway.line.pool import Pool
from homelab_gateway.surfaces.attempts import Target, attempts
from homelab_gateway.surfaces.stream import EventStream
from homelab_gateway.surfaces.translated import TranslatedSurface, continuous_usage_stats
from homelab_gateway.web.respond import send_error, send_json

CLAUDE_SESSION_HEADER = b"x-claude-code-session-id"


class Messages(TranslatedSurface):
    """POST /llm/v1/messages, streaming and not."""

    session_header = CLAUDE_SESSION_HEADER
    count_only = False

    def map(self, body: Any, model: ModelConfig, pools: tuple[Pool, ...]) -> tuple[Any, str | None]:
        mapped = map_request(
            body,
            model,
            continuous_usage_stats=continuous_usage_stats(pools),
            count_only=self.count_only,
        )
        return mapped.packed(), mapped.body.get("user")

    def packed(self, mapped: PackedRequest) -> PackedRequest:
        return mapped

    async def whole(
        self, request: IRequest, record: RequestRecord, target: Target, mapped: PackedRequest
    ) -> bytes:
        builder = MessageBuilder()
        await attempts(
            self.settings.retries,
            record,
            target,
            None,
            lambda pool, fields, slot: self.relay(
                None, record, pool, mapped, fields, builder.add, slot
            ),
        )
        try:
            message = builder.message()
        except IncompleteMessage as e:
            raise GatewayError(
                529 if e.error_type == "overloaded_error" else 502, e.message
            ) from None
        return send_json(request, 200, message)

    def event_stream(self, request: IRequest, mapped: PackedRequest) -> EventStream:
        return EventStream(request, self.settings.clock, self.settings.ping_interval)

    async def pour(
        self,
        request: IRequest,
        record: RequestRecord,
        pool: Pool,
        mapped: PackedRequest,
        fields: dict[str, Any],
        slot: Slot,
        stream: EventStream,
    ) -> None:
        await self.relay(request, record, pool, mapped, fields, stream.send, slot)

    def late_error(self, stream: EventStream, mapped: PackedRequest, error: GatewayError) -> None:
        stream.send([error_event(error.error_type, error.message)])


class CountTokens(Messages):
    """POST /llm/v1/messages/count_tokens: the prompt's count by the upstream's tokenizer
    (its kind's: vLLM's /tokenize), else the gateway's estimate. It takes no slot: counting is
    cheap."""

    count_only = True

    async def answer(self, request: IRequest, record: RequestRecord) -> bytes:
        if request.method != b"POST":
            request.setHeader(b"allow", b"POST")
            return send_error(request, GatewayError(405, "use POST"))
        try:
            target, packed = self.resolve(request, record)
        except GatewayError as e:
            record.outcome = e.outcome
            return send_error(request, e)
        # Counted on a replica in rotation, if any, with its own name for the model.
        pool = next((p for p in target.pools if p.replica.circuit.state == UP), target.pools[0])
        body = json.loads(packed.body(model=target.model.model_on(pool.upstream.name)))
        tokenize = pool.kind.tokenize(pool.upstream.url, body)
        count, _ = await self.tokenize(pool, tokenize, record.client)
        record.input_tokens = count or packed.estimated_input_tokens
        return send_json(request, 200, {"input_tokens": record.input_tokens})
