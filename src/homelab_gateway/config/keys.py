"""How a config key is read: each dataclass field of a table says which key it comes from,
its default and its check, so a table is read from its dataclass and a default is written once.

`Table.read()` reads every field that carries a reader (`seconds`, `integer`, ...), in
declaration order; a field marked `derived("key", ...)` names keys its table's parser reads
itself (a key from the environment, a URL split into parts); a field with neither is no key.
Every mistake is one `ConfigError` line naming the key; a value it shows goes through
`describe`, which masks a URL's password.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import MISSING, Field, field, fields
from typing import Any
from urllib.parse import urlsplit

Check = Callable[[Any], str | None]  # a value's problem, worded for the error line, or None
READ = "read"  # field metadata: (table, key, default) -> value
KEYS = "keys"  # field metadata: the TOML keys a derived field comes from


class ConfigError(Exception):
    """A user mistake in the configuration, worded for a person reading one log line."""


def mask(value: str) -> str:
    """`value` with the password of a URL in it (`scheme://user:password@host`, or a bare
    `user:password@host`) as `***`; with no `:` before the `@`, all of what precedes it."""
    scheme, sep, rest = value.partition("://")
    if not sep:
        scheme, rest = "", value
    userinfo, at, host = rest.rpartition("@")
    if not at:
        return value
    user = userinfo.partition(":")[0] + ":" if ":" in userinfo else ""
    return f"{scheme}{sep}{user}***@{host}"


def describe(value: Any) -> str:
    """A value as an error line shows it, which goes to the terminal and the log: never with
    a URL's password."""
    if isinstance(value, dict):
        return "a table"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, str):
        return repr(mask(value))
    return repr(value)


class Table:
    """Reads one TOML table, remembering its dotted path so errors can name the exact key."""

    def __init__(self, source: str, path: str, table: Any, cls: type | None = None) -> None:
        """With `cls`, a key that none of its fields names is refused at once."""
        self.source = source
        self.path = path
        if not isinstance(table, dict):
            raise self.error("", f"must be a table, got {describe(table)}")
        self.table: dict[str, Any] = table
        self.cls = cls
        if cls is not None:
            self.reject_unknown(known_keys(cls))

    def key(self, name: str) -> str:
        return f"{self.path}.{name}" if self.path else name

    def error(self, name: str, message: str) -> ConfigError:
        where = self.key(name) if name else self.path
        return ConfigError(f"{self.source}: {where}: {message}")

    def reject_unknown(self, allowed: set[str]) -> None:
        for name in self.table:
            if name not in allowed:
                known = ", ".join(sorted(allowed))
                raise self.error(name, f"unknown key (known keys: {known})")

    def read(self, defaults: Mapping[str, Any] | None = None, **given: Any) -> Any:
        """The table's dataclass built from it: `given` fields as they are, every field with a
        reader read from its key (its default from `defaults`, else the field's own)."""
        assert self.cls is not None
        values = dict(given)
        for f in fields(self.cls):
            read = f.metadata.get(READ)
            if read is not None and f.name not in given:
                default = (defaults or {}).get(f.name, _default(f))
                values[f.name] = read(self, f.name, default)
        return self.cls(**values)

    def string(self, name: str, default: Any = None) -> Any:
        """The string at `name`; `default` MISSING makes the key required."""
        value = self.table.get(name, default)
        if value is MISSING:
            raise self.error(name, "is required")
        if value is None:
            return None
        if not isinstance(value, str) or not value:
            raise self.error(name, f"must be a non-empty string, got {describe(value)}")
        return value

    def integer(self, name: str, default: Any = None, *, minimum: int = 1) -> Any:
        """The integer >= `minimum` at `name`; `default` MISSING makes the key required."""
        value = self.table.get(name, default)
        if value is MISSING:
            raise self.error(name, "is required")
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise self.error(name, f"must be an integer >= {minimum}, got {describe(value)}")
        return value


def known_keys(cls: type) -> set[str]:
    """The TOML keys the fields of `cls` are read from."""
    keys: set[str] = set()
    for f in fields(cls):
        if READ in f.metadata:
            keys.add(f.name)
        keys.update(f.metadata.get(KEYS, ()))
    return keys


def _default(f: Field[Any]) -> Any:
    if f.default_factory is not MISSING:
        return f.default_factory()
    return f.default


def _field(read: Callable[[Table, str, Any], Any], default: Any, **options: Any) -> Any:
    """A dataclass field read by `read`; without a default, its key is required."""
    if default is MISSING:
        return field(metadata={READ: read}, **options)
    if isinstance(default, dict):
        return field(default_factory=lambda: dict(default), metadata={READ: read}, **options)
    return field(default=default, metadata={READ: read}, **options)


def derived(*keys: str, default: Any = MISSING, **options: Any) -> Any:
    """A field its table's parser computes from `keys` (none: from no key at all)."""
    if default is MISSING:
        return field(metadata={KEYS: keys}, **options)
    return field(default=default, metadata={KEYS: keys}, **options)


