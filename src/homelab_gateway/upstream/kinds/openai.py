"""Any other OpenAI-compatible server (SGLang, LM Studio, a hosted API): probed by its model
listing, sent nothing beyond OpenAI's API. Its context overflow is recognised in any wording
the other kinds know, since such a server often runs one of their engines."""

from __future__ import annotations

from homelab_gateway.core.errors import ContextOverflow, upstream_message
from homelab_gateway.upstream.kinds import llamacpp, ollama, vllm
from homelab_gateway.upstream.kinds.base import Kind


class OpenAI(Kind):
    name = "openai"

    def overflow(self, body: bytes) -> ContextOverflow | None:
        return (
            vllm.overflow(upstream_message(body))
            or llamacpp.overflow(body)
            or ollama.overflow(body)
        )


OPENAI = OpenAI()
