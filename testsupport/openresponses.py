"""The Open Responses specification's JSON schemas (testsupport/data/openresponses), to check every
event and object /llm/v1/responses sends, and the order a stream's events come in."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

from jsonschema import Draft202012Validator
from jsonschema.exceptions import best_match
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

DOCUMENT = Path(__file__).parent / "data" / "openresponses" / "openapi.json"
BASE = "urn:openresponses"
STREAM = BASE + "#/paths/~1responses/post/responses/200/content/text~1event-stream/schema"
RENAMED = {
    "response.reasoning_text.delta": "response.reasoning.delta",
    "response.reasoning_text.done": "response.reasoning.done",
}
"""OpenAI's names for reasoning text, which Codex and the SDKs read, and the specification's."""
LIFECYCLE = frozenset(
    {
        "response.created",
        "response.queued",
        "response.in_progress",
        "response.completed",
        "response.failed",
        "response.incomplete",
    }
)
TERMINAL = frozenset({"response.completed", "response.failed", "response.incomplete"})


@cache
def _document() -> dict[str, Any]:
    return json.loads(DOCUMENT.read_text())


@cache
def _validator(reference: str) -> Draft202012Validator:
    resource = Resource.from_contents(_document(), default_specification=DRAFT202012)
    registry = Registry().with_resource(BASE, resource)
    return Draft202012Validator({"$ref": reference}, registry=registry)


@cache
def _event_schemas() -> dict[str, str]:
    """Each event type's own schema, for errors that name the field (a `oneOf` names none)."""
    stream = _document()["paths"]["/responses"]["post"]["responses"]["200"]["content"]
    out = {}
    for branch in stream["text/event-stream"]["schema"]["oneOf"]:
        name = branch["$ref"].rsplit("/", 1)[1]
        kind = _document()["components"]["schemas"][name]["properties"]["type"]
        out[kind.get("const") or kind["enum"][0]] = name
    return out


def _check(reference: str, instance: Any, what: str) -> None:
    error = best_match(_validator(reference).iter_errors(instance))
    if error is not None:
        raise AssertionError(f"{what} is not valid at {error.json_path}: {error.message[:300]}")


def check_response(response: dict[str, Any]) -> None:
    """Raise unless `response` is a valid Response object."""
    _check(BASE + "#/components/schemas/ResponseResource", response, "the response")


def check_event(event: dict[str, Any]) -> None:
    """Raise unless `event` is one of the specification's streaming events."""
    event = {**event, "type": RENAMED.get(event["type"], event["type"])}
    name = _event_schemas().get(event["type"])
    assert name is not None, f"{event['type']} is no event of the specification"
    _check(BASE + "#/components/schemas/" + name, event, event["type"])
    _check(STREAM, event, event["type"])


def check_stream(events: list[dict[str, Any]]) -> str:
    """Check a whole stream: each event valid, numbered from 0 up by one, one response id,
    every item added before its deltas and done after them, one terminal event, last.
    Answers the terminal event's type."""
    assert events, "no events"
    assert events[0]["type"] == "response.created", events[0]["type"]
    response_id = events[0]["response"]["id"]
    items: dict[int, str] = {}  # output_index -> "open" | "done"
    for number, event in enumerate(events):
        check_event(event)
        kind = event["type"]
        assert event["sequence_number"] == number, (number, event)
        if kind in LIFECYCLE:
            assert event["response"]["id"] == response_id
            check_response(event["response"])
        if kind in TERMINAL:
            assert number == len(events) - 1, f"{kind} is not last"
        elif kind == "response.output_item.added":
            assert event["output_index"] == len(items), "items are added in order"
            items[event["output_index"]] = "open"
        elif "output_index" in event:
            assert items.get(event["output_index"]) == "open", (kind, event["output_index"])
            if kind == "response.output_item.done":
                items[event["output_index"]] = "done"
    terminal = events[-1]["type"]
    assert terminal in TERMINAL, f"the stream ends with {terminal}"
    open_items = [index for index, state in items.items() if state == "open"]
    if terminal == "response.completed":
        assert not open_items, items
    elif terminal == "response.incomplete" and open_items:
        # Only a call the output limit cut is left open: never given done, never run.
        [index] = open_items
        assert index == len(items) - 1, items
        item = events[-1]["response"]["output"][index]
        assert item["type"] in ("function_call", "custom_tool_call"), item
        assert item["status"] == "incomplete", item
    return terminal