def string(default: Any = MISSING, *, check: Check | None = None) -> Any:
    """A non-empty string; `check` adds what else it must be."""

    def read(table: Table, name: str, default: Any) -> Any:
        value = table.string(name, default)
        problem = check(value) if check is not None and value is not None else None
        if problem is not None:
            raise table.error(name, problem)
        return value

    return _field(read, default)


def choice(choices: tuple[str, ...], default: Any = MISSING) -> Any:
    """One of `choices`."""

    def check(value: str) -> str | None:
        if value in choices:
            return None
        if len(choices) == 2:
            return f"must be {choices[0]!r} or {choices[1]!r}, got {describe(value)}"
        return f"must be one of {', '.join(choices)}, got {describe(value)}"

    return string(default, check=check)


def integer(default: Any = MISSING, *, minimum: int = 1) -> Any:
    """An integer >= `minimum`; a default of None makes the key optional."""

    def read(table: Table, name: str, default: Any) -> Any:
        return table.integer(name, default, minimum=minimum)

    return _field(read, default)


def is_number(value: Any) -> bool:
    """A finite integer or float. TOML's booleans are no numbers here, nor are nan (it
    compares false with everything a timer or a share does) and inf (no setting takes it as
    "never": docs/configuration.md)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    return math.isfinite(value)


def seconds(default: float, *, zero: bool = False) -> Any:
    """A positive, finite number of seconds; with `zero`, 0 too (each such key says what its
    0 means)."""

    def read(table: Table, name: str, default: float) -> float:
        value = table.table.get(name, default)
        if not is_number(value) or not (value > 0 or (zero and value == 0)):
            shape = "a number of seconds >= 0" if zero else "a positive number of seconds"
            raise table.error(name, f"must be {shape}, got {describe(value)}")
        return float(value)

    return _field(read, default)


def number(default: Any, *, check: Check) -> Any:
    """A number, as float; `check` says what else it must be (and refuses what is none). A
    default of None makes the key optional."""

    def read(table: Table, name: str, default: float | None) -> float | None:
        value = table.table.get(name, default)
        if value is MISSING:
            raise table.error(name, "is required")
        if value is None:
            return None
        problem = check(value)
        if problem is not None:
            raise table.error(name, problem)
        return float(value)

    return _field(read, default)


def argv(default: tuple[str, ...] | None = None) -> Any:
    """A command as a non-empty array of strings, run as it is (no shell)."""

    def read(table: Table, name: str, default: Any) -> tuple[str, ...] | None:
        value = table.table.get(name, default)
        if value is None:
            return None
        if not isinstance(value, list | tuple) or not value:
            raise table.error(name, f"must be a non-empty array of strings, got {describe(value)}")
        if not all(isinstance(v, str) for v in value) or not value[0]:
            raise table.error(name, "must be an array of strings, the program first")
        return tuple(value)

    return _field(read, default)


def boolean(default: bool) -> Any:
    def read(table: Table, name: str, default: bool) -> bool:
        value = table.table.get(name, default)
        if not isinstance(value, bool):
            raise table.error(name, f"must be true or false, got {describe(value)}")
        return value

    return _field(read, default)


def subtable(default: dict[str, Any]) -> Any:
    """A TOML table, taken as it is."""

    def read(table: Table, name: str, default: dict[str, Any]) -> dict[str, Any]:
        value = table.table.get(name, default)
        if not isinstance(value, dict):
            raise table.error(name, f"must be a table, got {describe(value)}")
        return value

    return _field(read, default)


def strings(*, shape: str, check: Check) -> Any:
    """An array of strings (`shape` says which, when it is not one), each passing `check`."""

    def read(table: Table, name: str, default: tuple[str, ...]) -> tuple[str, ...]:
        value = table.table.get(name, list(default))
        if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
            raise table.error(name, f"must be an array of {shape}")
        for item in value:
            problem = check(item)
            if problem is not None:
                raise table.error(name, problem)
        return tuple(value)

    return _field(read, ())


def http_url(default: Any = MISSING) -> Any:
    """An http:// or https:// base URL, without a trailing slash, query, fragment or user."""

    def read(table: Table, name: str, default: Any) -> Any:
        value = table.string(name, default)
        if value is None:
            return None
        shown = describe(value)
        parts = urlsplit(value)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise table.error(name, f"must be an http:// or https:// URL, got {shown}")
        try:
            parts.port  # noqa: B018 - urlsplit validates the port lazily
        except ValueError:
            raise table.error(name, f"has a bad port: {shown}") from None
        if parts.query or parts.fragment:
            raise table.error(name, f"must not have a query or fragment, got {shown}")
        if "@" in parts.netloc:
            # Sent as it is, user:password@ is no host: every request would fail with 502.
            raise table.error(
                name,
                f"must not hold a user or password (the gateway sends no Basic auth), got {shown}",
            )
        return value.rstrip("/")

    return _field(read, default)
