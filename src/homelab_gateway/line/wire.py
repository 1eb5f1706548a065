"""What a line shared through Redis carries of a request, in its stream and its hashes.

A waiter's request goes to Redis as a small JSON object (`info`), stored with the waiter and
with the slot it is granted, and every gateway's copy reads it back (`request_of`, `grant_of`):
what the line orders by (its client, its class) and what it may take (replicas, session). A
new field the order needs is written and read here alone.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import orjson

from homelab_gateway.core.dispatch import Dispatch, Replica
from homelab_gateway.core.line import Grant
from homelab_gateway.line.limiter import PositionListener, Request


def info(request: Request) -> bytes:
    """What the stream carries of a waiter's request: client, class, replicas, session."""
    want = request.want
    fields: dict[str, Any] = {"c": request.client, "k": request.rank}
    if want is not None:
        if want.among is not None:
            fields["a"] = sorted(m.name for m in want.among)
        if want.avoid:
            fields["v"] = sorted(m.name for m in want.avoid)
        if want.session is not None:
            fields["s"] = want.session
    if request.retry:
        fields["f"] = 1
    return orjson.dumps(fields)


def grant_info(grant: Grant) -> bytes:
    """What a slot learnt whole carries of its request: its client and class."""
    return orjson.dumps({"c": grant.client, "k": grant.rank})


def preferences(ranked: Sequence[Replica]) -> bytes:
    """The replicas a script may take a slot on, in order, as it reads them: [name, slots, ...]."""
    return orjson.dumps([x for m in ranked for x in (m.name, m.limit)])


def request_of(
    raw: str | bytes, dispatch: Dispatch[Any], listener: PositionListener | None
) -> Request:
    """A waiter's request as the stream carries it, told to `listener` (this gateway's)."""
    fields = orjson.loads(raw)
    members = dispatch.members
    names = fields.get("a")
    among = None if names is None else frozenset(m for m in members if m.name in names)
    avoid = frozenset(m for m in members if m.name in fields.get("v", ()))
    want = dispatch.want(among, avoid, fields.get("s"))
    return Request(fields["c"], fields["k"], want, bool(fields.get("f")), listener)


def grant_of(raw: str | bytes, charged: float = 0.0) -> Grant:
    """The grant of a slot whose request's info is `raw`: its client and class."""
    fields: Mapping[str, Any] = orjson.loads(raw)
    return Grant(fields["c"], fields["k"], charged)
