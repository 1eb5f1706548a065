"""Upstream kinds: what the gateway knows about each sort of OpenAI-compatible server.

Every upstream serves OpenAI's chat completions; a kind (`[upstreams.NAME] kind`) holds what
differs between servers (`base.Kind`): how its health is probed, which model listing states each
model's window, where it counts a prompt's tokens, how it words a context overflow, and which of
vLLM's extensions it takes. A kind is plain Python with no I/O, so the config checks names
against `KINDS` and its parsing is tested on bodies alone; the Twisted layer sends the requests
it describes (`upstream.readiness`, the surfaces' tokenize).

What any server may send is read whatever the kind, because servers rename it between versions:
reasoning as `reasoning` or `reasoning_content`, cached prompt tokens as
`prompt_tokens_details.cached_tokens` or llama.cpp's `timings.cache_n` (`core.translator`).

A new kind is a module here with a subclass of `Kind` that overrides what differs, its line in
`KINDS`, its tests (tests/upstream/test_kinds.py) and its row in docs/configuration.md.
"""

from __future__ import annotations

from homelab_gateway.upstream.kinds.base import Health, Kind
from homelab_gateway.upstream.kinds.llamacpp import LLAMA_CPP
from homelab_gateway.upstream.kinds.ollama import OLLAMA
from homelab_gateway.upstream.kinds.openai import OPENAI
from homelab_gateway.upstream.kinds.vllm import VLLM

KINDS: dict[str, Kind] = {kind.name: kind for kind in (VLLM, LLAMA_CPP, OLLAMA, OPENAI)}
"""Every kind by its config name."""
DEFAULT_KIND = VLLM.name

__all__ = ["DEFAULT_KIND", "KINDS", "Health", "Kind"]
