"""vLLM (`vllm serve`): the default kind, and the one with extensions the gateway uses.

`GET /health` (beside `/v1`) answers 200 once the engine runs and 503 when it died, while its
model listing would still answer; `/v1/models` states each model's window (`max_model_len`);
`POST /tokenize` counts a chat prompt exactly, in its API server rather than its engine. It
takes `continuous_usage_stats` and, started with `--scheduling-policy priority`, a `priority`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from homelab_gateway.core.errors import ContextOverflow, upstream_message
from homelab_gateway.core.text import dumps
from homelab_gateway.upstream.kinds.base import Health, Kind, answered, root

_N = r"(\d+)"
# vLLM's wordings, newest first. 0.2x-0.32 (renderer): both numbers, the prompt counted only up
# to the room left ("at least"); early 2026: "You passed N input tokens and requested B output
# tokens", the same cut-off count; 0.6-0.10: "your prompt contains at least N" / "your request
# has N"; the max_tokens check; the oldest "you requested T tokens (A in the messages, ...)".
_TOTAL = re.compile(
    rf"maximum context length is {_N} tokens\. However, you requested {_N} output tokens and "
    rf"your prompt contains at least {_N} input tokens"
)
_PASSED = re.compile(
    rf"You passed {_N} input (tokens|characters)(?: and requested {_N} output tokens)?\. "
    rf"However, the model's context length is only {_N} tokens"
)
_PROMPT = re.compile(
    rf"maximum context length is {_N} tokens\. However, your (?:prompt contains|request has) "
    rf"(at least )?{_N} input tokens"
)
_MAX_TOKENS = re.compile(
    rf"'max_tokens' (?:or 'max_completion_tokens' )?is too large: {_N}\. This model's maximum "
    rf"context length is {_N} tokens and your request has {_N} input tokens"
)
_REQUESTED = re.compile(
    rf"maximum context length is {_N} tokens\. However, you requested {_N} tokens "
    rf"\({_N} in the messages, {_N} in the completion\)"
)
_REQUESTED_PROMPT = re.compile(
    rf"maximum context length is {_N} tokens\. However, you requested {_N} tokens in the messages"
)


def overflow(message: str) -> ContextOverflow | None:
    """vLLM's context overflow in an error `message`, with the numbers it gives."""
    if match := _TOTAL.search(message):
        limit, completion, prompt = map(int, match.groups())
        return ContextOverflow(prompt, limit, completion or None, at_least=True)
    if match := _PASSED.search(message):
        count, unit, completion, limit = match.groups()
        prompt = int(count) if unit == "tokens" else None  # characters: no token count
        return ContextOverflow(
            prompt, int(limit), int(completion) if completion else None, at_least=True
        )
    if match := _MAX_TOKENS.search(message):
        completion, limit, prompt = map(int, match.groups())
        return ContextOverflow(prompt, limit, completion)
    if match := _PROMPT.search(message):
        return ContextOverflow(int(match[3]), int(match[1]), at_least=bool(match[2]))
    if match := _REQUESTED.search(message):
        limit, _, prompt, completion = map(int, match.groups())
        return ContextOverflow(prompt, limit, completion)
    if match := _REQUESTED_PROMPT.search(message):
        return ContextOverflow(int(match[2]), int(match[1]))
    return None


def _count(value: Any, least: int) -> int | None:
    """`value` if it is a whole number of at least `least`."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= least:
        return value
    return None


class Vllm(Kind):
    name = "vllm"
    continuous_usage_stats = True
    # Lower is served earlier; 0 is its default (and what requests that bypass the gateway
    # get), so `normal` is 0.
    priority = {"interactive": -1, "normal": 0, "batch": 1}

    def probe(self, url: str) -> str:
        return root(url) + "/health"

    def health(self, status: int, body: bytes) -> Health:
        return answered(status == 200, "GET /health", status)

    def listing(self, url: str) -> str | None:
        return url + "/models"

    def windows(self, body: bytes) -> dict[str, int]:
        try:
            data = json.loads(body).get("data")
        except (ValueError, AttributeError):
            return {}
        windows: dict[str, int] = {}
        for entry in data if isinstance(data, list) else ():
            if isinstance(entry, dict) and isinstance(entry.get("id"), str):
                size = _count(entry.get("max_model_len"), 1)
                if size is not None:
                    windows[entry["id"]] = size
        return windows

    def tokenize(self, url: str, body: Mapping[str, Any]) -> tuple[str, bytes] | None:
        payload = {
            "model": body["model"],
            "messages": body["messages"],
            "add_generation_prompt": True,
        }
        if "tools" in body:
            payload["tools"] = body["tools"]
        return root(url) + "/tokenize", dumps(payload)

    def counted(self, body: bytes) -> tuple[int | None, int | None]:
        try:
            answer = json.loads(body)
        except ValueError:
            return None, None
        if not isinstance(answer, dict):
            return None, None
        return _count(answer.get("count"), 0), _count(answer.get("max_model_len"), 1)

    def overflow(self, body: bytes) -> ContextOverflow | None:
        return overflow(upstream_message(body))


VLLM = Vllm()
