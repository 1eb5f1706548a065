"""OpenAI chat-completion chunks in, Anthropic Messages stream events out, with no I/O.

The upstream sends flat deltas (`reasoning`/`reasoning_content`, `content`, `tool_calls`) and
says nothing when one kind ends and the next begins; an Anthropic client needs named blocks with
indices, opened and closed one at a time. `StreamTranslator` holds exactly the state that
takes: which block is open, the next index, the tool calls seen, the finish reason and usage.
It is fed one parsed chunk at a time and answers the events to send at once, so the gateway can
flush each one as it arrives. `MessageBuilder` folds the same events into one `message` object
for clients that did not ask to stream, so both answers come from one set of rules.
"""

from __future__ import annotations

import enum
import json
import re
import secrets
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from homelab_gateway.core.errors import error_event
from homelab_gateway.core.sse import EventTooLarge, SSEParser
from homelab_gateway.core.text import LONE_SURROGATE, refuse_constant, replace_lone_surrogates

Event = dict[str, Any]

_STOP_REASONS = {
    "stop": "end_turn",
    "length": "max_tokens",
    "tool_calls": "tool_use",
    "function_call": "tool_use",
    "content_filter": "refusal",
}


# A JSON count `_is_count` accepts, written as JSON writes it (no leading zero), short enough
# that orjson decodes it to an int (longer ones it decodes to a float).
_COUNT = rb"(?:0|[1-9][0-9]{0,17})"
# A JSON string with no escape and no control character: its text is the bytes between quotes.
_PLAIN_STRING = rb'[^"\\\x00-\x1f]'
# The text of a token: the same, and the two-character escapes (a newline, a quote: code is
# full of them), but no `\u` escape, which may be half of a surrogate pair.
_TEXT = rb'((?:[^"\\\x00-\x1f]|\\["\\/bfnrt])+)'

PLAIN_EVENT = re.compile(
    rb'data: \{"id":"'
    + _PLAIN_STRING
    + rb'*","object":"chat\.completion\.chunk","created":'
    + _COUNT
    + rb',"model":"'
    + _PLAIN_STRING
    + rb'*","choices":\[\{"index":0,"delta":\{'
    rb'"(content|reasoning|reasoning_content)":"' + _TEXT + rb'"\},'
    rb'"logprobs":null,"finish_reason":null\}\]'
    rb'(?:,"usage":\{"prompt_tokens":('
    + _COUNT
    + rb'),"total_tokens":'
    + _COUNT
    + rb',"completion_tokens":('
    + _COUNT
    + rb")\})?\}\n\n"
)
"""The event most of a stream is made of, exactly as vLLM writes it (pydantic's compact JSON,
fields in declaration order, `usage` when `continuous_usage_stats` is on, LF line ends): one
token of content or reasoning and nothing else. `UpstreamDecoder` hands each such event to
`StreamTranslator.plain_delta` straight from the bytes, with no SSE parsing, JSON decoding or
walking of the chunk; anything else (another field, another server's layout, CRLF, a `\\u`
escape) goes the generic way. The pattern is strict enough that both ways give the same
events: `tests/core/test_translator.py` checks that for every event it accepts."""


# The delta type of each kind of block, and the field its text goes in.
_DELTAS = {
    "text": ("text_delta", "text"),
    "thinking": ("thinking_delta", "thinking"),
    "tool": ("input_json_delta", "partial_json"),
}


class Phase(enum.Enum):
    AWAITING_FIRST_CHUNK = "awaiting first chunk"
    STREAMING = "streaming"
    FINISHING = "finishing"  # finish_reason seen; usage and [DONE] may still come
    DONE = "done"  # message_stop sent
    FAILED = "failed"  # error sent


def new_message_id() -> str:
    return "msg_" + secrets.token_hex(12)


def new_tool_use_id() -> str:
    return "toolu_" + secrets.token_hex(12)


@dataclass
class _ToolCall:
    id: str
    name: str = ""
    index: int | None = None  # the Anthropic block index, once the block is open
    pending: list[str] = field(default_factory=list)  # argument fragments seen before the name


