"""Ollama, whose OpenAI API is under `/v1`.

`GET /` answers "Ollama is running" (a probe that loads no model; the model listing also
loads none, but any OpenAI server has one). It loads a model on its first request, so a cold
request's headers come late (`connect_timeout`). Its refusals of a prompt over the window carry
no number: "the input length exceeds the context length" (its own runner), "the prompt is longer
than the context length ..." (with no context shift), or the error of the llama.cpp server it
runs, relayed as its message. It has no tokenize endpoint and takes none of vLLM's extensions.
"""

from __future__ import annotations

from homelab_gateway.core.errors import ContextOverflow, upstream_message
from homelab_gateway.upstream.kinds import llamacpp
from homelab_gateway.upstream.kinds.base import Health, Kind, answered, root

RUNNING = b"Ollama is running"
_WORDINGS = (
    "the input length exceeds the context length",
    "the prompt is longer than the context length",
)


def overflow(body: bytes) -> ContextOverflow | None:
    """Ollama's context overflow in an error `body`, with the numbers it gives."""
    message = upstream_message(body)
    if any(words in message for words in _WORDINGS):
        return ContextOverflow(None, None)
    return llamacpp.overflow(message.encode())


class Ollama(Kind):
    name = "ollama"

    def probe(self, url: str) -> str:
        return root(url) + "/"

    def health(self, status: int, body: bytes) -> Health:
        if status == 200 and RUNNING not in body:
            return Health(False, "GET / answered, but not as Ollama does")
        return answered(status == 200, "GET /", status)

    def overflow(self, body: bytes) -> ContextOverflow | None:
        return overflow(body)


OLLAMA = Ollama()
