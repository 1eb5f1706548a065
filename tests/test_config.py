"""Config parsing: the documented keys, their defaults, and one clear line per mistake."""

from __future__ import annotations

import copy
import hashlib
import math
import re
import tomllib
from pathlib import Path
from typing import Any

import pytest
from twisted.internet import reactor
from twisted.internet.defer import ensureDeferred
from twisted.trial.unittest import TestCase
from twisted.web.test.requesthelper import DummyRequest

from homelab_gateway.config import (
    DEFAULT_BACKLOG,
    UPSTREAM_KINDS,
    AuthConfig,
    BoxConfig,
    ClientConfig,
    ClusterConfig,
    Config,
    ConfigError,
    ModelConfig,
    QueueConfig,
    RouteConfig,
    ServerConfig,
    UpstreamConfig,
    UsageConfig,
    auth_key_name,
    load_config,
    parse_config,
    with_backlog,
)
from homelab_gateway.config.keys import known_keys
from homelab_gateway.service import Gateway, shared_lines

REPO = Path(__file__).resolve().parent.parent

GOOD = """
[server]
listen = "tcp:8080:interface=127.0.0.1"

[upstreams.vllm]
url = "http://127.0.0.1:8000/v1"
slots = 6
api_key_env = "VLLM_API_KEY"

[upstreams.ollama]
url = "http://127.0.0.1:11434/v1/"
slots = 2

[models.reasoning]
upstream = "vllm"
upstream_model = "Qwen/QwQ-32B"
params = { chat_template_kwargs = { enable_thinking = true } }
max_tokens = 32768

[models."qwen2.5:3b-instruct"]
upstream = "ollama"

[[routes]]
prefix = "/openai/"
upstream = "vllm"

[[routes]]
prefix = "/nas/"
url = "http://192.0.2.10:5000"
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "gw.toml"
    path.write_text(text)
    return path


def error(tmp_path: Path, text: str, environ: dict[str, str] | None = None) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, text), environ=environ or {"VLLM_API_KEY": "k"})
    message = str(info.value)
    assert "\n" not in message and message.startswith(str(tmp_path / "gw.toml") + ": ")
    return message.split(": ", 1)[1]


def test_the_documented_example_parses(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, GOOD), environ={"VLLM_API_KEY": "k"})
    assert config.server.listen == "tcp:8080:interface=127.0.0.1"
    vllm = config.upstreams["vllm"]
    assert (vllm.url, vllm.slots, vllm.api_key) == ("http://127.0.0.1:8000/v1", 6, "k")
    assert (vllm.idle_timeout, vllm.queue_limit, vllm.queue_timeout) == (300.0, 64, 600.0)
    assert config.upstreams["ollama"].url == "http://127.0.0.1:11434/v1"  # trailing slash dropped
    reasoning = config.models["reasoning"]
    assert reasoning.upstream_model == "Qwen/QwQ-32B" and reasoning.max_tokens == 32768
    assert reasoning.params == {"chat_template_kwargs": {"enable_thinking": True}}
    assert config.models["qwen2.5:3b-instruct"].upstream_model == "qwen2.5:3b-instruct"
    assert [(r.prefix, r.upstream, r.url) for r in config.routes] == [
        ("/openai/", "vllm", None),
        ("/nas/", None, "http://192.0.2.10:5000"),
    ]


@pytest.mark.parametrize(
    "name",
    [
        "homelab-gateway.toml",
        "homelab-gateway-replicas.toml",
        "homelab-gateway-cluster.toml",
        "homelab-gateway-sentinel.toml",
        "homelab-gateway-gpu.toml",
    ],
)
def test_shipped_example_config_parses(name: str) -> None:
    environ = {"VLLM_API_KEY": "k", "HOMELAB_GATEWAY_REDIS_PASSWORD": "pw"}
    load_config(REPO / "etc" / name, environ=environ)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"gone\.toml: file not found$"):
        load_config(tmp_path / "gone.toml")


def test_bad_toml(tmp_path: Path) -> None:
    assert error(tmp_path, "[server\nlisten=").startswith("invalid TOML:")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("bogus = 1", "bogus: unknown key"),
        ("[server]\nlisten = 'tcp:nope'", "server.listen: bad endpoint string"),
        ("[server]\nlisten = 'carrier-pigeon:1'", "server.listen: bad endpoint string"),
        ("[server]\nlisten = 'tcp:99999'", "server.listen: bad endpoint string"),
        ("[server]\nping_interval = 0", "server.ping_interval: must be a positive number"),
        ("[upstreams.v]\nslots = 1", "upstreams.v.url: is required"),
        (
            "[upstreams.v]\nurl = 'ftp://x/v1'\nslots = 1",
            "upstreams.v.url: must be an http:// or https:// URL",
        ),
        (
            "[upstreams.v]\nurl = 'http://x:notaport/v1'\nslots = 1",
            "upstreams.v.url: has a bad port",
        ),
        ("[upstreams.v]\nurl = 'http://x/v1'", "upstreams.v.slots: is required"),
        (
            "[upstreams.v]\nurl = 'http://x/v1'\nslots = 0",
            "upstreams.v.slots: must be an integer >= 1",
        ),
        (
            "[upstreams.v]\nurl = 'http://x/v1'\nslots = 'six'",
            "upstreams.v.slots: must be an integer >= 1",
        ),
        (
            "[upstreams.v]\nurl = 'http://x/v1'\nslots = 1\nspeed = 3",
            "upstreams.v.speed: unknown key",
        ),
        (
            "[upstreams.v]\nurl = 'http://x/v1'\nslots = 1\napi_key_env = 'NOPE'",
            "upstreams.v.api_key_env: environment variable NOPE is not set",
        ),
        ("[models.m]\nupstream = 'ghost'", "models.m.upstream: names unknown upstream 'ghost'"),
        ("[models.m]\nupstream_model = 'x'", "models.m.upstream: is required"),
        (
            "[upstreams.v]\nurl = 'http://x/v1'\nslots = 1\n[models.m]\nupstream = 'v'\nparams = 3",
            "models.m.params: must be a table",
        ),
        (
            "[upstreams.v]\nurl = 'http://x/v1'\nslots = 1\n"
            "[[routes]]\nprefix = 'openai'\nupstream = 'v'",
            "routes[0].prefix: must start and end with '/'",
        ),
        ("[[routes]]\nprefix = '/x/'", "routes[0]: needs exactly one of 'upstream' or 'url'"),
        (
            "[[routes]]\nprefix = '/llm/x/'\nurl = 'http://x'",
            "routes[0].prefix: '/llm/x/' is reserved",
        ),
        (
            "[[routes]]\nprefix = '/status/'\nurl = 'http://x'",
            "routes[0].prefix: '/status/' is reserved",
        ),
        (
            "[[routes]]\nprefix = '/x/'\nurl = 'http://x'\n[[routes]]\nprefix = '/x/'\nurl = 'http://y'",
            "routes[1].prefix: '/x/' is used by another route",
        ),
        ("routes = 3", "routes: must be an array of tables"),
        ("[server]\nlog_format = 'xml'", "server.log_format: must be 'text' or 'json'"),
        ("[server]\ncors_origins = 'https://a'", "server.cors_origins: must be an array"),
        (
            "[server]\ncors_origins = ['https://a.lan/path']",
            "server.cors_origins: 'https://a.lan/path' is not an origin",
        ),
        ("[server]\nshutdown_grace = -1", "server.shutdown_grace: must be a positive number"),
        (
            "[server]\nmax_status_subscribers = -1",
            "server.max_status_subscribers: must be an integer >= 0, got -1",
        ),
        (
            "[server]\nmax_status_subscribers = 'many'",
            "server.max_status_subscribers: must be an integer >= 0, got 'many'",
        ),
        (
            "[server]\nstatus_sample_interval = 0",
            "server.status_sample_interval: must be a positive number of seconds, got 0",
        ),
        ("[auth]\napi_keys_env = 'EMPTY'", "auth: no API keys found in EMPTY"),
        (
            "[auth]\napi_keys_file = '/nonexistent/keys'",
            "auth.api_keys_file: cannot read /nonexistent/keys",
        ),
        ("[auth]\nkeys = ['a']", "auth.keys: unknown key"),
        (
            "[auth]\nprotect_metrics = true",
            "auth.protect_metrics: needs API keys (api_keys_env or api_keys_file)",
        ),
    ],
)
def test_every_mistake_names_the_key(tmp_path: Path, text: str, expected: str) -> None:
    assert error(tmp_path, text).startswith(expected)


def test_quoted_model_names_are_quoted_in_errors() -> None:
    with pytest.raises(ConfigError, match=r'models\."qwen2\.5:3b"\.upstream'):
        parse_config({"models": {"qwen2.5:3b": {"upstream": "x"}}}, environ={})


def test_api_keys_from_env_and_file_add_up(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("# the frontend\nfile-key\n\n")
    document = {"auth": {"api_keys_env": "K", "api_keys_file": str(keys), "protect_metrics": True}}
    auth = parse_config(document, environ={"K": "env-a, env-b,"}).auth
    assert auth.api_keys == {"env-a", "env-b", "file-key"} and auth.protect_metrics


def test_empty_config_is_valid_and_listens_on_loopback() -> None:
    config = parse_config({}, environ={})
    assert config.server.listen == "tcp:8080:interface=127.0.0.1"


def test_status_subscribers_are_capped_at_64_unless_set_and_0_is_allowed() -> None:
    assert parse_config({}, environ={}).server.max_status_subscribers == 64
    for cap in (0, 500):
        server = parse_config({"server": {"max_status_subscribers": cap}}, environ={}).server
        assert server.max_status_subscribers == cap


FAIR = """
[server]
trusted_proxies = ["127.0.0.1/32", "fd00::/8"]

