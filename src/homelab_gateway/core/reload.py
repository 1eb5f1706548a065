"""What a config reload changes, in words for the log: one line per change, secrets never shown.

Plain Python over two Configs (no Twisted), so the wording is tested exhaustively and fast.
The gateway applies every change at once except the two named "restart": the listening
endpoint (the listeners stay open through a reload) and the log format (the log observer is
chosen when twistd starts).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields
from typing import Any

from homelab_gateway.config import Config

SECRET_FIELDS = frozenset({"api_key", "key_sha256"})
RESTART_ONLY = frozenset({"listen", "log_format"})


def config_changes(old: Config, new: Config) -> list[str]:
    """Each difference between `old` and `new`, as `reload` applies it."""
    changes: list[str] = []
    for name in _field_names(old.server):
        before, after = getattr(old.server, name), getattr(new.server, name)
        if before != after:
            note = " (applies at the next restart)" if name in RESTART_ONLY else ""
            changes.append(f"server.{name}: {_show(before)} -> {_show(after)}{note}")
    if old.auth.api_keys != new.auth.api_keys:
        changes.append(f"auth: API keys {_keys(old.auth.api_keys)} -> {_keys(new.auth.api_keys)}")
    if old.auth.protect_metrics != new.auth.protect_metrics:
        changes.append(
            f"auth.protect_metrics: {_show(old.auth.protect_metrics)} -> "
            f"{_show(new.auth.protect_metrics)}"
        )
    changes += _table_changes(
        "upstream",
        old.upstreams,
        new.upstreams,
        added=lambda u: f"(slots {u.slots}, {u.url})",
        removed="takes no new requests, finishes what it holds",
    )
    changes += _table_changes(
        "box",
        old.boxes,
        new.boxes,
        added=lambda b: f"(memory {_show(b.memory)})",
        removed="its upstreams are gone with it",
    )
    changes += _table_changes(
        "model",
        old.models,
        new.models,
        added=lambda m: f"(upstream {'+'.join(m.replicas)})",
    )
    changes += _table_changes(
        "client",
        old.clients,
        new.clients,
        added=lambda c: f"({c.priority}, weight {_show(c.weight)})",
        removed="its key is refused from now on; its waiting requests keep their place",
    )
    if old.queue.aging != new.queue.aging:
        changes.append(f"queue.aging: {_show(old.queue.aging)} -> {_show(new.queue.aging)}")
    if old.cluster != new.cluster:
        # Joining, leaving or moving to another Redis changes who the cap is shared with: a
        # restart, so no slot is counted in two places.
        changes.append("cluster: changed (applies at the next restart)")
    if old.usage != new.usage:
        changes.append("usage: changed (applies at the next restart)")
    changes += _table_changes(
        "route",
        {r.prefix: r for r in old.routes},
        {r.prefix: r for r in new.routes},
        added=lambda r: f"(-> {r.upstream or r.url})",
    )
    return changes


def _table_changes(
    kind: str,
    old: Mapping[str, Any],
    new: Mapping[str, Any],
    *,
    added: Any,
    removed: str = "",
) -> list[str]:
    changes = []
    for name in new:
        if name not in old:
            changes.append(f"{kind} {name!r} added {added(new[name])}")
    for name in old:
        if name not in new:
            changes.append(f"{kind} {name!r} removed" + (f": {removed}" if removed else ""))
    for name in new:
        if name in old and old[name] != new[name]:
            parts = [
                f"{key} changed"
                if key in SECRET_FIELDS
                else f"{key} {_show(getattr(old[name], key))} -> {_show(getattr(new[name], key))}"
                for key in _field_names(new[name])
                if getattr(old[name], key) != getattr(new[name], key)
            ]
            changes.append(f"{kind} {name!r}: " + ", ".join(parts))
    return changes


def _field_names(instance: Any) -> list[str]:
    return [f.name for f in fields(instance)]


def _keys(keys: frozenset[str] | None) -> str:
    return "none (open)" if keys is None else f"{len(keys)} configured"


def _show(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float) and value.is_integer():
        return f"{value:g}"
    if isinstance(value, tuple):
        return "[" + ", ".join(map(repr, value)) + "]"
    return repr(value) if isinstance(value, str) else str(value)
