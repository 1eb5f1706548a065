"""Reading the file: TOML into the tables' dataclasses (tables.py), plus what no single key's
check can say: keys from the environment, the Redis URL, replicas, names, keys used twice.

Nothing here touches the network or the reactor.
"""

from __future__ import annotations

import hashlib
import ipaddress
import os
import re
import socket
import tomllib
from collections.abc import Mapping
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from homelab_gateway.config.keys import ConfigError, Table, describe
from homelab_gateway.config.tables import (
    PRIORITY_KINDS,
    AuthConfig,
    BoxConfig,
    ClientConfig,
    ClusterConfig,
    Config,
    ModelConfig,
    QueueConfig,
    RouteConfig,
    ServerConfig,
    UpstreamConfig,
    UsageConfig,
)

CLIENT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


def load_config(
    path: str | os.PathLike[str], *, environ: Mapping[str, str] | None = None
) -> Config:
    """Read and validate the file at `path`; raise ConfigError naming the first problem."""
    source = str(path)
    try:
        raw = Path(path).read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"{source}: file not found") from None
    except OSError as e:
        raise ConfigError(f"{source}: cannot read: {e.strerror}") from None
    try:
        document = tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise ConfigError(f"{source}: not UTF-8 text") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{source}: invalid TOML: {e}") from None
    return parse_config(document, source=source, environ=os.environ if environ is None else environ)


def parse_config(
    document: Mapping[str, Any], *, source: str = "<config>", environ: Mapping[str, str]
) -> Config:
    top = Table(source, "", dict(document))
    top.reject_unknown({f.name for f in fields(Config)})

    def table(path: str, cls: type | None = None) -> Table:
        return Table(source, path, top.table.get(path, {}), cls)

    def named(path: str, cls: type) -> dict[str, Table]:
        """The tables of `[path.NAME]`, by NAME."""
        tables = table(path).table.items()
        return {name: Table(source, f"{path}.{_quote(name)}", raw, cls) for name, raw in tables}

    server = table("server", ServerConfig).read()
    clients = _parse_clients(named("clients", ClientConfig), environ)
    auth = _parse_auth(table("auth", AuthConfig), environ, client_keys=bool(clients))
    queue = table("queue", QueueConfig).read()
    boxes = {name: box.read(name=name) for name, box in named("boxes", BoxConfig).items()}
    upstreams = {
        name: _parse_upstream(name, upstream, environ, boxes)
        for name, upstream in named("upstreams", UpstreamConfig).items()
    }
    models = {
        name: _parse_model(name, model, upstreams)
        for name, model in named("models", ModelConfig).items()
    }
    raw_routes = top.table.get("routes", [])
    if not isinstance(raw_routes, list):
        raise top.error("routes", "must be an array of tables ([[routes]])")
    routes = tuple(
        _parse_route(Table(source, f"routes[{i}]", raw, RouteConfig), upstreams)
        for i, raw in enumerate(raw_routes)
    )
    prefixes = [route.prefix for route in routes]
    for i, prefix in enumerate(prefixes):
        if prefix in prefixes[:i]:
            raise ConfigError(f"{source}: routes[{i}].prefix: {prefix!r} is used by another route")
    cluster = None
    if "cluster" in top.table:
        cluster = _parse_cluster(table("cluster", ClusterConfig), server, environ)
        managed = [name for name, upstream in upstreams.items() if upstream.managed]
        if managed:
            raise top.error(
                "cluster",
                f"upstream {managed[0]!r} is loaded on demand, which one gateway alone decides "
                "(docs/operations.md, 'Models loaded on demand'): no [cluster] with it",
            )
    return Config(
        server=server,
        upstreams=upstreams,
        models=models,
        boxes=boxes,
        routes=routes,
        auth=auth,
        clients=clients,
        queue=queue,
        cluster=cluster,
        usage=table("usage", UsageConfig).read(),
    )