[upstreams.vllm]
url = "http://127.0.0.1:8000/v1"
slots = 2
forward_priority = true

[clients.frontend]
key_env = "FRONTEND_KEY"
priority = "interactive"
weight = 2
max_waiting = 16

[clients.scripts]
key_sha256 = "%s"
priority = "batch"
max_in_flight = 2
tokens_per_day = 200_000

[queue]
aging = 90
"""


def test_the_fair_line_keys_parse() -> None:
    digest = hashlib.sha256(b"nightly").hexdigest()
    config = parse_config(tomllib.loads(FAIR % digest), environ={"FRONTEND_KEY": "front"})
    assert config.server.trusted_proxies == ("127.0.0.1/32", "fd00::/8")
    assert config.upstreams["vllm"].forward_priority is True
    assert config.queue.aging == 90.0
    frontend, scripts = config.clients["frontend"], config.clients["scripts"]
    assert frontend.key_sha256 == hashlib.sha256(b"front").digest()
    assert (frontend.priority, frontend.weight, frontend.max_waiting) == ("interactive", 2.0, 16)
    assert scripts.key_sha256 == bytes.fromhex(digest)
    assert (scripts.priority, scripts.weight, scripts.max_waiting) == ("batch", 1.0, None)
    assert (scripts.max_in_flight, scripts.tokens_per_day) == (2, 200_000)
    assert (frontend.max_in_flight, frontend.tokens_per_day) == (None, None)


def test_fair_line_defaults() -> None:
    config = parse_config({}, environ={})
    assert config.clients == {} and config.queue.aging == 120.0
    assert config.server.trusted_proxies == ()


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("[server]\ntrusted_proxies = ['nginx']", "server.trusted_proxies: 'nginx' is not an IP"),
        ("[server]\ntrusted_proxies = '127.0.0.1'", "server.trusted_proxies: must be an array"),
        ("[clients.a]\npriority = 'normal'", "clients.a: needs exactly one of 'key_env'"),
        ("[clients.a]\nkey_env = 'NOPE'", "clients.a.key_env: environment variable NOPE"),
        ("[clients.a]\nkey_sha256 = 'abc'", "clients.a.key_sha256: must be the 64 hex digits"),
        ("[clients.a]\nkey_env = 'K'\npriority = 'urgent'", "clients.a.priority: must be one of"),
        ("[clients.a]\nkey_env = 'K'\nweight = 0", "clients.a.weight: must be a positive number"),
        ("[clients.a]\nkey_env = 'K'\nmax_waiting = -1", "clients.a.max_waiting: must be an"),
        ("[clients.a]\nkey_env = 'K'\nmax_in_flight = 0", "clients.a.max_in_flight: must be an"),
        ("[clients.a]\nkey_env = 'K'\ntokens_per_day = 1.5", "clients.a.tokens_per_day: must be"),
        ("[clients.a]\nkey_env = 'K'\nkey = 'x'", "clients.a.key: unknown key"),
        ('[clients."10.0.0.2"]\nkey_env = "K"', 'clients."10.0.0.2": a client name is'),
        ("[clients.key-1]\nkey_env = 'K'", "clients.key-1: a client name is"),
        ("[clients.a]\nkey_env = 'K'\n[clients.b]\nkey_env = 'K'", "clients.b: has the same key"),
        ("[queue]\naging = 0", "queue.aging: must be a positive number"),
        ("[queue]\nlength = 3", "queue.length: unknown key"),
        (
            "[upstreams.v]\nurl = 'http://x/v1'\nslots = 1\nforward_priority = 1",
            "upstreams.v.forward_priority: must be true or false",
        ),
    ],
)
def test_fair_line_mistakes_name_the_key(tmp_path: Path, text: str, expected: str) -> None:
    assert error(tmp_path, text, environ={"K": "key"}).startswith(expected)


def test_auth_keys_are_named_by_a_digest_prefix_not_the_key() -> None:
    name = auth_key_name("sekrit")
    assert name == "key-" + hashlib.sha256(b"sekrit").hexdigest()[:8]
    assert "sekrit" not in name


@pytest.mark.parametrize(
    ("listen", "expected"),
    [
        ("tcp:8080:interface=127.0.0.1", "tcp:8080:interface=127.0.0.1:backlog=4096"),
        ("TCP6:8080", "TCP6:8080:backlog=4096"),
        ("unix:/run/gw.sock", "unix:/run/gw.sock:backlog=4096"),
        ("tcp:8080:backlog=100", "tcp:8080:backlog=100"),  # the operator's choice stands
        ("systemd:domain=INET:index=0", "systemd:domain=INET:index=0"),  # systemd listens
    ],
)
def test_the_listener_gets_a_large_backlog_unless_the_operator_set_one(
    listen: str, expected: str
) -> None:
    assert with_backlog(listen) == expected


class RunningListener(TestCase):
    async def test_the_running_listener_has_the_default_backlog(self) -> None:
        """Twisted's own default is 50: a burst of thousands of clients overflows it."""
        from homelab_gateway.service import GatewayService

        config = parse_config({}, source="<test>", environ={})
        service = GatewayService(config, reactor, "tcp:0:interface=127.0.0.1")
        service.privilegedStartService()
        assert service.port is not None
        self.addCleanup(service.port.stopListening)
        assert service.port.backlog == DEFAULT_BACKLOG  # type: ignore[attr-defined]


