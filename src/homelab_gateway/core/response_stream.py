"""The translator's block events in, OpenAI Responses events out, with no I/O.

`StreamTranslator`'s blocks (thinking, text, tool_use) are the Responses output items
(reasoning, message, function_call) one for one, so chunk handling (reasoning fields, tool
fragments, surrogates, usage, finish reasons) has one implementation. `ResponseStream`
numbers the events, keeps the output for the final object, and closes an item when the next
one starts or the stop reason comes, so a cut-short item says so.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from typing import Any

import orjson

from homelab_gateway.core.response_tools import Offered
from homelab_gateway.core.responses import ResponsesRequest
from homelab_gateway.core.sse import encode_event
from homelab_gateway.core.text import replace_lone_surrogates
from homelab_gateway.core.translator import Event

INCOMPLETE = {"max_tokens": "max_output_tokens", "refusal": "content_filter"}
"""The translator's stop reasons that leave a response incomplete, and the reason it says."""
CALLS = ("function_call", "custom_tool_call")


def new_response_id() -> str:
    return "resp_" + secrets.token_hex(24)


class ResponseStream:
    """The Responses events of one answer, numbered from 0.

    A queued stream starts with `queue_frame` (`response.created`, then `response.queued` at
    each new place); `begin` says its slot came (`response.in_progress`), and `feed` takes the
    translator's events from there. After `completed`, `incomplete` or `failed` every call
    returns nothing. `response()` is the final object, the whole answer of a request that did
    not stream.
    """

    def __init__(
        self, request: ResponsesRequest, *, response_id: str, now: Callable[[], float]
    ) -> None:
        self.request = request
        self.id = response_id
        self.now = now  # for `created_at` and `completed_at`
        self.created_at = int(now())
        self.completed_at: int | None = None
        self.status: str | None = None  # what the client was last told; None: nothing yet
        self.over = False  # completed, incomplete or failed
        self.error: dict[str, str] | None = None
        self._sequence = 0
        self._output: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None  # the item being streamed
        self._index = -1  # its place in the output
        self._parts: list[str] = []  # its text, reasoning or arguments so far
        self._calls: set[str] = set()  # call ids given in this answer
        self._reasoning_deltas = 0
        self._usage: dict[str, Any] | None = None
        self._stop_reason: str | None = None

    def call_id(self, upstream_id: Any) -> str:
        """The call id of a new tool call: the upstream's, unless it has none or it repeats
        one of the conversation's (some servers number their calls from 0 every turn)."""
        if isinstance(upstream_id, str) and upstream_id:
            upstream_id = replace_lone_surrogates(upstream_id)
            if upstream_id not in self.request.call_ids and upstream_id not in self._calls:
                self._calls.add(upstream_id)
                return upstream_id
        call_id = "call_" + secrets.token_hex(12)
        self._calls.add(call_id)
        return call_id

    def queue_frame(self, position: int, estimate: float | None, state: str | None = None) -> bytes:
        """The frames that tell a waiting stream its place (and its model's state while it is
        not loaded), `response.created` first."""
        events = []
        if self.status is None:
            self.status = "queued"
            events.append(self._lifecycle("response.created"))
        queue: dict[str, Any] = {"type": "queue", "position": position}
        if estimate is not None:
            queue["estimated_wait_s"] = round(estimate, 1)
        if state is not None:
            queue["state"] = state
        events.append(self._lifecycle("response.queued", queue=queue))
        return b"".join(map(encode_event, events))

    def begin(self) -> list[Event]:
        """The slot came: `response.in_progress` (after `response.created`, if not yet sent)."""
        if self.status not in (None, "queued"):
            return []
        events = []
        if self.status is None:
            self.status = "in_progress"
            events.append(self._lifecycle("response.created"))
        self.status = "in_progress"
        events.append(self._lifecycle("response.in_progress"))
        return events

    def feed(self, events: list[Event]) -> list[Event]:
        """The Responses events for a batch of the translator's events.

        An item's block ends (`content_block_stop`) just before the next one starts or the
        stop reason comes (`message_delta`), in the same batch: it is closed then, so the last
        item knows whether the output limit cut it."""
        out: list[Event] = []
        for event in events:
            if self.over:
                break
            kind = event["type"]
            if kind == "content_block_delta":
                self._delta(event["delta"], out)
            elif kind == "content_block_start":
                if self._open is not None:
                    self._close("completed", out)
                self._start(event["content_block"], out)
            elif kind == "message_start":
                out += self.begin()
            elif kind == "message_delta":
                self._stop_reason = event["delta"]["stop_reason"]
                self._usage = event["usage"]
                if self._open is not None:
                    cut = self._stop_reason in INCOMPLETE
                    self._close("incomplete" if cut else "completed", out)
            elif kind == "message_stop":
                out += self._finish()
            elif kind == "error":
                # Codex retries a `server_error`, and not `server_is_overloaded`: an upstream
                # that broke off or aborted may well answer the next time.
                out += self.fail("server_error", event["error"]["message"])
        return out

    def fail(self, code: str, message: str) -> list[Event]:
        """`response.failed`, never a response that looks whole: the item cut off stays
        `incomplete`, with what it had."""
        if self.over:
            return []
        events = []
        if self.status is None:  # the stream starts as every stream does
            self.status = "in_progress"
            events.append(self._lifecycle("response.created"))
        if self._open is not None:
            self._settle("incomplete")
        self.error = {"code": code, "message": message}
        self.status, self.over = "failed", True
        return [*events, self._lifecycle("response.failed")]

    def response(self) -> bytes:
        """The response object as JSON: the answer of a request that did not stream."""
        return self._response()

    def _start(self, block: Event, out: list[Event]) -> None:
        kind = block["type"]
        part: dict[str, Any] | None = None
        if kind == "text":
            item = {
                "type": "message",
                "id": "msg_" + secrets.token_hex(16),
                "status": "in_progress",
                "role": "assistant",
                "content": [],
            }
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        elif kind == "thinking":
            item = {
                "type": "reasoning",
                "id": "rs_" + secrets.token_hex(16),
                "summary": [],
                "content": [],
            }
            part = {"type": "reasoning_text", "text": ""}
        else:
            tool = self.request.names.get(block["name"]) or Offered(None, block["name"])
            item = {
                "type": "custom_tool_call" if tool.custom else "function_call",
                "id": ("ctc_" if tool.custom else "fc_") + secrets.token_hex(16),
                "call_id": block["id"],
                "name": tool.name,
                "input" if tool.custom else "arguments": "",
                "status": "in_progress",
            }
            if tool.namespace is not None:
                item["namespace"] = tool.namespace
        self._open, self._parts = item, []
        self._output.append(item)
        index = self._index = len(self._output) - 1
        out.append(self._event("response.output_item.added", output_index=index, item=dict(item)))
        if part is not None:
            out.append(
                self._event(
                    "response.content_part.added",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    part=part,
                )
            )

    def _delta(self, delta: Event, out: list[Event]) -> None:
        """One delta's event: this runs once per token, so it builds the event in one go."""
        item = self._open
        assert item is not None
        kind = delta["type"]
        if kind == "text_delta":
            text = delta["text"]
            fields = {"delta": text, "logprobs": []}
            name = "response.output_text.delta"
        elif kind == "thinking_delta":
            text = delta["thinking"]
            self._reasoning_deltas += 1
            fields = {"delta": text}
            name = "response.reasoning_text.delta"
        elif kind == "input_json_delta":
            text = delta["partial_json"]
            self._parts.append(text)
            if item["type"] == "function_call":  # a custom tool's input comes whole, at the end
                out.append(
                    self._event(
                        "response.function_call_arguments.delta",
                        item_id=item["id"],
                        output_index=self._index,
                        delta=text,
                    )
                )
            return
        else:
            return  # a thinking block's (empty) signature: no upstream signs its reasoning
        self._parts.append(text)
        number = self._sequence
        self._sequence = number + 1
        out.append(
            {
                "type": name,
                "sequence_number": number,
                "item_id": item["id"],
                "output_index": self._index,
                "content_index": 0,
                **fields,
            }
        )

    def _settle(self, status: str) -> str:
        """Put the open item's text in it; answer that text."""
        item = self._open
        assert item is not None
        self._open = None
        text = "".join(self._parts)
        self._parts = []
        if item["type"] == "function_call":
            item["arguments"], item["status"] = text or "{}", status
            return str(item["arguments"])
        if item["type"] == "custom_tool_call":
            item["input"], item["status"] = _custom_input(text), status
            return str(item["input"])
        if item["type"] == "message":
            item["status"] = status
            item["content"] = [
                {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            ]
        else:
            item["content"] = [{"type": "reasoning_text", "text": text}]
        return text

    def _close(self, status: str, out: list[Event]) -> None:
        """The open item's `done` events. A call the output limit cut has none: its arguments
        are half a JSON text, and a client runs every call it is given done."""
        item = self._open
        assert item is not None
        text = self._settle(status)
        if item["type"] in CALLS and status == "incomplete":
            return
        index = self._index
        if item["type"] == "custom_tool_call":
            out.append(
                self._event(
                    "response.custom_tool_call_input.done",
                    item_id=item["id"],
                    output_index=index,
                    input=text,
                )
            )
        elif item["type"] == "function_call":
            out.append(
                self._event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=index,
                    name=item["name"],
                    arguments=text,
                )
            )
        else:
            message = item["type"] == "message"
            where = {"item_id": item["id"], "output_index": index, "content_index": 0}
            if message:
                out.append(
                    self._event("response.output_text.done", **where, text=text, logprobs=[])
                )
            else:
                out.append(self._event("response.reasoning_text.done", **where, text=text))
            out.append(self._event("response.content_part.done", **where, part=item["content"][0]))
        out.append(self._event("response.output_item.done", output_index=index, item=item))

    def _finish(self) -> list[Event]:
        reason = INCOMPLETE.get(self._stop_reason or "")
        self.status = "completed" if reason is None else "incomplete"
        self.over = True
        self.completed_at = int(self.now())
        return [self._lifecycle("response.completed" if reason is None else "response.incomplete")]

    def _event(self, kind: str, **fields: Any) -> Event:
        event = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return event

    def _lifecycle(self, kind: str, **fields: Any) -> Event:
        return self._event(kind, response=orjson.Fragment(self._response()), **fields)

    def _response(self) -> bytes:
        """The response object: what this answer says so far, then the request's echo."""
        status = self.status or "in_progress"
        reason = INCOMPLETE.get(self._stop_reason or "") if status == "incomplete" else None
        fields = {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "completed_at": self.completed_at,
            "model": self.request.packed.model,
            "output": self._output if self.over else [],
            "error": self.error,
            "incomplete_details": {"reason": reason} if reason else None,
            "usage": self._usage_object() if self.over else None,
        }
        return orjson.dumps(fields)[:-1] + b"," + self.request.echo[1:]

    def _usage_object(self) -> dict[str, Any] | None:
        """OpenAI's usage: `input_tokens` counts the whole prompt, cached tokens included."""
        usage = self._usage
        if usage is None:
            return None
        cached, written = usage["cache_read_input_tokens"], usage["cache_creation_input_tokens"]
        prompt = usage["input_tokens"] + written + cached
        output = usage["output_tokens"]
        return {
            "input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": written},
            "output_tokens": output,
            "output_tokens_details": {"reasoning_tokens": min(self._reasoning_deltas, output)},
            "total_tokens": prompt + output,
        }


def _custom_input(arguments: str) -> str:
    """A custom tool's input, from the arguments of the function it was offered as; a model
    that wrote something else gets it passed on as it is."""
    try:
        value = orjson.loads(arguments)
    except orjson.JSONDecodeError:
        return arguments
    if isinstance(value, dict) and isinstance(value.get("input"), str):
        return value["input"]
    return arguments
