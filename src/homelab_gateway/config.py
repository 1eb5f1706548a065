"""The gateway's configuration: a TOML file read with tomllib into frozen dataclasses.

Every mistake a user can make in the file becomes one `ConfigError` whose text names the file,
the key and what is wrong, so start-up can fail with a single readable line instead of a
traceback. Nothing here touches the network or the reactor.
"""

from __future__ import annotations

import hashlib
import ipaddress
import os
import re
import socket
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

DEFAULT_LISTEN = "tcp:8080:interface=127.0.0.1"
PRIORITY_CLASSES = ("interactive", "normal", "batch")  # best first; line.CLASSES agrees
CLIENT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


class ConfigError(Exception):
    """A user mistake in the configuration, worded for a person reading one log line."""


@dataclass(frozen=True)
class UpstreamConfig:
    name: str
    url: str
    slots: int
    kind: str = "vllm"  # a name in upstream.kinds.KINDS: the sort of server it is
    api_key: str | None = None
    # Ollama sends response headers only after loading the model: 10 s would fail cold starts.
    connect_timeout: float = 60.0
    idle_timeout: float = 300.0
    queue_limit: int = 64
    queue_timeout: float = 600.0
    continuous_usage_stats: bool = True
    forward_priority: bool = False
    fallback: bool = False  # takes a model's requests only when no other replica can
    failures_to_open: int = 3  # failures in a row that take it out of rotation
    cooldown: float = 30.0  # seconds out of rotation before one trial request


SHOW_REASONING = ("always", "when_requested")


@dataclass(frozen=True)
class ModelConfig:
    name: str
    upstream: str  # the first replica: what one-upstream readers (windows, routes) use
    upstream_model: str
    upstreams: tuple[str, ...] = ()  # every replica, `upstream` first; () means (upstream,)
    upstream_models: Mapping[str, str] = field(default_factory=dict)  # per-replica names
    params: Mapping[str, Any] = field(default_factory=dict)
    max_tokens: int | None = None
    map_thinking: bool = False
    map_effort: bool = False
    # Claude Code's per-request attribution line kills every upstream prefix cache: drop it.
    strip_billing_header: bool = True
    show_reasoning: str = "always"  # "always" | "when_requested" (only with `thinking` on)
    context_window: int | None = None  # prompt + output tokens, where the upstream cannot say

    @property
    def replicas(self) -> tuple[str, ...]:
        return self.upstreams or (self.upstream,)

    def model_on(self, upstream: str) -> str:
        """The name `upstream` serves this model under."""
        return self.upstream_models.get(upstream, self.upstream_model)


@dataclass(frozen=True)
class RouteConfig:
    prefix: str
    upstream: str | None = None
    url: str | None = None
    connect_timeout: float = 60.0
    idle_timeout: float = 300.0


@dataclass(frozen=True)
class ServerConfig:
    listen: str = DEFAULT_LISTEN
    ping_interval: float = 10.0
    max_body_bytes: int = 10 * 1024 * 1024
    max_header_bytes: int = 16384
    request_timeout: float = 60.0
    write_stall_timeout: float = 120.0
    shutdown_grace: float = 30.0
    probe_interval: float = 15.0
    log_format: str = "text"
    cors_origins: tuple[str, ...] = ()
    trusted_proxies: tuple[str, ...] = ()  # networks, e.g. "127.0.0.1/32"
    retries: int = 2  # extra attempts on another replica, only before any byte was answered
    max_status_subscribers: int = 64  # open /status/events streams; 0: the stream is off
    status_sample_interval: float = 10.0  # the status page's charts: 360 samples, an hour


@dataclass(frozen=True)
class AuthConfig:
    api_keys: frozenset[str] | None = None  # None: no keys configured, access is open
    protect_metrics: bool = False


@dataclass(frozen=True)
class ClientConfig:
    """A named caller: its key (kept only as a SHA-256 digest) and its place in the line."""

    name: str
    key_sha256: bytes
    priority: str = "normal"
    weight: float = 1.0
    max_waiting: int | None = None
    max_in_flight: int | None = None  # slots of one line held at once
    tokens_per_day: int | None = None  # input plus output tokens in a rolling 24 hours