def _quote(name: str) -> str:
    bare = name.replace("-", "").replace("_", "").isalnum()
    return name if bare else f'"{name}"'


def _secret(table: Table, key: str, environ: Mapping[str, str]) -> str | None:
    """The value of the environment variable that `key` names, if it is given."""
    name = table.string(key)
    if name is None:
        return None
    if name not in environ:
        raise table.error(key, f"environment variable {name} is not set")
    return environ[name]


def _parse_upstream(
    name: str, table: Table, environ: Mapping[str, str], boxes: Mapping[str, BoxConfig]
) -> UpstreamConfig:
    api_key = None
    key_env = table.string("api_key_env")
    if key_env is not None:
        api_key = environ.get(key_env)
        if not api_key:
            raise table.error("api_key_env", f"environment variable {key_env} is not set")
    upstream = table.read(name=name, api_key=api_key)
    if upstream.forward_priority and upstream.kind not in PRIORITY_KINDS:
        raise table.error("forward_priority", f"kind {upstream.kind!r} takes no priority field")
    _check_managed(table, upstream, boxes)
    return upstream


MANAGED = "a managed upstream (with `start` or `sleep_mode`)"


def _check_managed(table: Table, upstream: UpstreamConfig, boxes: Mapping[str, BoxConfig]) -> None:
    """A managed upstream names its box and its memory, and fits in that box."""
    if not upstream.managed:
        for key in ("box", "memory", "stop", "load_timeout", "stop_timeout", "idle_unload"):
            if key in table.table:
                raise table.error(key, f"only for {MANAGED}")
        return
    if upstream.start is not None and upstream.sleep_mode:
        raise table.error("sleep_mode", "give either `start` or `sleep_mode`, not both")
    if upstream.stop is not None and upstream.start is None:
        raise table.error("stop", "only with `start`")
    if upstream.box is None:
        raise table.error("box", f"is required for {MANAGED}")
    if upstream.box not in boxes:
        known = ", ".join(sorted(boxes)) or "none are configured"
        raise table.error("box", f"names unknown box {upstream.box!r} (known: {known})")
    if upstream.memory is None:
        raise table.error("memory", f"is required for {MANAGED}")
    box = boxes[upstream.box]
    if upstream.memory > box.memory:
        raise table.error(
            "memory", f"{upstream.memory:g} is more than box {box.name!r} holds ({box.memory:g})"
        )


def _known_upstream(table: Table, upstreams: Mapping[str, UpstreamConfig]) -> str:
    name = table.string("upstream", MISSING)
    if name not in upstreams:
        known = ", ".join(sorted(upstreams)) or "none are configured"
        raise table.error("upstream", f"names unknown upstream {name!r} (known: {known})")
    return name


def _parse_model(name: str, table: Table, upstreams: Mapping[str, UpstreamConfig]) -> ModelConfig:
    if "*" in name and "upstream_model" not in table.table:
        raise table.error(
            "upstream_model", "is required for a name pattern (the pattern is no model's name)"
        )
    replicas = _replicas(table, upstreams)
    return table.read(
        {"upstream_model": name},
        name=name,
        upstream=replicas[0],
        upstreams=replicas,
        upstream_models=_upstream_models(table, replicas),
    )


def _replicas(table: Table, upstreams: Mapping[str, UpstreamConfig]) -> tuple[str, ...]:
    """`upstreams = [...]` (replicas) or `upstream = "x"` (one), never both."""
    if "upstreams" not in table.table:
        return (_known_upstream(table, upstreams),)
    if "upstream" in table.table:
        raise table.error("upstreams", "give either 'upstream' or 'upstreams', not both")
    names = table.table["upstreams"]
    if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
        raise table.error("upstreams", "must be a non-empty array of upstream names")
    for name in names:
        if name not in upstreams:
            known = ", ".join(sorted(upstreams)) or "none are configured"
            raise table.error("upstreams", f"names unknown upstream {name!r} (known: {known})")
    if len(set(names)) != len(names):
        raise table.error("upstreams", "names an upstream twice")
    return tuple(names)