REPLICAS = """
[server]
retries = 1

[upstreams.a]
url = "http://127.0.0.1:8000/v1"
slots = 4

[upstreams.b]
url = "http://127.0.0.1:8001/v1"
slots = 4
failures_to_open = 5
cooldown = 12

[upstreams.ollama]
url = "http://127.0.0.1:11434/v1"
slots = 1
fallback = true

[upstreams.alone]
url = "http://127.0.0.1:9000/v1"
slots = 1

[models.reasoning]
upstreams = ["a", "b", "ollama"]
upstream_model = "Qwen/QwQ-32B"
upstream_models = { ollama = "qwq:32b" }

[models.small]
upstream = "ollama"
"""


def test_replicas_their_names_and_health_settings(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, REPLICAS))
    model = config.models["reasoning"]
    assert model.replicas == ("a", "b", "ollama")
    assert model.upstream == "a"
    assert [model.model_on(n) for n in model.replicas] == ["Qwen/QwQ-32B"] * 2 + ["qwq:32b"]
    assert config.models["small"].replicas == ("ollama",)
    assert config.server.retries == 1
    b, ollama = config.upstreams["b"], config.upstreams["ollama"]
    assert (b.failures_to_open, b.cooldown, b.fallback) == (5, 12.0, False)
    assert (ollama.failures_to_open, ollama.cooldown, ollama.fallback) == (3, 30.0, True)