class StreamTranslator:
    """The streaming state machine: `feed(chunk)`, then `end()` on `[DONE]`, or `fail(...)`.

    Every call returns the events it produced, in order. After `DONE` or `FAILED` every call
    returns nothing, so the caller never has to guard against writing after the last frame.
    """

    def __init__(
        self,
        *,
        model: str,
        input_tokens: int,
        stop_sequences: Sequence[str] = (),
        message_id: str | None = None,
        show_reasoning: bool = True,
        tool_id: Callable[[Any], str] | None = None,
    ) -> None:
        self.phase = Phase.AWAITING_FIRST_CHUNK
        # DONE or FAILED: a plain attribute, not a property, since it is read several times per
        # token; set in the only two places that end a stream, `end` and `_fail`.
        self.terminated = False
        self.model = model
        self.message_id = message_id or new_message_id()
        self.input_tokens = input_tokens  # the whole prompt, cached or not
        self.cached_tokens = 0  # of those, read from the upstream's prefix cache
        self.created_cache_tokens = 0  # of those, written into it (vLLM 0.32 reports them)
        self.output_tokens: int | None = None  # as reported by the upstream
        self.counted_tokens = 0  # deltas seen: the estimate when the upstream reports no usage
        self.stop_reason: str | None = None
        self.stop_sequence: str | None = None
        self._stop_sequences = frozenset(stop_sequences)
        self._finish_reason: str | None = None
        self._open: tuple[str, int] | None = None  # ("thinking" | "text" | "tool", tool index)
        self._open_index = -1
        self._next_index = 0
        self._tools: dict[int, _ToolCall] = {}
        # A high surrogate that ended a block's last text, by block: `_clean` explains.
        self._held: dict[tuple[str, int], str] = {}
        self._used_tools = False
        self._show_reasoning = show_reasoning
        # A new call's id, given the upstream's: by default one of the gateway's own.
        self._tool_id = tool_id or (lambda upstream_id: new_tool_use_id())
        self._out: list[Event] = []

    def feed(self, chunk: Any) -> list[Event]:
        """Translate one parsed upstream chunk."""
        if self.terminated:
            return []
        # JSON objects decode to dict: checked as dict, not Mapping, which costs more per chunk.
        if not isinstance(chunk, dict):
            return self.fail("api_error", "upstream sent a chunk that is not a JSON object")
        if chunk.get("error"):
            return self.fail(*_upstream_error(chunk["error"]))
        self._take_usage(chunk.get("usage"), chunk.get("timings"))
        if self.phase is Phase.AWAITING_FIRST_CHUNK:
            self.phase = Phase.STREAMING
            self._out.append(self._message_start())
        choices = chunk.get("choices")
        for choice in choices if isinstance(choices, list) else ():
            if isinstance(choice, dict) and choice.get("index", 0) == 0:
                self._choice(choice)
                if self.terminated:
                    break
        return self._flush()

    def plain_delta(
        self, field: bytes, text: bytes, prompt: bytes | None, completion: bytes | None
    ) -> list[Event]:
        """`feed` for an event `PLAIN_EVENT` matched, given its groups, while STREAMING: what
        `feed` does with that chunk's usage and its one non-empty text field. The text is
        decoded as the generic way decodes it: the SSE parser's UTF-8 with replacement, then
        JSON's escapes where there are any."""
        if prompt is not None:
            self.input_tokens = int(prompt)
            self.output_tokens = int(completion)  # type: ignore[arg-type] (both or neither)
        if field == b"content":
            kind = "text"
        elif self._show_reasoning:
            kind = "thinking"
        else:
            return []
        value = text.decode("utf-8", "replace")
        if b"\\" in text:
            value = orjson.loads('"' + value + '"')
        if self._held:  # the text itself has no surrogate: `PLAIN_EVENT` takes no `\\u` escape
            value = self._clean((kind, 0), value)
        self._delta(kind, value)
        self.counted_tokens += 1
        return self._flush()

    def end(self) -> list[Event]:
        """The upstream finished its stream (`[DONE]`)."""
        if self.terminated:
            return []
        if self._finish_reason is None:
            what = "anything" if self.phase is Phase.AWAITING_FIRST_CHUNK else "a finish_reason"
            return self.fail("api_error", f"upstream ended the stream without {what}")
        self._close_block()
        usage = {**self._input_usage(), "output_tokens": self.final_output_tokens}
        delta = {"stop_reason": self.stop_reason, "stop_sequence": self.stop_sequence}
        self._out.append({"type": "message_delta", "delta": delta, "usage": usage})
        self._out.append({"type": "message_stop"})
        self.phase = Phase.DONE
        self.terminated = True
        return self._flush()

    def fail(self, error_type: str, message: str) -> list[Event]:
        """End the stream with an error frame: never a stream that looks complete."""
        self._fail(error_type, message)
        return self._flush()

    def _fail(self, error_type: str, message: str) -> None:
        if not self.terminated:
            self._out.append(error_event(error_type, message))
            self.phase = Phase.FAILED
            self.terminated = True

    @property
    def final_output_tokens(self) -> int:
        return self.output_tokens if self.output_tokens is not None else self.counted_tokens

    def _flush(self) -> list[Event]:
        out, self._out = self._out, []
        return out

    def _message_start(self) -> Event:
        return {
            "type": "message_start",
            "message": {
                "id": self.message_id,
                "type": "message",
                "role": "assistant",
                "model": self.model,
                "content": [],
                "stop_reason": None,
                "stop_sequence": None,
                "usage": {**self._input_usage(), "output_tokens": self.output_tokens or 0},
            },
        }

    def _input_usage(self) -> dict[str, int]:
        """Anthropic's split of the prompt: its `input_tokens` leaves out what the cache read
        and what it wrote, as vLLM's own Anthropic endpoint does.

        Each part is capped by what the one before leaves of the prompt, so the three add up to
        it and none is negative even when an upstream's counts overrun it.
        """
        cached = min(self.cached_tokens, self.input_tokens)
        created = min(self.created_cache_tokens, self.input_tokens - cached)
        return {
            "input_tokens": self.input_tokens - cached - created,
            "cache_creation_input_tokens": created,
            "cache_read_input_tokens": cached,
        }

    def _take_usage(self, usage: Any, timings: Any) -> None:
        if isinstance(timings, dict) and _is_count(timings.get("cache_n")):
            self.cached_tokens = timings["cache_n"]  # llama.cpp before prompt_tokens_details
        if not isinstance(usage, dict):
            return
        prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
        if _is_count(prompt):
            self.input_tokens = prompt
        if _is_count(completion):
            self.output_tokens = completion
        # vLLM (with `--enable-prompt-tokens-details`) and llama.cpp's server both send
        # `cached_tokens`; vLLM 0.32 adds `created_cache_tokens`. A count left out or null keeps
        # the last one reported.
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict):
            cached, created = details.get("cached_tokens"), details.get("created_cache_tokens")
            if _is_count(cached):
                self.cached_tokens = cached
            if _is_count(created):
                self.created_cache_tokens = created

    def _choice(self, choice: Mapping[str, Any]) -> None:
        delta = choice.get("delta")
        if isinstance(delta, dict):
            produced = False
            reasoning = _text(delta.get("reasoning")) or _text(delta.get("reasoning_content"))
            if reasoning and self._show_reasoning:
                self._delta("thinking", self._clean(("thinking", 0), reasoning))
                produced = True
            content = _text(delta.get("content"))
            if content:
                self._delta("text", self._clean(("text", 0), content))
                produced = True
            tool_calls = delta.get("tool_calls")
            for call in tool_calls if isinstance(tool_calls, list) else ():
                if isinstance(call, dict):
                    produced = self._tool_call(call) or produced
                    if self.terminated:
                        return
            self.counted_tokens += produced
        finish = choice.get("finish_reason")
        if isinstance(finish, str) and finish and self._finish_reason is None:
            self._finish(finish, choice.get("stop_reason"))

    def _clean(self, key: tuple[str, int], text: str) -> str:
        """The upstream's `text` for block `key`, free of lone surrogates.

        A JS server that splits an emoji between tokens writes each half as its own `\\u`
        escape, in two chunks: a high surrogate ending one text is held back and joined to the
        block's next one (or sent as U+FFFD when the block closes without it).
        """
        if not self._held and LONE_SURROGATE.search(text) is None:
            return text
        text = self._held.pop(key, "") + text
        if text and "\ud800" <= text[-1] <= "\udbff":
            self._held[key] = text[-1]
            text = text[:-1]
        return replace_lone_surrogates(text)

    def _delta(self, kind: str, text: str) -> None:
        """A text or thinking delta; an empty one (all held back) only opens its block."""
        if self._open != (kind, 0):
            start: Event = (
                {"type": "thinking", "thinking": "", "signature": ""}
                if kind == "thinking"
                else {"type": "text", "text": ""}
            )
            self._open_block((kind, 0), start)
        if text:
            self._append_delta(kind, text)

    def _append_delta(self, kind: str, text: str) -> None:
        delta_type, name = _DELTAS[kind]
        delta = {"type": delta_type, name: text}
        self._out.append({"type": "content_block_delta", "index": self._open_index, "delta": delta})

    def _tool_call(self, call: Mapping[str, Any]) -> bool:
        position = call.get("index", 0)
        if not isinstance(position, int):
            position = 0
        tool = self._tools.get(position)
        if tool is None:
            tool = self._tools[position] = _ToolCall(id=self._tool_id(call.get("id")))
        function = call.get("function")
        function = function if isinstance(function, dict) else {}
        name = _text(function.get("name"))
        if name and not tool.name:
            tool.name = replace_lone_surrogates(name)
        arguments = _text(function.get("arguments"))
        # Held back like text; a half held while the name is unknown waits the same way, since
        # the block opens under the same key.
        fragment = self._clean(("tool", position), arguments) if arguments else ""
        if tool.index is None:
            if not tool.name:
                tool.pending.append(fragment)
                return bool(arguments)
            self._used_tools = True
            start = {"type": "tool_use", "id": tool.id, "name": tool.name, "input": {}}
            self._open_block(("tool", position), start)
            tool.index = self._open_index
            fragment = "".join([*tool.pending, fragment])
            tool.pending.clear()
        elif self._open != ("tool", position):
            if arguments:
                self._fail("api_error", "upstream interleaved the arguments of two tool calls")
            return False
        if fragment:
            self._append_delta("tool", fragment)
        return bool(name or arguments)

    def _open_block(self, key: tuple[str, int], block: Event) -> None:
        self._close_block()
        self._open, self._open_index = key, self._next_index
        self._next_index += 1
        self._out.append(
            {"type": "content_block_start", "index": self._open_index, "content_block": block}
        )

    def _close_block(self) -> None:
        if self._open is not None:
            if self._held.pop(self._open, None) is not None:
                self._append_delta(self._open[0], "\ufffd")  # half a pair, the other never came
            if self._open[0] == "thinking":
                # The SDKs' types end a thinking block with its signature. There is none to give
                # (no upstream signs its reasoning): an empty one, as the block started with.
                delta = {"type": "signature_delta", "signature": ""}
                self._out.append(
                    {"type": "content_block_delta", "index": self._open_index, "delta": delta}
                )
            self._out.append({"type": "content_block_stop", "index": self._open_index})
            self._open = None

    def _finish(self, reason: str, matched: Any) -> None:
        if reason == "abort":
            self._fail("overloaded_error", "upstream aborted the generation")
            return
        self._finish_reason = reason
        self.phase = Phase.FINISHING
        if reason == "stop" and isinstance(matched, str) and matched in self._stop_sequences:
            self.stop_reason, self.stop_sequence = "stop_sequence", matched
        elif self._used_tools and reason in ("stop", "tool_calls"):
            self.stop_reason = "tool_use"  # some servers say "stop" after calling tools
        else:
            self.stop_reason = _STOP_REASONS.get(reason, "end_turn")


