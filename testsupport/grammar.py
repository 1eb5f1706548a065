"""What a grammatical Anthropic Messages event stream is, as one checker all tests share."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

DELTA_FOR_BLOCK = {
    "text": "text_delta",
    "thinking": "thinking_delta",
    "tool_use": "input_json_delta",
}


PROMPT_USAGE = ("input_tokens", "cache_creation_input_tokens", "cache_read_input_tokens")


def check_usage(usage: dict[str, Any]) -> None:
    """Anthropic's usage always carries the cache fields; `input_tokens` excludes cache reads."""
    for key in (*PROMPT_USAGE, "output_tokens"):
        assert isinstance(usage.get(key), int) and usage[key] >= 0, f"usage.{key}: {usage}"


def check_stream(events: Sequence[dict[str, Any]], *, allow_queue: bool = True) -> str:
    """Assert the stream's grammar; return "complete" or "error" for how it ended.

    Leading `queue` frames (the gateway's extension) are allowed before `message_start` only;
    dropping them must leave a valid stream, which is what the rest checks.
    """
    kinds = [e["type"] for e in events]
    i = 0
    while i < len(kinds) and kinds[i] == "queue":
        assert allow_queue, "queue frame on a stream that must not have one"
        assert isinstance(events[i]["position"], int) and events[i]["position"] >= 1
        assert set(events[i]) <= {"type", "position", "estimated_wait_s"}, events[i]
        estimate = events[i].get("estimated_wait_s", 0.0)
        assert isinstance(estimate, float) and estimate >= 0, events[i]
        i += 1
    assert "queue" not in kinds[i:], f"queue frame after the message started: {kinds}"
    rest = [e for e in events[i:] if e["type"] != "ping"]
    assert rest, "empty stream"
    if rest[0]["type"] == "error":
        assert len(rest) == 1, f"frames after an error: {kinds}"
        return "error"
    assert rest[0]["type"] == "message_start", f"first frame is {rest[0]['type']}"
    assert kinds[i] == "message_start", "ping before message_start"
    message = rest[0]["message"]
    assert message["type"] == "message" and message["role"] == "assistant"
    assert message["id"].startswith("msg_") and message["content"] == []
    assert message["stop_reason"] is None and message["stop_sequence"] is None
    check_usage(message["usage"])
    assert sum(message["usage"][k] for k in PROMPT_USAGE) > 0, "no prompt tokens counted"

    open_block: dict[str, Any] | None = None
    next_index = 0
    finished = False
    for event in rest[1:]:
        kind = event["type"]
        assert kind != "message_start", "second message_start"
        if kind == "error":
            assert event is rest[-1], f"frames after an error: {kinds}"
            assert event["error"]["type"] in ("api_error", "overloaded_error", "timeout_error")
            return "error"
        assert not finished or kind == "message_stop", f"{kind} after message_delta"
        if kind == "content_block_start":
            assert open_block is None, "a block started while another is open"
            assert event["index"] == next_index, f"index {event['index']}, expected {next_index}"
            block = event["content_block"]
            assert block["type"] in DELTA_FOR_BLOCK
            if block["type"] == "tool_use":
                assert block["id"].startswith("toolu_") and block["name"] and block["input"] == {}
            open_block = {"index": event["index"], "type": block["type"], "signed": False}
            next_index += 1
        elif kind == "content_block_delta":
            assert open_block is not None and event["index"] == open_block["index"], (
                "delta outside its block"
            )
            assert not open_block["signed"], "delta after the thinking block's signature_delta"
            if event["delta"]["type"] == "signature_delta":
                assert open_block["type"] == "thinking", "signature_delta outside a thinking block"
                assert isinstance(event["delta"]["signature"], str)
                open_block["signed"] = True
                continue
            assert event["delta"]["type"] == DELTA_FOR_BLOCK[open_block["type"]]
            text = next(v for k, v in event["delta"].items() if k != "type")
            assert isinstance(text, str) and text, "empty delta"
        elif kind == "content_block_stop":
            assert open_block is not None and event["index"] == open_block["index"]
            if open_block["type"] == "thinking":
                assert open_block["signed"], "thinking block closed without a signature_delta"
            open_block = None
        elif kind == "message_delta":
            assert open_block is None, "message_delta with a block open"
            assert event["delta"]["stop_reason"] in (
                "end_turn",
                "max_tokens",
                "stop_sequence",
                "tool_use",
                "pause_turn",
                "refusal",
            )
            assert isinstance(event["usage"]["output_tokens"], int)
            check_usage(event["usage"])
            finished = True
        elif kind == "message_stop":
            assert finished, "message_stop without message_delta"
            assert event is rest[-1], "frames after message_stop"
            return "complete"
        else:
            raise AssertionError(f"unknown event {kind}")
    raise AssertionError(f"stream ended without message_stop or error: {kinds}")