def test_upstreams_that_share_a_model_share_a_line(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, REPLICAS))
    assert shared_lines(config) == [["a", "b", "ollama"], ["alone"]]


@pytest.mark.parametrize(
    ("replace", "message"),
    [
        (
            'upstreams = ["a", "b", "ollama"]',
            'models.reasoning.upstreams: names unknown upstream "nope"',
        ),
        ('upstreams = ["a", "b", "ollama"]', "models.reasoning.upstreams: names an upstream twice"),
        ('upstreams = ["a", "b", "ollama"]', "models.reasoning.upstreams: give either"),
        ('upstreams = ["a", "b", "ollama"]', "models.reasoning.upstreams: must be a non-empty"),
        ("{ ollama = ", "models.reasoning.upstream_models: 'alone' is not one of"),
    ],
)
def test_replica_mistakes_are_one_line(tmp_path: Path, replace: str, message: str) -> None:
    by_message = {
        "unknown": 'upstreams = ["a", "nope"]',
        "twice": 'upstreams = ["a", "a"]',
        "either": 'upstreams = ["a"]\nupstream = "a"',
        "non-empty": "upstreams = []",
        "not one of": "{ alone = ",
    }
    new = next(v for k, v in by_message.items() if k in message)
    text = REPLICAS.replace(replace, new, 1)
    with pytest.raises(ConfigError) as raised:
        load_config(write(tmp_path, text))
    assert message.replace('"', "'") in str(raised.value)


def test_the_cluster_section_as_redis_clients_spell_it() -> None:
    assert parse_config({}, environ={}).cluster is None
    config = parse_config(
        tomllib.loads(
            '[server]\nlisten = "tcp:9000"\n'
            '[cluster]\nredis_url = "rediss://gw:s%40cret@redis.home.lan:6380/2"\nlease = 4\n'
            "fallback_share = 0.5"
        ),
        environ={},
    )
    cluster = config.cluster
    assert cluster is not None
    assert (cluster.host, cluster.port, cluster.db, cluster.tls) == (
        "redis.home.lan",
        6380,
        2,
        True,
    )
    assert (cluster.username, cluster.password) == ("gw", "s@cret")
    assert (cluster.lease, cluster.fallback_share, cluster.prefix) == (4.0, 0.5, "hgw:")
    assert cluster.instance.endswith(":9000")  # the host name and the listening port
    assert "s@cret" not in repr(cluster)
    plain = parse_config(
        tomllib.loads(
            '[cluster]\nredis_url = "redis://127.0.0.1"\npassword_env = "P"\ninstance = "gw-1"'
        ),
        environ={"P": "pw"},
    ).cluster
    assert plain is not None
    assert (plain.port, plain.db, plain.tls, plain.password, plain.instance) == (
        6379,
        0,
        False,
        "pw",
        "gw-1",
    )
    assert (plain.lease, plain.fallback_share, plain.outage_grace) == (10.0, 0.0, 30.0)