def _text(value: Any) -> str:
    return value if isinstance(value, str) else ""


MAX_COUNT = 10**18
"""Counts from here on are an upstream's nonsense, and ignored: `_COUNT`'s 18 digits, which
orjson writes back (it refuses integers past 64 bits)."""


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < MAX_COUNT


def _upstream_error(error: Any) -> tuple[str, str]:
    """An in-stream `{"error": ...}` from vLLM or a proxy, as an Anthropic error type and text."""
    if isinstance(error, dict):
        message = error.get("message") or error.get("type") or "unknown error"
        code = error.get("code")
    else:
        message, code = error, None
    overloaded = code in (429, 503, 529, "429", "503", "529")
    text = replace_lone_surrogates(f"upstream error: {message}")
    return ("overloaded_error" if overloaded else "api_error"), text


def _loads_lone_surrogates(data: str) -> Any:
    """JSON that orjson refuses, decoded by the standard library, which takes a lone surrogate
    escape (half an emoji a JS server split across chunks: the translator joins the halves).
    It also takes NaN and Infinity, which are not JSON, so those stay refused."""
    return json.loads(data, parse_constant=refuse_constant)


class IncompleteMessage(Exception):
    """The events ended in an error, or without `message_stop`: there is no message to answer."""

    def __init__(self, error_type: str, message: str) -> None:
        super().__init__(message)
        self.error_type = error_type
        self.message = message