def _upstream_models(table: Table, replicas: tuple[str, ...]) -> dict[str, str]:
    names = table.table.get("upstream_models", {})
    if not isinstance(names, dict) or not all(isinstance(v, str) and v for v in names.values()):
        raise table.error("upstream_models", 'must be a table of upstream = "model name"')
    for upstream in names:
        if upstream not in replicas:
            raise table.error(
                "upstream_models", f"{upstream!r} is not one of this model's upstreams"
            )
    return dict(names)


def _parse_route(table: Table, upstreams: Mapping[str, UpstreamConfig]) -> RouteConfig:
    if ("upstream" in table.table) == ("url" in table.table):
        raise table.error("", "needs exactly one of 'upstream' or 'url'")
    if "url" in table.table:
        return table.read()
    upstream = upstreams[_known_upstream(table, upstreams)]
    timeouts = {"connect_timeout": upstream.connect_timeout, "idle_timeout": upstream.idle_timeout}
    return table.read(timeouts, upstream=upstream.name)


def auth_key_name(key: str) -> str:
    """The name an `[auth]` key goes by in logs, metrics and status: stable across restarts and
    reloads, distinct per key, and not the key (8 hex digits of its SHA-256)."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:8]


def _parse_auth(table: Table, environ: Mapping[str, str], *, client_keys: bool) -> AuthConfig:
    keys: set[str] = set()
    configured = False
    env_name = table.string("api_keys_env")
    if env_name is not None:
        configured = True
        keys.update(k.strip() for k in environ.get(env_name, "").split(",") if k.strip())
    file_name = table.string("api_keys_file")
    if file_name is not None:
        configured = True
        try:
            lines = Path(file_name).read_text().splitlines()
        except OSError as e:
            raise table.error("api_keys_file", f"cannot read {file_name}: {e.strerror}") from None
        keys.update(k.strip() for k in lines if k.strip() and not k.lstrip().startswith("#"))
    if configured and not keys:
        # Keys were asked for but none were found: fail closed rather than run open.
        where = " or ".join(f for f in (env_name, file_name) if f)
        raise table.error("", f"no API keys found in {where}")
    auth = table.read(api_keys=frozenset(keys) if configured else None)
    if auth.protect_metrics and not configured and not client_keys:
        # The operator asked for protection that cannot exist without keys; running open
        # would hide that /llm and every route are open too. Any key, [auth]'s or a
        # client's, opens what it protects.
        raise table.error(
            "protect_metrics",
            "needs API keys (api_keys_env or api_keys_file) or [clients]; "
            "without them everything is open",
        )
    return auth


def _is_address(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def _parse_clients(tables: dict[str, Table], environ: Mapping[str, str]) -> dict[str, ClientConfig]:
    clients: dict[str, ClientConfig] = {}
    seen: dict[bytes, str] = {}
    for name, client in tables.items():
        if not CLIENT_NAME.fullmatch(name) or name.startswith("key-") or _is_address(name):
            raise client.error(
                "",
                "a client name is 1-64 letters, digits, '_', '.', '-', is no IP address (those "
                "name key-less clients) and does not start with 'key-' (names of [auth] keys)",
            )
        digest = _client_key(client, environ)
        if digest in seen:
            raise client.error("", f"has the same key as client {seen[digest]!r}")
        seen[digest] = name
        clients[name] = client.read(name=name, key_sha256=digest)
    return clients


def _client_key(client: Table, environ: Mapping[str, str]) -> bytes:
    """The SHA-256 of the client's key: from `key_env`'s variable, or as `key_sha256` gives it."""
    has_env, has_digest = "key_env" in client.table, "key_sha256" in client.table
    if has_env == has_digest:
        raise client.error("", "needs exactly one of 'key_env' or 'key_sha256'")
    if has_env:
        env_name = client.string("key_env")
        key = environ.get(env_name, "").strip()
        if not key:
            raise client.error("key_env", f"environment variable {env_name} is not set")
        return hashlib.sha256(key.encode()).digest()
    text = client.string("key_sha256")
    if not re.fullmatch(r"[0-9a-fA-F]{64}", text):
        raise client.error("key_sha256", "must be the 64 hex digits of a SHA-256 digest")
    return bytes.fromhex(text)


def _parse_cluster(table: Table, server: ServerConfig, environ: Mapping[str, str]) -> ClusterConfig:
    """`redis_url` as Redis clients spell it: redis://[[user]:password@]host[:port][/db], or
    rediss:// for TLS; the password may come from `password_env` instead of the URL. Or,
    instead, `sentinels` and `sentinel_master` (with `db`), where Sentinel manages Redis."""
    defaults = {"instance": default_instance(server.listen)}
    if "sentinels" in table.table:
        return table.read(defaults, **_sentinels(table, environ))
    if "db" in table.table:
        raise table.error("db", "only with sentinels: a redis_url ends in its database")
    for key in ("sentinel_master", "sentinel_password_env"):
        if key in table.table:
            raise table.error(key, "only with sentinels")
    url = table.string("redis_url", MISSING)
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss") or not parts.hostname:
        raise table.error("redis_url", f"must be a redis:// or rediss:// URL, got {describe(url)}")
    try:
        port = parts.port or 6379
    except ValueError:
        raise table.error("redis_url", f"has a bad port: {describe(url)}") from None
    db = parts.path.strip("/") or "0"
    if not db.isdigit() or parts.query or parts.fragment:
        raise table.error("redis_url", f"must end in a database number, got {describe(url)}")
    password = unquote(parts.password) if parts.password else None
    if "password_env" in table.table:
        if password is not None:
            raise table.error("password_env", "the redis_url already has a password")
        password = _secret(table, "password_env", environ)
    return table.read(
        defaults,
        host=parts.hostname,
        port=port,
        db=int(db),
        username=unquote(parts.username) if parts.username else None,
        password=password,
        tls=parts.scheme == "rediss",
    )


def _sentinels(table: Table, environ: Mapping[str, str]) -> dict[str, Any]:
    """`sentinels = ["host:port", ...]` and `sentinel_master`: the primary is found through
    them; `password_env` is the primary's password, `sentinel_password_env` the Sentinels'."""
    if "redis_url" in table.table:
        raise table.error("redis_url", "give either redis_url or sentinels, not both")
    given = table.table["sentinels"]
    if not isinstance(given, list) or not given:
        raise table.error("sentinels", f"must be an array of 'host:port', got {describe(given)}")
    sentinels = []
    for entry in given:
        host, _, port = entry.rpartition(":") if isinstance(entry, str) else ("", "", "")
        # A URL or user:password@ is no host (the Sentinels' password: sentinel_password_env).
        plain = host and "@" not in host and "/" not in host
        if not plain or not port.isdigit() or not 0 < int(port) < 65536:
            raise table.error("sentinels", f"each must be 'host:port', got {describe(entry)}")
        sentinels.append((host.strip("[]"), int(port)))
    return {
        "host": "",
        "port": 0,
        "db": table.integer("db", 0, minimum=0),
        "password": _secret(table, "password_env", environ),
        "sentinels": tuple(sentinels),
        "sentinel_master": table.string("sentinel_master", MISSING),
        "sentinel_password": _secret(table, "sentinel_password_env", environ),
    }


def default_instance(listen: str) -> str:
    """This gateway's name among those sharing a Redis: its host name and listening port."""
    host = socket.gethostname()
    fields = listen.split(":")
    if fields[0] in ("tcp", "tcp6", "ssl") and len(fields) > 1 and fields[1].isdigit():
        return f"{host}:{fields[1]}"
    return host