def test_a_cluster_whose_redis_sentinel_manages() -> None:
    config = parse_config(
        tomllib.loads(
            '[cluster]\nsentinels = ["10.0.0.5:26379", "sentinel-b.lan:26379", "[fd00::7]:26379"]\n'
            'sentinel_master = "gateway"\ndb = 3\npassword_env = "P"\n'
            'sentinel_password_env = "S"\noutage_grace = 12\ninstance = "gw-1"'
        ),
        environ={"P": "primary", "S": "sentinels"},
    ).cluster
    assert config is not None
    assert config.sentinels == (
        ("10.0.0.5", 26379),
        ("sentinel-b.lan", 26379),
        ("fd00::7", 26379),
    )
    assert (config.sentinel_master, config.db, config.outage_grace) == ("gateway", 3, 12.0)
    assert (config.password, config.sentinel_password) == ("primary", "sentinels")
    assert "sentinels'" not in repr(config) and "primary'" not in repr(config)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("[cluster]\nlease = 3", "cluster.redis_url: is required"),
        ("[cluster]\nsentinels = ['s:1']", "cluster.sentinel_master: is required"),
        ("[cluster]\nsentinels = ['s']\nsentinel_master = 'm'", "cluster.sentinels: each must"),
        ("[cluster]\nsentinels = []\nsentinel_master = 'm'", "cluster.sentinels: must be an"),
        (
            "[cluster]\nsentinels = ['s:1']\nsentinel_master = 'm'\nredis_url = 'redis://x'",
            "cluster.redis_url: give either redis_url or sentinels",
        ),
        ("[cluster]\nredis_url = 'redis://x'\ndb = 1", "cluster.db: only with sentinels"),
        ("[cluster]\nredis_url = 'redis://x'\noutage_grace = 0", "cluster.outage_grace: must be"),
        ("[cluster]\nredis_url = 'http://x'", "cluster.redis_url: must be a redis:// or rediss://"),
        ("[cluster]\nredis_url = 'redis://x:99999'", "cluster.redis_url: has a bad port"),
        ("[cluster]\nredis_url = 'redis://x/db1'", "cluster.redis_url: must end in a database"),
        ("[cluster]\nredis_url = 'redis://x'\nlease = 0", "cluster.lease: must be a positive"),
        (
            "[cluster]\nredis_url = 'redis://x'\nfallback_share = 2",
            "cluster.fallback_share: must be a number from 0 to 1",
        ),
        (
            "[cluster]\nredis_url = 'redis://x'\npassword_env = 'NOPE'",
            "cluster.password_env: environment variable NOPE is not set",
        ),
        (
            "[cluster]\nredis_url = 'redis://:pw@x'\npassword_env = 'K'",
            "cluster.password_env: the redis_url already has a password",
        ),
        ("[cluster]\nredis_url = 'redis://x'\nnodes = 3", "cluster.nodes: unknown key"),
    ],
)
def test_cluster_mistakes_name_the_key(tmp_path: Path, text: str, expected: str) -> None:
    assert error(tmp_path, text, environ={"K": "key"}).startswith(expected)


def test_the_usage_ledger_keys(tmp_path: Path) -> None:
    assert parse_config({}, environ={}).usage == UsageConfig("usage.sqlite3", 90)
    database = str(tmp_path / "ledger.db")
    text = f'[usage]\ndatabase = "{database}"\nkeep_days = 400\n'
    usage = parse_config(tomllib.loads(text), environ={}).usage
    assert (usage.database, usage.keep_days) == (database, 400)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("[usage]\nkeep_days = 0", "usage.keep_days: must be an integer >= 1, got 0"),
        ("[usage]\nkeep_days = 1.5", "usage.keep_days: must be an integer >= 1"),
        ("[usage]\ndatabase = ''", "usage.database: must be a non-empty string"),
        ("[usage]\ndatabase = '/nowhere/at/all/u.db'", "usage.database: /nowhere/at/all is not"),
        ("[usage]\nretention = 3", "usage.retention: unknown key"),
    ],
)
def test_usage_mistakes_name_the_key(tmp_path: Path, text: str, expected: str) -> None:
    assert error(tmp_path, text).startswith(expected)