@dataclass(frozen=True)
class QueueConfig:
    aging: float = 120.0  # seconds of waiting that count as one class better


@dataclass(frozen=True)
class ClusterConfig:
    """`[cluster]`: the Redis that several gateways share their slots and lines through."""

    host: str
    port: int = 6379
    db: int = 0
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    tls: bool = False
    instance: str = ""
    lease: float = 10.0  # seconds before a silent gateway's slots and waiters expire
    fallback_share: float = 0.0  # of each upstream's slots, used alone while Redis is away
    outage_grace: float = 30.0  # seconds Redis may be away before waiters get 529
    # With Redis Sentinel: where the Sentinels are, and the name they know the primary by
    # (`host` and `port` are then found through them).
    sentinels: tuple[tuple[str, int], ...] = ()
    sentinel_master: str | None = None
    sentinel_password: str | None = field(default=None, repr=False)
    prefix: str = "hgw:"


@dataclass(frozen=True)
class UsageConfig:
    """`[usage]`: the ledger of who used what (ledger.py)."""

    database: str = "usage.sqlite3"  # relative: under the daemon's working directory
    keep_days: int = 90


@dataclass(frozen=True)
class Config:
    server: ServerConfig
    upstreams: Mapping[str, UpstreamConfig]
    models: Mapping[str, ModelConfig]
    routes: tuple[RouteConfig, ...] = ()
    auth: AuthConfig = AuthConfig()
    clients: Mapping[str, ClientConfig] = field(default_factory=dict)
    queue: QueueConfig = QueueConfig()
    cluster: ClusterConfig | None = None
    usage: UsageConfig = UsageConfig()


class _Section:
    """Reads one TOML table, remembering its dotted path so errors can name the exact key."""

    def __init__(self, source: str, path: str, table: Any) -> None:
        self.source = source
        self.path = path
        if not isinstance(table, dict):
            raise self.error("", f"must be a table, got {_describe(table)}")
        self.table: dict[str, Any] = table

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

    def string(self, name: str, default: str | None = None, *, required: bool = False) -> Any:
        value = self.table.get(name, default)
        if value is None:
            if required:
                raise self.error(name, "is required")
            return None
        if not isinstance(value, str) or not value:
            raise self.error(name, f"must be a non-empty string, got {_describe(value)}")
        return value

    def integer(
        self, name: str, default: int | None, *, minimum: int = 1, required: bool = False
    ) -> Any:
        value = self.table.get(name, default)
        if value is None:
            if required:
                raise self.error(name, "is required")
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise self.error(name, f"must be an integer >= {minimum}, got {_describe(value)}")
        return value

    def seconds(self, name: str, default: float) -> float:
        value = self.table.get(name, default)
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            raise self.error(name, f"must be a positive number of seconds, got {_describe(value)}")
        return float(value)

    def boolean(self, name: str, default: bool) -> bool:
        value = self.table.get(name, default)
        if not isinstance(value, bool):
            raise self.error(name, f"must be true or false, got {_describe(value)}")
        return value

    def url(self, name: str) -> str:
        value = self.string(name, required=True)
        parts = urlsplit(value)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise self.error(name, f"must be an http:// or https:// URL, got {value!r}")
        try:
            parts.port  # noqa: B018 - urlsplit validates the port lazily
        except ValueError as e:
            raise self.error(name, f"has a bad port: {value!r}") from e
        if parts.query or parts.fragment:
            raise self.error(name, f"must not have a query or fragment, got {value!r}")
        return value.rstrip("/")


