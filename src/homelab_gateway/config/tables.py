"""The configuration's tables as frozen dataclasses: each field is its key, with its default
and its check (keys.py); the parser (parse.py) adds only what one key cannot say alone.

A new key is its field here and its row in docs/configuration.md (a test compares the two).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from homelab_gateway.config.keys import (
    argv,
    boolean,
    choice,
    derived,
    describe,
    http_url,
    integer,
    is_number,
    number,
    seconds,
    string,
    strings,
    subtable,
)
from homelab_gateway.config.listen import endpoint_problem
from homelab_gateway.upstream.kinds import KINDS

DEFAULT_LISTEN = "tcp:8080:interface=127.0.0.1"
PRIORITY_CLASSES = ("interactive", "normal", "batch")  # best first; line.CLASSES agrees
SHOW_REASONING = ("always", "when_requested")
LOG_FORMATS = ("text", "json")
UPSTREAM_KINDS = tuple(KINDS)  # vllm, llama.cpp, ollama, openai (any other server)
PRIORITY_KINDS = tuple(name for name, kind in KINDS.items() if kind.priority is not None)
"""The kinds whose requests take a scheduling priority (`forward_priority`)."""
SYSTEM_MESSAGES = ("as_sent", "first")


def _memory_problem(memory: Any) -> str | None:
    if is_number(memory) and memory > 0:
        return None
    return f"must be a positive number, got {describe(memory)}"


def _origin_problem(origin: str) -> str | None:
    parts = urlsplit(origin)
    if parts.scheme not in ("http", "https") or not parts.netloc or parts.path:
        return f"{describe(origin)} is not an origin (scheme://host[:port])"
    return None


def _network_problem(network: str) -> str | None:
    try:
        ipaddress.ip_network(network, strict=False)
    except ValueError:
        return f"{describe(network)} is not an IP address or network"
    return None


@dataclass(frozen=True)
class ServerConfig:
    listen: str = string(DEFAULT_LISTEN, check=endpoint_problem)
    ping_interval: float = seconds(10.0)
    max_body_bytes: int = integer(10 * 1024 * 1024)
    max_header_bytes: int = integer(16384, minimum=1024)
    request_timeout: float = seconds(60.0)
    write_stall_timeout: float = seconds(120.0)
    shutdown_grace: float = seconds(30.0)
    probe_interval: float = seconds(15.0)
    log_format: str = choice(LOG_FORMATS, "text")
    cors_origins: tuple[str, ...] = strings(
        shape="origins like 'https://chat.home.lan'", check=_origin_problem
    )
    trusted_proxies: tuple[str, ...] = strings(  # networks, e.g. "127.0.0.1/32"
        shape="networks like '127.0.0.1/32'", check=_network_problem
    )
    retries: int = integer(2, minimum=0)  # extra attempts on another replica, before any byte
    max_status_subscribers: int = integer(64, minimum=0)  # /status/events streams; 0: off
    status_sample_interval: float = seconds(10.0)  # the status page's charts: 360 samples


@dataclass(frozen=True)
class UpstreamConfig:
    name: str = derived()
    url: str = http_url()
    slots: int = integer()
    kind: str = choice(UPSTREAM_KINDS, "vllm")  # which server: its probe and its quirks
    api_key: str | None = derived("api_key_env", default=None)
    # Ollama sends response headers only after loading the model: 10 s would fail cold starts.
    connect_timeout: float = seconds(60.0)
    idle_timeout: float = seconds(300.0)
    queue_limit: int = integer(64, minimum=0)
    queue_timeout: float = seconds(600.0)
    continuous_usage_stats: bool = boolean(True)
    forward_priority: bool = boolean(False)
    fallback: bool = boolean(False)  # takes a model's requests only when no other replica can
    failures_to_open: int = integer(3)  # failures in a row that take it out of rotation
    cooldown: float = seconds(30.0)  # seconds out of rotation before one trial request
    # Managed (loaded on demand): a server the gateway starts (`start`), or one that sleeps.
    box: str | None = string(None)  # the [boxes.NAME] whose memory it shares
    memory: float | None = number(None, check=_memory_problem)  # what it holds while loaded
    start: tuple[str, ...] | None = argv()
    stop: tuple[str, ...] | None = argv()  # run instead of SIGTERM (a server in a container)
    sleep_mode: bool = boolean(False)  # vLLM's sleep mode: /sleep, /wake_up, /is_sleeping
    load_timeout: float = seconds(600.0)  # from start until its health probe answers
    stop_timeout: float = seconds(30.0)  # SIGTERM, then SIGKILL after this
    idle_unload: float = seconds(0.0, zero=True)  # idle seconds before unloading; 0: never

    @property
    def managed(self) -> bool:
        return self.start is not None or self.sleep_mode


@dataclass(frozen=True)
class BoxConfig:
    """`[boxes.NAME]`: a machine whose accelerator memory its managed upstreams share."""

    name: str = derived()
    memory: float = number(MISSING, check=_memory_problem)  # any unit: its upstreams' `memory`
    min_resident: float = seconds(30.0, zero=True)  # a loaded model with work keeps its memory


@dataclass(frozen=True)
class ModelConfig:
    name: str = derived()
    upstream: str = derived("upstream")  # the first replica: what one-upstream readers use
    # The name sent upstream; its default, the model's own name, is given by the parser.
    upstream_model: str = string()
    # Every replica, `upstream` first; () means (upstream,).
    upstreams: tuple[str, ...] = derived("upstreams", default=())
    upstream_models: Mapping[str, str] = derived("upstream_models", default_factory=dict)
    params: Mapping[str, Any] = subtable({})
    max_tokens: int | None = integer(None)
    map_thinking: bool = boolean(False)
    map_effort: bool = boolean(False)
    # Claude Code's per-request attribution line kills every upstream prefix cache: drop it.
    strip_billing_header: bool = boolean(True)
    show_reasoning: str = choice(SHOW_REASONING, "always")  # "when_requested": with `thinking`
    context_window: int | None = integer(None)  # prompt + output, where the upstream cannot say
    # "first": at most one system message, first, on chat completions (core.instructions)
    system_messages: str = choice(SYSTEM_MESSAGES, "as_sent")

    @property
    def replicas(self) -> tuple[str, ...]:
        return self.upstreams or (self.upstream,)

    def model_on(self, upstream: str) -> str:
        """The name `upstream` serves this model under."""
        return self.upstream_models.get(upstream, self.upstream_model)


def _prefix_problem(prefix: str) -> str | None:
    if not prefix.startswith("/") or not prefix.endswith("/") or prefix == "/":
        return f"must start and end with '/' and not be '/', got {describe(prefix)}"
    if prefix.startswith(("/llm/", "/healthz/", "/status/")):
        return f"{describe(prefix)} is reserved for the gateway's own endpoints"
    return None


@dataclass(frozen=True)
class RouteConfig:
    prefix: str = string(check=_prefix_problem)
    upstream: str | None = derived("upstream", default=None)
    url: str | None = http_url(None)
    # A route naming an upstream has that upstream's timeouts by default (the parser's).
    connect_timeout: float = seconds(60.0)
    idle_timeout: float = seconds(300.0)


@dataclass(frozen=True)
class AuthConfig:
    # None: no keys configured, access is open
    api_keys: frozenset[str] | None = derived("api_keys_env", "api_keys_file", default=None)
    protect_metrics: bool = boolean(False)


def _weight_problem(weight: Any) -> str | None:
    if is_number(weight) and weight > 0:
        return None
    return f"must be a positive number, got {describe(weight)}"


@dataclass(frozen=True)
class ClientConfig:
    """A named caller: its key (kept only as a SHA-256 digest) and its place in the line."""

    name: str = derived()
    key_sha256: bytes = derived("key_env", "key_sha256")
    priority: str = choice(PRIORITY_CLASSES, "normal")
    weight: float = number(1.0, check=_weight_problem)
    max_waiting: int | None = integer(None, minimum=0)
    max_in_flight: int | None = integer(None)  # slots of one line held at once
    tokens_per_day: int | None = integer(None)  # input plus output tokens in a rolling 24 hours


@dataclass(frozen=True)
class QueueConfig:
    aging: float = seconds(120.0)  # seconds of waiting that count as one class better


def _share_problem(share: Any) -> str | None:
    if is_number(share) and 0 <= share <= 1:
        return None
    return f"must be a number from 0 to 1, got {describe(share)}"


@dataclass(frozen=True)
class ClusterConfig:
    """`[cluster]`: the Redis that several gateways share their slots and lines through."""

    host: str = derived("redis_url")
    port: int = derived(default=6379)
    db: int = derived("db", default=0)
    username: str | None = derived(default=None)
    password: str | None = derived("password_env", default=None, repr=False)
    tls: bool = derived(default=False)
    instance: str = string("")  # default: the host name and listening port (the parser's)
    lease: float = seconds(10.0)  # seconds before a silent gateway's slots and waiters expire
    # Of each upstream's slots, used alone while Redis is away.
    fallback_share: float = number(0.0, check=_share_problem)
    outage_grace: float = seconds(30.0)  # seconds Redis may be away before waiters get 529
    # With Redis Sentinel: where the Sentinels are, and the name they know the primary by
    # (`host` and `port` are then found through them).
    sentinels: tuple[tuple[str, int], ...] = derived("sentinels", default=())
    sentinel_master: str | None = derived("sentinel_master", default=None)
    sentinel_password: str | None = derived("sentinel_password_env", default=None, repr=False)
    prefix: str = string("hgw:")


def _folder_problem(database: str) -> str | None:
    folder = Path(database).parent
    if database != ":memory:" and not folder.is_dir():
        return f"{folder} is not a directory"
    return None


@dataclass(frozen=True)
class UsageConfig:
    """`[usage]`: the ledger of who used what (ledger.py)."""

    # Relative: under the daemon's working directory.
    database: str = string("usage.sqlite3", check=_folder_problem)
    keep_days: int = integer(90)


@dataclass(frozen=True)
class Config:
    """The whole file: each field is a top-level table."""

    server: ServerConfig
    upstreams: Mapping[str, UpstreamConfig]
    models: Mapping[str, ModelConfig]
    boxes: Mapping[str, BoxConfig] = field(default_factory=dict)
    routes: tuple[RouteConfig, ...] = ()
    auth: AuthConfig = AuthConfig()
    clients: Mapping[str, ClientConfig] = field(default_factory=dict)
    queue: QueueConfig = QueueConfig()
    cluster: ClusterConfig | None = None
    usage: UsageConfig = UsageConfig()