TABLES = {
    "server": ServerConfig,
    "upstreams.NAME": UpstreamConfig,
    "boxes.NAME": BoxConfig,
    "models.NAME": ModelConfig,
    "auth": AuthConfig,
    "clients.NAME": ClientConfig,
    "queue": QueueConfig,
    "usage": UsageConfig,
    "cluster": ClusterConfig,
    "[routes]": RouteConfig,
}


def documented_keys() -> dict[str, set[str]]:
    """The keys in the first column of each table's key table in docs/configuration.md."""
    keys: dict[str, set[str]] = {}
    table = None
    for line in (REPO / "docs" / "configuration.md").read_text().splitlines():
        heading = re.match(r"## `\[(.+?)\]`", line)
        if heading:
            table = heading.group(1)
        elif line.startswith("## "):
            table = None
        elif table is not None and line.startswith("| `"):
            first = line.split("|")[1]
            keys.setdefault(table, set()).update(re.findall(r"`([a-z_0-9]+)`", first))
    return keys


def test_every_key_is_documented_and_every_documented_key_exists() -> None:
    """A key is its dataclass field: adding one without its row in the docs fails here."""
    assert documented_keys() == {name: known_keys(cls) for name, cls in TABLES.items()}


def test_an_upstream_is_vllm_unless_its_kind_says_otherwise() -> None:
    upstreams = {
        "v": {"url": "http://v/v1", "slots": 1},
        **{kind: {"url": "http://o/v1", "slots": 1, "kind": kind} for kind in UPSTREAM_KINDS},
    }
    config = parse_config({"upstreams": upstreams}, environ={})
    assert config.upstreams["v"].kind == "vllm"
    assert {config.upstreams[kind].kind for kind in UPSTREAM_KINDS} == {
        "vllm",
        "llama.cpp",
        "ollama",
        "openai",
    }


def test_an_unknown_kind_is_one_line_naming_kind(tmp_path: Path) -> None:
    text = "[upstreams.v]\nurl = 'http://x/v1'\nslots = 1\nkind = 'tgi'"
    assert error(tmp_path, text) == (
        "upstreams.v.kind: must be one of vllm, llama.cpp, ollama, openai, got 'tgi'"
    )


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "[cluster]\nredis_url = 'redis://gw:hunter2@redis:99999/0'",
            "cluster.redis_url: has a bad port: 'redis://gw:***@redis:99999/0'",
        ),
        (
            "[cluster]\nredis_url = 'redis://:hunter2@redis/zero'",
            "cluster.redis_url: must end in a database number, got 'redis://:***@redis/zero'",
        ),
        (
            "[cluster]\nredis_url = 'redis://:hunter2@redis/0?ssl_cert_reqs=none'",
            "cluster.redis_url: must end in a database number, "
            "got 'redis://:***@redis/0?ssl_cert_reqs=none'",
        ),
        (
            "[cluster]\nredis_url = 'http://hunter2@redis/0'",
            "cluster.redis_url: must be a redis:// or rediss:// URL, got 'http://***@redis/0'",
        ),
        (
            "[cluster]\nsentinels = 'redis://:hunter2@s:26379'\nsentinel_master = 'm'",
            "cluster.sentinels: must be an array of 'host:port', got 'redis://:***@s:26379'",
        ),
        (
            "[cluster]\nsentinels = ['redis://:hunter2@s:26379']\nsentinel_master = 'm'",
            "cluster.sentinels: each must be 'host:port', got 'redis://:***@s:26379'",
        ),
        (
            "[cluster]\nsentinels = ['gw:hunter2@s:26379']\nsentinel_master = 'm'",
            "cluster.sentinels: each must be 'host:port', got 'gw:***@s:26379'",
        ),
        (
            "[upstreams.v]\nurl = 'http://u:hunter2@x:port/v1'\nslots = 1",
            "upstreams.v.url: has a bad port: 'http://u:***@x:port/v1'",
        ),
        (
            "[upstreams.v]\nurl = 'ftp://u:hunter2@x/v1'\nslots = 1",
            "upstreams.v.url: must be an http:// or https:// URL, got 'ftp://u:***@x/v1'",
        ),
        (
            "[[routes]]\nprefix = '/nas/'\nurl = 'http://u:hunter2@nas/?a=1'",
            "routes[0].url: must not have a query or fragment, got 'http://u:***@nas/?a=1'",
        ),
    ],
)
def test_no_error_line_shows_a_url_password(tmp_path: Path, text: str, expected: str) -> None:
    assert error(tmp_path, text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "[upstreams.v]\nurl = 'http://u:hunter2@x:8000/v1'\nslots = 1",
            "upstreams.v.url: must not hold a user or password (the gateway sends no Basic "
            "auth), got 'http://u:***@x:8000/v1'",
        ),
        (
            "[upstreams.v]\nurl = 'https://hunter2@x/v1'\nslots = 1",
            "upstreams.v.url: must not hold a user or password (the gateway sends no Basic "
            "auth), got 'https://***@x/v1'",
        ),
        (
            "[[routes]]\nprefix = '/nas/'\nurl = 'http://admin:hunter2@nas:5000'",
            "routes[0].url: must not hold a user or password (the gateway sends no Basic "
            "auth), got 'http://admin:***@nas:5000'",
        ),
    ],
)
def test_a_url_with_a_user_or_password_is_refused(tmp_path: Path, text: str, expected: str) -> None:
    """Sent as it is, user:password@ makes every request fail with 502 "invalid hostname"."""
    assert error(tmp_path, text) == expected


