"""What the surfaces that translate share (Messages, Responses): the upstream's chat stream,
always streamed, through `StreamTranslator` into Anthropic's block events as each read arrives;
and the prompt counts a context overflow is told with (the kind's tokenize, vLLM's /tokenize)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Any

from twisted.internet.defer import CancelledError
from twisted.web.iweb import IRequest

from homelab_gateway.core.errors import ContextOverflow, GatewayError
from homelab_gateway.core.mapping import PackedRequest, find_model
from homelab_gateway.core.record import RequestRecord
from homelab_gateway.core.translator import Event, Phase, StreamTranslator, UpstreamDecoder
from homelab_gateway.line.limiter import Slot
from homelab_gateway.line.pool import Pool
from homelab_gateway.surfaces.skeleton import Surface
from homelab_gateway.upstream.client import AnswerComplete, Backpressure, UpstreamBroken

TOKENIZE_BODY_LIMIT = 8 * 1024 * 1024
"""vLLM's /tokenize answer lists every token id (about 7 bytes each): 8 MiB covers a
million-token prompt, where the 64 KiB error-body limit would cut a long prompt's answer
short and fall back to the estimate."""


def continuous_usage_stats(pools: tuple[Pool, ...]) -> bool:
    """Whether every replica a request may go to takes vLLM's `continuous_usage_stats` (usage
    in each chunk, the status page's live count): configured, and its kind takes it."""
    return all(pool.continuous_usage_stats for pool in pools)


class _TranslationOver(Exception):
    """The translator failed the stream: stop reading the upstream and close it at once."""


class TranslatedSurface(Surface):
    """A surface whose upstream request is a chat stream it translates (`relay`)."""

    prompt_param: str | None = None
    """The field an overflow's error names, where the surface's errors name one."""

    async def tokenize(
        self, pool: Pool, request: tuple[str, bytes] | None, client: str
    ) -> tuple[int | None, int | None]:
        """The exact prompt count and window from the upstream's tokenize `request` (URL and
        body, `Kind.tokenize`): (None, None) where its kind has none, or when no tokenizer place
        came free (`Pool.hold_tokenizer`)."""
        if request is None:
            return None, None
        upstream, (url, payload) = pool.upstream, request
        headers = {b"content-type": [b"application/json"]}
        place = await pool.hold_tokenizer(self.settings.clock, client)
        if place is None:
            return None, None
        try:
            response = await upstream.open("POST", url, headers, payload)
            text = await upstream.read_limited(response, TOKENIZE_BODY_LIMIT)
        except GatewayError:
            return None, None
        finally:
            place.release()
        if response.code != 200:
            return None, None
        return pool.kind.counted(text)

    async def overflow_error(
        self,
        pool: Pool,
        record: RequestRecord,
        packed: PackedRequest,
        fields: dict[str, Any],
        overflow: ContextOverflow,
        body: bytes,
    ) -> GatewayError:
        """Fill in the numbers the upstream left out, then say it in Anthropic's words.

        vLLM 0.32 stops counting one token past the window ("at least 2049") and Ollama gives
        no number: the prompt's real count comes from /tokenize where there is one, the window
        from /tokenize, /models or the config. With no count at all the gateway's estimate
        stands in; the record keeps the count."""
        prompt, limit = overflow.prompt_tokens, overflow.limit
        if prompt is None or overflow.at_least:
            tokenize = pool.kind.tokenize(pool.upstream.url, json.loads(packed.body(**fields)))
            count, window = await self.tokenize(pool, tokenize, record.client)
            if count is not None:
                prompt = max(count, prompt or 0)
            limit = limit or window
        if limit is None:
            model = find_model(self.settings.models, packed.model)
            limit = self.settings.context_window(model) if model is not None else None
        if prompt is None:
            prompt = packed.estimated_input_tokens
        record.input_tokens = prompt
        error = dataclasses.replace(overflow, prompt_tokens=prompt, limit=limit).error()
        error.param = self.prompt_param
        return error

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
        """Send the upstream request and pour its translated stream into `emit`.

        Raises GatewayError while nothing has been emitted (the client can still get an HTTP
        error); after that every failure is an error event through `emit`. With a `request`,
        the client's connection is backpressure on the upstream's.
        """
        clock = self.settings.clock
        sent_at = clock.seconds()
        response = await self.open_upstream(pool, record, slot, "/chat/completions", packed, fields)
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
                record.first_token = clock.seconds() - sent_at
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

        upstream = pool.upstream
        backpressure = (
            Backpressure(request, clock, self.settings.write_stall_timeout)
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