def _describe(value: Any) -> str:
    if isinstance(value, dict):
        return "a table"
    if isinstance(value, list):
        return "an array"
    return repr(value)


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
    top = _Section(source, "", dict(document))
    top.reject_unknown(
        {"server", "upstreams", "models", "routes", "auth", "clients", "queue", "cluster", "usage"}
    )
    server = _parse_server(_Section(source, "server", top.table.get("server", {})))
    auth = _parse_auth(_Section(source, "auth", top.table.get("auth", {})), environ)
    clients = _parse_clients(_Section(source, "clients", top.table.get("clients", {})), environ)
    queue_section = _Section(source, "queue", top.table.get("queue", {}))
    queue_section.reject_unknown({"aging"})
    queue = QueueConfig(aging=queue_section.seconds("aging", QueueConfig.aging))

    upstream_tables = _Section(source, "upstreams", top.table.get("upstreams", {}))
    upstreams = {
        name: _parse_upstream(name, _Section(source, f"upstreams.{_quote(name)}", table), environ)
        for name, table in upstream_tables.table.items()
    }
    model_tables = _Section(source, "models", top.table.get("models", {}))
    models = {
        name: _parse_model(name, _Section(source, f"models.{_quote(name)}", table), upstreams)
        for name, table in model_tables.table.items()
    }

    raw_routes = top.table.get("routes", [])
    if not isinstance(raw_routes, list):
        raise top.error("routes", "must be an array of tables ([[routes]])")
    routes = tuple(
        _parse_route(_Section(source, f"routes[{i}]", table), upstreams)
        for i, table in enumerate(raw_routes)
    )
    prefixes = [route.prefix for route in routes]
    for i, prefix in enumerate(prefixes):
        if prefix in prefixes[:i]:
            raise ConfigError(f"{source}: routes[{i}].prefix: {prefix!r} is used by another route")
    cluster = None
    if "cluster" in top.table:
        cluster = _parse_cluster(_Section(source, "cluster", top.table["cluster"]), server, environ)
    usage = _parse_usage(_Section(source, "usage", top.table.get("usage", {})))
    return Config(
        server=server,
        upstreams=upstreams,
        models=models,
        routes=routes,
        auth=auth,
        clients=clients,
        queue=queue,
        cluster=cluster,
        usage=usage,
    )


def _parse_usage(section: _Section) -> UsageConfig:
    section.reject_unknown({"database", "keep_days"})
    database = section.string("database", UsageConfig.database)
    folder = Path(database).parent
    if database != ":memory:" and not folder.is_dir():
        raise section.error("database", f"{folder} is not a directory")
    return UsageConfig(
        database=database, keep_days=section.integer("keep_days", UsageConfig.keep_days)
    )


def _parse_cluster(
    section: _Section, server: ServerConfig, environ: Mapping[str, str]
) -> ClusterConfig:
    """`redis_url` as Redis clients spell it: redis://[[user]:password@]host[:port][/db], or
    rediss:// for TLS; the password may come from `password_env` instead of the URL. Or,
    instead, `sentinels` and `sentinel_master` (with `db`), where Sentinel manages Redis."""
    section.reject_unknown(
        {
            "redis_url",
            "password_env",
            "instance",
            "lease",
            "fallback_share",
            "outage_grace",
            "prefix",
            "sentinels",
            "sentinel_master",
            "sentinel_password_env",
            "db",
        }
    )
    if "sentinels" in section.table:
        return _parse_sentinels(section, server, environ)
    if "db" in section.table:
        raise section.error("db", "only with sentinels: a redis_url ends in its database")
    url = section.string("redis_url", required=True)
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss") or not parts.hostname:
        raise section.error("redis_url", f"must be a redis:// or rediss:// URL, got {url!r}")
    try:
        port = parts.port or 6379
    except ValueError:
        raise section.error("redis_url", f"has a bad port: {url!r}") from None
    db = parts.path.strip("/") or "0"
    if not db.isdigit() or parts.query or parts.fragment:
        raise section.error("redis_url", f"must end in a database number, got {url!r}")
    password = unquote(parts.password) if parts.password else None
    if "password_env" in section.table:
        if password is not None:
            raise section.error("password_env", "the redis_url already has a password")
        password = _secret(section, "password_env", environ)
    return ClusterConfig(
        host=parts.hostname,
        port=port,
        db=int(db),
        username=unquote(parts.username) if parts.username else None,
        password=password,
        tls=parts.scheme == "rediss",
        **_cluster_settings(section, server),
    )


def _secret(section: _Section, key: str, environ: Mapping[str, str]) -> str | None:
    """The value of the environment variable that `key` names, if it is given."""
    name = section.string(key)
    if name is None:
        return None
    if name not in environ:
        raise section.error(key, f"environment variable {name} is not set")
    return environ[name]