UPSTREAM = {"url": "http://x/v1", "slots": 1}
# A valid document for each table, and the path of the table in it.
EACH_TABLE: list[tuple[type, str, dict[str, Any]]] = [
    (ServerConfig, "server", {"server": {}}),
    (UpstreamConfig, "upstreams.v", {"upstreams": {"v": UPSTREAM}}),
    (ModelConfig, "models.m", {"upstreams": {"v": UPSTREAM}, "models": {"m": {"upstream": "v"}}}),
    (RouteConfig, "routes[0]", {"routes": [{"prefix": "/r/", "url": "http://x"}]}),
    (AuthConfig, "auth", {"auth": {}}),
    (ClientConfig, "clients.c", {"clients": {"c": {"key_env": "K"}}}),
    (QueueConfig, "queue", {"queue": {}}),
    (ClusterConfig, "cluster", {"cluster": {"redis_url": "redis://x"}}),
    (UsageConfig, "usage", {"usage": {}}),
]
EVERY_KEY = [
    pytest.param(path, document, key, id=f"{path}.{key}")
    for cls, path, document in EACH_TABLE
    for key in sorted(known_keys(cls))
]


def with_key(document: dict[str, Any], path: str, key: str, value: Any) -> dict[str, Any]:
    document = copy.deepcopy(document)
    name, _, rest = path.partition(".")
    table = document["routes"][0] if name == "routes[0]" else document[name]
    (table[rest] if rest else table)[key] = value
    return document


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize(("path", "document", "key"), EVERY_KEY)
def test_nan_and_inf_are_refused_for_every_key(
    path: str, document: dict[str, Any], key: str, value: float
) -> None:
    """No setting takes inf as "never" (docs/configuration.md), and nan compares false with
    everything: a timer, a weight or a share given either would fail every request."""
    assert parse_config(document, environ={"K": "key"}) is not None  # the base is valid
    with pytest.raises(ConfigError) as raised:
        parse_config(with_key(document, path, key, value), source="<c>", environ={"K": "key"})
    message = str(raised.value)
    assert message.startswith(f"<c>: {path}") and "\n" not in message
    assert re.search(rf"{re.escape(path)}\.{key}: |\b{key}\b", message), message


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("[server]\nstatus_sample_interval = nan", "server.status_sample_interval: must be a"),
        ("[queue]\naging = nan", "queue.aging: must be a positive number of seconds, got nan"),
        (
            "[upstreams.v]\nurl = 'http://x/v1'\nslots = 1\nidle_timeout = nan",
            "upstreams.v.idle_timeout: must be a positive number of seconds, got nan",
        ),
        (
            "[upstreams.v]\nurl = 'http://x/v1'\nslots = 1\nqueue_timeout = inf",
            "upstreams.v.queue_timeout: must be a positive number of seconds, got inf",
        ),
        ("[clients.a]\nkey_env = 'K'\nweight = inf", "clients.a.weight: must be a positive number"),
    ],
)
def test_what_made_every_request_a_500_is_one_line(
    tmp_path: Path, text: str, expected: str
) -> None:
    assert error(tmp_path, text, environ={"K": "key"}).startswith(expected)


class ProtectMetricsWithClientKeys(TestCase):
    """`[clients]` keys make keys required as `[auth]`'s do: protect_metrics then needs one."""

    def refusal(self, config: Config, key: str | None) -> int | None:
        gateway = Gateway(config, reactor)
        self.addCleanup(lambda: ensureDeferred(gateway.close()))
        request = DummyRequest([b"metrics"])
        if key is not None:
            request.requestHeaders.setRawHeaders(b"x-api-key", [key.encode()])
        access = gateway.app.access
        refused = access.refusal(request, protected=access.protect_metrics, draining=False)
        return None if refused is None else refused.status

    def test_any_configured_key_opens_metrics_and_status(self) -> None:
        document = {
            "auth": {"protect_metrics": True},
            "clients": {"chat": {"key_env": "CHAT"}},
            "usage": {"database": ":memory:"},
        }
        config = parse_config(document, environ={"CHAT": "chat-key"})
        assert config.auth.protect_metrics and config.auth.api_keys is None
        assert self.refusal(config, None) == 401
        assert self.refusal(config, "other") == 401
        assert self.refusal(config, "chat-key") is None


