"""The OpenAI surfaces under /llm: chat completions, completions and embeddings, in the same
line as the Messages surface, over the sans-IO `core.openai`.

Nothing is translated: the request goes to the upstream's own endpoint, and its answer comes
back per read, renamed (`StreamRelay`, `WholeRelay`). A waiting stream is told its place in SSE
comment lines, which no client's parser shows; an error after those is a `data: {"error": ...}`
line, what the OpenAI SDKs raise on.
"""

from __future__ import annotations

from typing import Any

import orjson
from twisted.internet.defer import CancelledError
from twisted.web.iweb import IRequest

from homelab_gateway.config import ModelConfig
from homelab_gateway.core.errors import ContextOverflow, GatewayError, upstream_message
from homelab_gateway.core.mapping import PackedRequest
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
from homelab_gateway.line.limiter import Slot
from homelab_gateway.line.pool import Pool
from homelab_gateway.surfaces.attempts import Target, attempts
from homelab_gateway.surfaces.skeleton import Surface
from homelab_gateway.surfaces.stream import OPENAI_QUEUE, EventStream
from homelab_gateway.upstream.client import AnswerComplete, Backpressure, UpstreamBroken

PASSED_HEADERS = (b"content-type", b"metadata")
"""What a whole answer keeps of the upstream's headers: the body says the rest, but for vLLM's
binary embeddings (`encoding_format` `bytes`), whose JSON `metadata` header names the model."""


class _Over(Exception):
    """The stream ended in failure: stop reading the upstream and close it at once."""


class OpenAISurface(Surface):
    """POST /llm/v1/chat/completions, /llm/v1/completions and /llm/v1/embeddings: the row's
    name is the kind (`core.openai.PATHS`)."""

    def map(
        self, body: Any, model: ModelConfig, pools: tuple[Pool, ...]
    ) -> tuple[OpenAIRequest, str | None]:
        mapped = map_openai(self.row.name, body, model)
        return mapped, mapped.session

    def packed(self, mapped: OpenAIRequest) -> PackedRequest:
        return mapped.packed

    def late_error(self, stream: EventStream, mapped: OpenAIRequest, error: GatewayError) -> None:
        stream.relay(error_line(error_document(error)))

    def event_stream(self, request: IRequest, mapped: OpenAIRequest) -> EventStream:
        return EventStream(request, self.settings.clock, self.settings.ping_interval, OPENAI_QUEUE)

    async def whole(
        self, request: IRequest, record: RequestRecord, target: Target, mapped: OpenAIRequest
    ) -> None:
        await attempts(
            self.settings.retries,
            record,
            target,
            None,
            lambda pool, fields, slot: self._whole(request, record, pool, mapped, fields, slot),
        )

    async def overflow_error(
        self,
        pool: Pool,
        record: RequestRecord,
        packed: PackedRequest,
        fields: dict[str, Any],
        overflow: ContextOverflow,
        body: bytes,
    ) -> GatewayError:
        """The upstream's own words, as OpenAI's code for them."""
        return GatewayError(
            400,
            upstream_message(body),
            param=PROMPTS[self.row.name],
            code="context_length_exceeded",
        )

    async def pour(
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
        clock = self.settings.clock
        sent_at = clock.seconds()
        response = await self.open_upstream(
            pool, record, slot, PATHS[mapped.kind], mapped.packed, fields
        )
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

        backpressure = Backpressure(request, clock, self.settings.write_stall_timeout)
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
        response = await self.open_upstream(
            pool, record, slot, PATHS[mapped.kind], mapped.packed, fields, whole=True
        )
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

        backpressure = Backpressure(request, self.settings.clock, self.settings.write_stall_timeout)
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