def _parse_sentinels(
    section: _Section, server: ServerConfig, environ: Mapping[str, str]
) -> ClusterConfig:
    """`sentinels = ["host:port", ...]` and `sentinel_master`: the primary is found through
    them; `password_env` is the primary's password, `sentinel_password_env` the Sentinels'."""
    if "redis_url" in section.table:
        raise section.error("redis_url", "give either redis_url or sentinels, not both")
    given = section.table["sentinels"]
    if not isinstance(given, list) or not given:
        raise section.error("sentinels", f"must be an array of 'host:port', got {_describe(given)}")
    sentinels = []
    for entry in given:
        host, _, port = entry.rpartition(":") if isinstance(entry, str) else ("", "", "")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise section.error("sentinels", f"each must be 'host:port', got {_describe(entry)}")
        sentinels.append((host.strip("[]"), int(port)))
    return ClusterConfig(
        host="",
        port=0,
        db=section.integer("db", 0, minimum=0),
        password=_secret(section, "password_env", environ),
        sentinels=tuple(sentinels),
        sentinel_master=section.string("sentinel_master", required=True),
        sentinel_password=_secret(section, "sentinel_password_env", environ),
        **_cluster_settings(section, server),
    )


def _cluster_settings(section: _Section, server: ServerConfig) -> dict[str, Any]:
    """What `[cluster]` says besides where Redis is."""
    share = section.table.get("fallback_share", 0.0)
    if isinstance(share, bool) or not isinstance(share, int | float) or not 0 <= share <= 1:
        raise section.error(
            "fallback_share", f"must be a number from 0 to 1, got {_describe(share)}"
        )
    return {
        "instance": section.string("instance", default_instance(server.listen)),
        "lease": section.seconds("lease", ClusterConfig.lease),
        "fallback_share": float(share),
        "outage_grace": section.seconds("outage_grace", ClusterConfig.outage_grace),
        "prefix": section.string("prefix", ClusterConfig.prefix),
    }


def default_instance(listen: str) -> str:
    """This gateway's name among those sharing a Redis: its host name and listening port."""
    host = socket.gethostname()
    fields = listen.split(":")
    if fields[0] in ("tcp", "tcp6", "ssl") and len(fields) > 1 and fields[1].isdigit():
        return f"{host}:{fields[1]}"
    return host


def _quote(name: str) -> str:
    bare = name.replace("-", "").replace("_", "").isalnum()
    return name if bare else f'"{name}"'


def _parse_server(section: _Section) -> ServerConfig:
    defaults = ServerConfig()
    section.reject_unknown(set(ServerConfig.__dataclass_fields__))
    listen = section.string("listen", DEFAULT_LISTEN)
    check_endpoint(listen, lambda message: section.error("listen", message))
    log_format = section.string("log_format", "text")
    if log_format not in ("text", "json"):
        raise section.error("log_format", f"must be 'text' or 'json', got {log_format!r}")
    origins = section.table.get("cors_origins", [])
    if not isinstance(origins, list) or not all(isinstance(o, str) and o for o in origins):
        raise section.error(
            "cors_origins", "must be an array of origins like 'https://chat.home.lan'"
        )
    for origin in origins:
        parts = urlsplit(origin)
        if parts.scheme not in ("http", "https") or not parts.netloc or parts.path:
            raise section.error(
                "cors_origins", f"{origin!r} is not an origin (scheme://host[:port])"
            )
    proxies = section.table.get("trusted_proxies", [])
    if not isinstance(proxies, list) or not all(isinstance(p, str) for p in proxies):
        raise section.error("trusted_proxies", "must be an array of networks like '127.0.0.1/32'")
    for network in proxies:
        try:
            ipaddress.ip_network(network, strict=False)
        except ValueError:
            raise section.error(
                "trusted_proxies", f"{network!r} is not an IP address or network"
            ) from None
    return ServerConfig(
        listen=listen,
        ping_interval=section.seconds("ping_interval", defaults.ping_interval),
        max_body_bytes=section.integer("max_body_bytes", defaults.max_body_bytes),
        max_header_bytes=section.integer(
            "max_header_bytes", defaults.max_header_bytes, minimum=1024
        ),
        request_timeout=section.seconds("request_timeout", defaults.request_timeout),
        write_stall_timeout=section.seconds("write_stall_timeout", defaults.write_stall_timeout),
        shutdown_grace=section.seconds("shutdown_grace", defaults.shutdown_grace),
        probe_interval=section.seconds("probe_interval", defaults.probe_interval),
        log_format=log_format,
        cors_origins=tuple(origins),
        trusted_proxies=tuple(proxies),
        retries=section.integer("retries", defaults.retries, minimum=0),
        max_status_subscribers=section.integer(
            "max_status_subscribers", defaults.max_status_subscribers, minimum=0
        ),
        status_sample_interval=section.seconds(
            "status_sample_interval", defaults.status_sample_interval
        ),
    )