MANAGED = """
[boxes.gpu0]
memory = 24

[upstreams.coder]
url = "http://127.0.0.1:8101/v1"
slots = 4
box = "gpu0"
memory = 18
start = ["vllm", "serve", "Qwen/Qwen3-Coder-30B", "--port", "8101"]
"""


def test_a_managed_upstream_reads_its_box_and_defaults(tmp_path: Path) -> None:
    path = tmp_path / "gw.toml"
    path.write_text(MANAGED)
    config = load_config(path)
    coder = config.upstreams["coder"]
    assert coder.managed and coder.box == "gpu0" and coder.memory == 18
    assert coder.start == ("vllm", "serve", "Qwen/Qwen3-Coder-30B", "--port", "8101")
    assert (coder.load_timeout, coder.stop_timeout, coder.idle_unload) == (600, 30, 0)
    assert coder.stop is None and not coder.sleep_mode
    assert config.boxes["gpu0"].memory == 24 and config.boxes["gpu0"].min_resident == 30


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ('box = "gpu0"', None),
        ('box = "gpu1"', "upstreams.coder.box: names unknown box 'gpu1' (known: gpu0)"),
        ("memory = 25", "upstreams.coder.memory: 25 is more than box 'gpu0' holds (24)"),
        ("memory = 0", "upstreams.coder.memory: must be a positive number, got 0"),
        ("start = []", "upstreams.coder.start: must be a non-empty array of strings"),
        ("sleep_mode = true", "upstreams.coder.sleep_mode: give either `start` or `sleep_mode`"),
        ("idle_unload = -1", "upstreams.coder.idle_unload: must be a number of seconds >= 0"),
        ("load_timeout = nan", "upstreams.coder.load_timeout: must be a positive number"),
    ],
)
def test_managed_upstream_mistakes_name_the_key(
    tmp_path: Path, change: str, expected: str | None
) -> None:
    key = change.split(" = ")[0]
    box, upstream = MANAGED.split("[upstreams.coder]")
    kept = [line for line in upstream.splitlines() if not line.startswith(f"{key} = ")]
    text = box + "[upstreams.coder]" + "\n".join([*kept, change])
    if expected is None:
        path = tmp_path / "gw.toml"
        path.write_text(text)
        load_config(path)
    else:
        assert error(tmp_path, text).startswith(expected)


@pytest.mark.parametrize(
    ("remove", "expected"),
    [
        ("box = ", "upstreams.coder.box: is required for a managed upstream"),
        ("memory = 18", "upstreams.coder.memory: is required for a managed upstream"),
    ],
)
def test_a_managed_upstream_needs_a_box_and_its_memory(
    tmp_path: Path, remove: str, expected: str
) -> None:
    text = "\n".join(line for line in MANAGED.splitlines() if not line.startswith(remove))
    assert error(tmp_path, text).startswith(expected)


def test_a_box_needs_its_memory_and_an_unmanaged_upstream_no_box(tmp_path: Path) -> None:
    assert error(tmp_path, MANAGED.replace("memory = 24", "")).endswith(
        "boxes.gpu0.memory: is required"
    )
    unmanaged = MANAGED.replace('start = ["vllm"', 'x = ["vllm"').replace("\nx = [", "\n#x = [")
    assert error(tmp_path, unmanaged).endswith(
        "upstreams.coder.box: only for a managed upstream (with `start` or `sleep_mode`)"
    )


def test_managed_upstreams_and_a_cluster_are_refused_together(tmp_path: Path) -> None:
    text = MANAGED + '\n[cluster]\nredis_url = "redis://127.0.0.1:6379/0"\n'
    assert error(tmp_path, text).startswith("cluster: upstream 'coder' is loaded on demand")


def test_system_messages_is_as_sent_or_first(tmp_path: Path) -> None:
    base = '[upstreams.v]\nurl = "http://v/v1"\nslots = 1\n[models.m]\nupstream = "v"\n'
    path = tmp_path / "gw.toml"
    path.write_text(base)
    assert load_config(path).models["m"].system_messages == "as_sent"
    path.write_text(base + 'system_messages = "first"\n')
    assert load_config(path).models["m"].system_messages == "first"
    assert error(tmp_path, base + 'system_messages = "last"\n').endswith(
        "models.m.system_messages: must be 'as_sent' or 'first', got 'last'"
    )
