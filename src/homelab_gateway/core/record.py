"""What the gateway knows of one request as it moves, for its metrics, its log line and the
status page: filled in by the handlers, read by `telemetry` and `snapshot`."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class RequestRecord:
    request_id: str
    surface: str  # a row's name in `core.surfaces.SURFACES`, or proxy
    started: float
    method: str = ""
    path: str = ""
    model: str = ""  # as the client asked: logged (capped), never a label
    served_model: str | None = None  # the configured model that took the request: the label
    upstream: str = ""
    stream: bool = False
    queue_wait: float | None = None
    first_token: float | None = None  # seconds from the upstream request to the first token
    input_tokens: int | None = None  # the whole prompt, cached tokens included
    cached_tokens: int | None = None  # of those, read from the upstream's prefix cache
    output_tokens: int | None = None
    stop_reason: str | None = None
    outcome: str | None = None  # None until known; "completed" if nothing else was said
    status: int | None = None
    upstream_cancelled: bool = False
    client: str = ""  # the key's name, or the peer address without keys; never a key
    priority: str = "normal"  # the class asked for (client's class, lowered by x-priority)
    served_as: str | None = None  # the class the slot was granted as (aging included)
    slot_seconds: float | None = None  # how long this request held its slot
