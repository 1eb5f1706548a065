"""The surfaces under /llm, in one table: each one's paths, error shape, and the name its
request record carries into usage, metrics and the log. Routing, the refusals the channel
makes before any route (413, 431, 408), the ledger and the service all read it, so a new
surface is its module, a row here, its tests and its docs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Shape = Literal["anthropic", "openai", "plain"]
"""How an error is written: Anthropic's, OpenAI's, or the gateway's plain one (proxy routes,
the status page)."""


@dataclass(frozen=True, slots=True)
class SurfaceRow:
    name: str  # the request record's `surface`: the ledger's, the metrics' and the log's
    paths: tuple[bytes, ...]  # exact paths, routed to it alone
    shape: Shape
    surface: str  # `module:Class` of homelab_gateway.surfaces that answers it
    counted: bool = True  # the ledger counts it (a surface that generates)


SURFACES = (
    SurfaceRow("messages", (b"/llm/v1/messages",), "anthropic", "messages:Messages"),
    SurfaceRow(
        "count_tokens",
        (b"/llm/v1/messages/count_tokens",),
        "anthropic",
        "messages:CountTokens",
        counted=False,
    ),
    SurfaceRow("chat", (b"/llm/v1/chat/completions",), "openai", "openai:OpenAISurface"),
    SurfaceRow("completions", (b"/llm/v1/completions",), "openai", "openai:OpenAISurface"),
    SurfaceRow("embeddings", (b"/llm/v1/embeddings",), "openai", "openai:OpenAISurface"),
    SurfaceRow("responses", (b"/llm/v1/responses",), "openai", "responses:ResponsesSurface"),
)
SHAPES = {path: row.shape for row in SURFACES for path in row.paths}
"""Each surface path's error shape."""