def auth_key_name(key: str) -> str:
    """The name an `[auth]` key goes by in logs, metrics and status: stable across restarts and
    reloads, distinct per key, and not the key (8 hex digits of its SHA-256)."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:8]


def _is_address(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def _parse_clients(section: _Section, environ: Mapping[str, str]) -> dict[str, ClientConfig]:
    clients: dict[str, ClientConfig] = {}
    seen: dict[bytes, str] = {}
    for name, table in section.table.items():
        client = _Section(section.source, f"clients.{_quote(name)}", table)
        if not CLIENT_NAME.fullmatch(name) or name.startswith("key-") or _is_address(name):
            raise client.error(
                "",
                "a client name is 1-64 letters, digits, '_', '.', '-', is no IP address (those "
                "name key-less clients) and does not start with 'key-' (names of [auth] keys)",
            )
        client.reject_unknown(
            {
                "key_env",
                "key_sha256",
                "priority",
                "weight",
                "max_waiting",
                "max_in_flight",
                "tokens_per_day",
            }
        )
        has_env, has_digest = "key_env" in client.table, "key_sha256" in client.table
        if has_env == has_digest:
            raise client.error("", "needs exactly one of 'key_env' or 'key_sha256'")
        if has_env:
            env_name = client.string("key_env")
            key = environ.get(env_name, "").strip()
            if not key:
                raise client.error("key_env", f"environment variable {env_name} is not set")
            digest = hashlib.sha256(key.encode()).digest()
        else:
            text = client.string("key_sha256")
            if not re.fullmatch(r"[0-9a-fA-F]{64}", text):
                raise client.error("key_sha256", "must be the 64 hex digits of a SHA-256 digest")
            digest = bytes.fromhex(text)
        if digest in seen:
            raise client.error("", f"has the same key as client {seen[digest]!r}")
        seen[digest] = name
        priority = client.string("priority", "normal")
        if priority not in PRIORITY_CLASSES:
            raise client.error(
                "priority", f"must be one of {', '.join(PRIORITY_CLASSES)}, got {priority!r}"
            )
        weight = client.table.get("weight", 1)
        if isinstance(weight, bool) or not isinstance(weight, int | float) or not weight > 0:
            raise client.error("weight", f"must be a positive number, got {_describe(weight)}")
        clients[name] = ClientConfig(
            name=name,
            key_sha256=digest,
            priority=priority,
            weight=float(weight),
            max_waiting=client.integer("max_waiting", None, minimum=0),
            max_in_flight=client.integer("max_in_flight", None, minimum=1),
            tokens_per_day=client.integer("tokens_per_day", None, minimum=1),
        )
    return clients


def _parse_auth(section: _Section, environ: Mapping[str, str]) -> AuthConfig:
    section.reject_unknown({"api_keys_env", "api_keys_file", "protect_metrics"})
    keys: set[str] = set()
    configured = False
    env_name = section.string("api_keys_env")
    if env_name is not None:
        configured = True
        keys.update(k.strip() for k in environ.get(env_name, "").split(",") if k.strip())
    file_name = section.string("api_keys_file")
    if file_name is not None:
        configured = True
        try:
            lines = Path(file_name).read_text().splitlines()
        except OSError as e:
            raise section.error("api_keys_file", f"cannot read {file_name}: {e.strerror}") from None
        keys.update(k.strip() for k in lines if k.strip() and not k.lstrip().startswith("#"))
    if configured and not keys:
        # Keys were asked for but none were found: fail closed rather than run open.
        where = " or ".join(f for f in (env_name, file_name) if f)
        raise section.error("", f"no API keys found in {where}")
    protect_metrics = section.boolean("protect_metrics", False)
    if protect_metrics and not configured:
        # The operator asked for protection that cannot exist without keys; running open (the
        # old behaviour) would hide that /llm and every route are open too.
        raise section.error(
            "protect_metrics",
            "needs API keys (api_keys_env or api_keys_file); without them everything is open",
        )
    return AuthConfig(
        api_keys=frozenset(keys) if configured else None, protect_metrics=protect_metrics
    )


# Twisted listens with a backlog of 50: a burst of a few thousand clients connecting at once
# overflows it, and they wait for SYN retries (seconds each) or see resets. Linux caps the value
# at net.core.somaxconn (4096 by default since 5.4), so asking for that costs nothing more.
DEFAULT_BACKLOG = 4096
_TAKES_BACKLOG = ("tcp", "tcp6", "ssl", "unix")


def with_backlog(description: str, backlog: int = DEFAULT_BACKLOG) -> str:
    """The listen string with `backlog=` added, unless the operator set one or the endpoint
    has no listen queue of ours (systemd passes a socket it already listens on)."""
    kind = description.split(":", 1)[0].strip().lower()
    if kind not in _TAKES_BACKLOG or re.search(r"(?i)(?<!\\):backlog=", description):
        return description
    return f"{description}:backlog={backlog}"


def check_endpoint(description: str, error: Any) -> None:
    """Reject a listen string that Twisted could not parse, before the reactor runs.

    `serverFromString` only builds the endpoint object (nothing listens until `.listen`), so it
    is safe to call with no reactor; a typo then fails start-up naming the key rather than with
    a traceback from deep in twistd.
    """
    from twisted.internet.endpoints import serverFromString

    try:
        serverFromString(None, description)
    except (ValueError, TypeError, KeyError) as e:
        raise error(f"bad endpoint string {description!r}: {e}") from None
    port = re.match(r"(?i)tcp6?:(\d+)", description)
    if port and int(port.group(1)) > 65535:
        raise error(f"bad endpoint string {description!r}: port must be 0-65535")


def _parse_upstream(name: str, section: _Section, environ: Mapping[str, str]) -> UpstreamConfig:
    section.reject_unknown(
        {
            "url",
            "slots",
            "kind",
            "api_key_env",
            "connect_timeout",
            "idle_timeout",
            "queue_limit",
            "queue_timeout",
            "continuous_usage_stats",
            "forward_priority",
            "fallback",
            "failures_to_open",
            "cooldown",
        }
    )
    # Imported here: the kinds import the core, which imports this module.
    from homelab_gateway.upstream.kinds import KINDS

    kind = section.string("kind", UpstreamConfig.kind)
    if kind not in KINDS:
        raise section.error("kind", f"must be one of {', '.join(KINDS)}, got {kind!r}")
    forward_priority = section.boolean("forward_priority", False)
    if forward_priority and KINDS[kind].priority is None:
        raise section.error("forward_priority", f"kind {kind!r} takes no priority field")
    api_key = None
    key_env = section.string("api_key_env")
    if key_env is not None:
        api_key = environ.get(key_env)
        if not api_key:
            raise section.error("api_key_env", f"environment variable {key_env} is not set")
    return UpstreamConfig(
        name=name,
        url=section.url("url"),
        slots=section.integer("slots", None, required=True),
        kind=kind,
        api_key=api_key,
        connect_timeout=section.seconds("connect_timeout", UpstreamConfig.connect_timeout),
        idle_timeout=section.seconds("idle_timeout", 300.0),
        queue_limit=section.integer("queue_limit", 64, minimum=0),
        queue_timeout=section.seconds("queue_timeout", 600.0),
        continuous_usage_stats=section.boolean("continuous_usage_stats", True),
        forward_priority=forward_priority,
        fallback=section.boolean("fallback", False),
        failures_to_open=section.integer("failures_to_open", 3, minimum=1),
        cooldown=section.seconds("cooldown", 30.0),
    )


def _known_upstream(section: _Section, upstreams: Mapping[str, UpstreamConfig]) -> str:
    name = section.string("upstream", required=True)
    if name not in upstreams:
        known = ", ".join(sorted(upstreams)) or "none are configured"
        raise section.error("upstream", f"names unknown upstream {name!r} (known: {known})")
    return name


def _parse_model(
    name: str, section: _Section, upstreams: Mapping[str, UpstreamConfig]
) -> ModelConfig:
    section.reject_unknown(
        {
            "upstream",
            "upstreams",
            "upstream_model",
            "upstream_models",
            "params",
            "max_tokens",
            "map_thinking",
            "map_effort",
            "strip_billing_header",
            "show_reasoning",
            "context_window",
        }
    )
    params = section.table.get("params", {})
    if not isinstance(params, dict):
        raise section.error("params", f"must be a table, got {_describe(params)}")
    show_reasoning = section.string("show_reasoning", "always")
    if show_reasoning not in SHOW_REASONING:
        raise section.error(
            "show_reasoning",
            f"must be 'always' or 'when_requested', got {show_reasoning!r}",
        )
    if "*" in name and "upstream_model" not in section.table:
        raise section.error(
            "upstream_model", "is required for a name pattern (the pattern is no model's name)"
        )
    replicas = _replicas(section, upstreams)
    return ModelConfig(
        name=name,
        upstream=replicas[0],
        upstreams=replicas,
        upstream_models=_upstream_models(section, replicas),
        upstream_model=section.string("upstream_model", name),
        params=params,
        max_tokens=section.integer("max_tokens", None),
        map_thinking=section.boolean("map_thinking", False),
        map_effort=section.boolean("map_effort", False),
        strip_billing_header=section.boolean("strip_billing_header", True),
        show_reasoning=show_reasoning,
        context_window=section.integer("context_window", None),
    )


def _replicas(section: _Section, upstreams: Mapping[str, UpstreamConfig]) -> tuple[str, ...]:
    """`upstreams = [...]` (replicas) or `upstream = "x"` (one), never both."""
    if "upstreams" not in section.table:
        return (_known_upstream(section, upstreams),)
    if "upstream" in section.table:
        raise section.error("upstreams", "give either 'upstream' or 'upstreams', not both")
    names = section.table["upstreams"]
    if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
        raise section.error("upstreams", "must be a non-empty array of upstream names")
    for name in names:
        if name not in upstreams:
            known = ", ".join(sorted(upstreams)) or "none are configured"
            raise section.error("upstreams", f"names unknown upstream {name!r} (known: {known})")
    if len(set(names)) != len(names):
        raise section.error("upstreams", "names an upstream twice")
    return tuple(names)


def _upstream_models(section: _Section, replicas: tuple[str, ...]) -> dict[str, str]:
    names = section.table.get("upstream_models", {})
    if not isinstance(names, dict) or not all(isinstance(v, str) and v for v in names.values()):
        raise section.error("upstream_models", 'must be a table of upstream = "model name"')
    for upstream in names:
        if upstream not in replicas:
            raise section.error(
                "upstream_models", f"{upstream!r} is not one of this model's upstreams"
            )
    return dict(names)


def _parse_route(section: _Section, upstreams: Mapping[str, UpstreamConfig]) -> RouteConfig:
    section.reject_unknown({"prefix", "upstream", "url", "connect_timeout", "idle_timeout"})
    prefix = section.string("prefix", required=True)
    if not prefix.startswith("/") or not prefix.endswith("/") or prefix == "/":
        raise section.error("prefix", f"must start and end with '/' and not be '/', got {prefix!r}")
    if prefix.startswith(("/llm/", "/healthz/", "/status/")):
        raise section.error("prefix", f"{prefix!r} is reserved for the gateway's own endpoints")
    has_upstream = "upstream" in section.table
    has_url = "url" in section.table
    if has_upstream == has_url:
        raise section.error("", "needs exactly one of 'upstream' or 'url'")
    if has_upstream:
        name = _known_upstream(section, upstreams)
        upstream = upstreams[name]
        return RouteConfig(
            prefix=prefix,
            upstream=name,
            connect_timeout=section.seconds("connect_timeout", upstream.connect_timeout),
            idle_timeout=section.seconds("idle_timeout", upstream.idle_timeout),
        )
    return RouteConfig(
        prefix=prefix,
        url=section.url("url"),
        connect_timeout=section.seconds("connect_timeout", RouteConfig.connect_timeout),
        idle_timeout=section.seconds("idle_timeout", 300.0),
    )
