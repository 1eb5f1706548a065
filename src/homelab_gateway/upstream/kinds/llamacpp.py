"""llama.cpp's server (`llama-server`).

It opens its port at once and answers every request, `GET /health` too, with 503 "Loading
model" until its model is loaded, then `/health` with 200. A prompt over the window is refused as
an `exceed_context_size_error` with both numbers beside the message (older builds: the message
alone, with no number). Its `/tokenize` takes text, not chat messages, so a prompt is not
counted there; it takes none of vLLM's extensions.
"""

from __future__ import annotations

import json
import re
from typing import Any

from homelab_gateway.core.errors import ContextOverflow, upstream_message
from homelab_gateway.upstream.kinds.base import Health, Kind, answered, root

_WITH_NUMBERS = re.compile(
    r"request \((\d+) tokens\) exceeds the available context size \((\d+) tokens\)"
)
_WORDS = "exceeds the available context size"


def _error_object(body: bytes) -> dict[str, Any]:
    try:
        document = json.loads(body)
    except ValueError:
        return {}
    error = document.get("error") if isinstance(document, dict) else None
    return error if isinstance(error, dict) else {}


def overflow(body: bytes) -> ContextOverflow | None:
    """llama.cpp's context overflow in an error `body`, with the numbers it gives."""
    error = _error_object(body)
    typed = error.get("type") == "exceed_context_size_error"
    prompt, limit = error.get("n_prompt_tokens"), error.get("n_ctx")
    if typed and isinstance(prompt, int) and isinstance(limit, int):
        return ContextOverflow(prompt_tokens=prompt, limit=limit)
    message = upstream_message(body)
    if match := _WITH_NUMBERS.search(message):
        return ContextOverflow(int(match[1]), int(match[2]))
    if typed or _WORDS in message:
        return ContextOverflow(None, None)
    return None


class LlamaCpp(Kind):
    name = "llama.cpp"

    def probe(self, url: str) -> str:
        return root(url) + "/health"

    def health(self, status: int, body: bytes) -> Health:
        why = upstream_message(body) if status == 503 else ""  # "Loading model"
        return answered(status == 200, "GET /health", status, why)

    def overflow(self, body: bytes) -> ContextOverflow | None:
        return overflow(body)


LLAMA_CPP = LlamaCpp()