class MessageBuilder:
    """Folds a stream of Anthropic events into the one `message` a non-streaming client gets."""

    def __init__(self) -> None:
        self._message: dict[str, Any] | None = None
        self._json: dict[int, list[str]] = {}
        self._error: tuple[str, str] | None = None
        self._stopped = False

    def add(self, events: Iterable[Event]) -> None:
        for event in events:
            self._add(event)

    def _add(self, event: Event) -> None:
        kind = event["type"]
        if kind == "message_start":
            self._message = {**event["message"], "content": []}
            return
        if kind == "error":
            self._error = (event["error"]["type"], event["error"]["message"])
            return
        assert self._message is not None, f"{kind} before message_start"
        content = self._message["content"]
        if kind == "content_block_start":
            content.append(dict(event["content_block"]))
        elif kind == "content_block_delta":
            block, delta = content[event["index"]], event["delta"]
            if delta["type"] == "text_delta":
                block["text"] += delta["text"]
            elif delta["type"] == "thinking_delta":
                block["thinking"] += delta["thinking"]
            elif delta["type"] == "signature_delta":
                block["signature"] = delta["signature"]
            elif delta["type"] == "input_json_delta":
                self._json.setdefault(event["index"], []).append(delta["partial_json"])
        elif kind == "content_block_stop":
            block = content[event["index"]]
            if block["type"] == "tool_use":
                block["input"] = self._tool_input(event["index"], block["name"])
        elif kind == "message_delta":
            self._message.update(event["delta"])
            self._message["usage"] = {**self._message["usage"], **event["usage"]}
        elif kind == "message_stop":
            self._stopped = True

    def _tool_input(self, index: int, name: str) -> Any:
        text = "".join(self._json.pop(index, [])) or "{}"
        try:
            value = json.loads(text)
        except ValueError:
            value = None
        if not isinstance(value, dict):
            self._error = (
                "api_error",
                f"upstream gave tool {name!r} arguments that are not a JSON object",
            )
            return {}
        return value

    def message(self) -> dict[str, Any]:
        if self._error is not None:
            raise IncompleteMessage(*self._error)
        if self._message is None or not self._stopped:
            raise IncompleteMessage(
                "api_error", "upstream stream ended before the message was complete"
            )
        return self._message


