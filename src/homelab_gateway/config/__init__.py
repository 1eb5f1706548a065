"""The gateway's configuration: a TOML file read with tomllib into frozen dataclasses.

Every mistake a user can make in the file becomes one `ConfigError` whose text names the file,
the key and what is wrong, so start-up can fail with a single readable line instead of a
traceback. tables.py holds each table's dataclass, whose fields carry their keys' defaults and
checks (keys.py); parse.py adds what no single key can say. Nothing here touches the network
or the reactor.
"""

from homelab_gateway.config.keys import ConfigError
from homelab_gateway.config.listen import DEFAULT_BACKLOG, check_endpoint, with_backlog
from homelab_gateway.config.parse import auth_key_name, load_config, parse_config
from homelab_gateway.config.tables import (
    DEFAULT_LISTEN,
    UPSTREAM_KINDS,
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

__all__ = [
    "DEFAULT_BACKLOG",
    "DEFAULT_LISTEN",
    "UPSTREAM_KINDS",
    "AuthConfig",
    "BoxConfig",
    "ClientConfig",
    "ClusterConfig",
    "Config",
    "ConfigError",
    "ModelConfig",
    "QueueConfig",
    "RouteConfig",
    "ServerConfig",
    "UpstreamConfig",
    "UsageConfig",
    "auth_key_name",
    "check_endpoint",
    "load_config",
    "parse_config",
    "with_backlog",
]
