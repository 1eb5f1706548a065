"""The interface every upstream kind implements (`Kind`), with the defaults of any
OpenAI-compatible server."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from homelab_gateway.core.errors import ContextOverflow


@dataclass(frozen=True)
class Health:
    """What one health probe said: whether the server can take requests, and if not why."""

    ok: bool
    detail: str


def root(url: str) -> str:
    """The server's own root, where its non-OpenAI endpoints live beside `/v1`."""
    return url.removesuffix("/v1")


class Kind:
    """Any OpenAI-compatible server, with nothing sent beyond OpenAI's API: the defaults a kind
    overrides. Its probe is its model listing, which every such server serves and which loads
    nothing."""

    name: str
    """Its name in the config (`[upstreams.NAME] kind`)."""
    continuous_usage_stats = False
    """Takes `stream_options.continuous_usage_stats` (usage in every chunk: the exact prompt
    count reaches `message_start`)."""
    priority: Mapping[str, int] | None = None
    """The `priority` request field for each class the line serves, where the server takes one
    (`forward_priority`)."""

    def probe(self, url: str) -> str:
        """The URL a health probe GETs, for an upstream at `url`."""
        return url + "/models"

    def health(self, status: int, body: bytes) -> Health:
        """What the probe's answer (`status`, `body`) says."""
        return answered(status == 200, "GET /models", status)

    def listing(self, url: str) -> str | None:
        """The URL of a model listing that states each model's window, if the server has one."""
        return None

    def windows(self, body: bytes) -> dict[str, int]:
        """{model: window in tokens} from the `listing` answer."""
        return {}

    def tokenize(self, url: str, body: Mapping[str, Any]) -> tuple[str, bytes] | None:
        """The request (URL, JSON body) that counts the prompt of upstream chat request `body`,
        if the server has one: it takes no generation slot."""
        return None

    def counted(self, body: bytes) -> tuple[int | None, int | None]:
        """The prompt's token count and the model's window from a `tokenize` answer."""
        return None, None

    def overflow(self, body: bytes) -> ContextOverflow | None:
        """The context overflow an error body reports, with the numbers it gives; None for any
        other error."""
        return None


def answered(ok: bool, request: str, status: int, why: str = "") -> Health:
    """A probe's `Health`: "ok", else what `request` answered."""
    if ok:
        return Health(True, "ok")
    return Health(False, f"{request} answered {status}" + (f": {why}" if why else ""))