class UpstreamDecoder:
    """The whole upstream side, sans-IO: body bytes in, Anthropic events out.

    SSE framing, `[DONE]`, JSON decoding and translation in one object, so the gateway's I/O
    layer only moves bytes, and the grammar can be fuzzed on raw bytes split anywhere.
    """

    def __init__(self, translator: StreamTranslator) -> None:
        self.translator = translator
        self._parser = SSEParser()

    def feed(self, data: bytes) -> list[Event]:
        """The events `data` completes: runs of plain events (`PLAIN_EVENT`) straight to
        the translator, every other event through the SSE parser, in order."""
        events: list[Event] = []
        translator, parser, match = self.translator, self._parser, PLAIN_EVENT.match
        position, size = 0, len(data)
        while position < size:
            if parser.idle and translator.phase is Phase.STREAMING:
                while (event := match(data, position)) is not None and (
                    event.end() - position - 2 <= parser.limit  # the line, as the parser bounds it
                ):
                    events += translator.plain_delta(*event.groups())
                    position = event.end()
                if position == size:
                    break
            # One event the generic way (or the rest, where no blank line ends one).
            end = data.find(b"\n\n", position) + 2
            if end < 2:
                end = size
            events += self._generic(data[position:end])
            position = end
        return events

    def _generic(self, data: bytes) -> list[Event]:
        events: list[Event] = []
        try:
            parsed, too_large = self._parser.feed(data), None
        except EventTooLarge as e:
            parsed, too_large = e.events, e
        for sse in parsed:
            if self.translator.terminated:
                break
            if sse.data == "[DONE]":
                events += self.translator.end()
                continue
            try:
                chunk = orjson.loads(sse.data)  # once per token: several times json's speed
            except ValueError:
                try:
                    chunk = _loads_lone_surrogates(sse.data)
                except (ValueError, RecursionError):
                    events += self.translator.fail(
                        "api_error", "upstream sent a line that is not JSON"
                    )
                    continue
            events += self.translator.feed(chunk)
        if too_large is not None:
            events += self.translator.fail("api_error", f"upstream sent {too_large}")
        return events

    def eof(self, upstream: str) -> list[Event]:
        """The body ended: anything short of `[DONE]` is a failure, never a quiet success."""
        return self.translator.fail(
            "api_error", f"upstream {upstream} closed the stream before [DONE]"
        )
