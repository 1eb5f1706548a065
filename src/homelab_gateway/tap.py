"""`twistd homelab-gateway`: command-line options and the service they build.

A config mistake is a user mistake, so it ends start-up with the one line ConfigError carries
and exit status 1, never a traceback. The reactor is imported only inside `makeService`, which
twistd calls after it has installed the reactor it was asked for.
"""

from __future__ import annotations

from typing import Any

from twisted.application.service import IService
from twisted.python import usage

from homelab_gateway.config import DEFAULT_LISTEN, ConfigError, check_endpoint, load_config


class Options(usage.Options):
    synopsis = "(--config PATH | --demo) [--listen ENDPOINT]"
    longdesc = (
        "An Anthropic Messages front door for OpenAI-compatible LLM servers. "
        "See docs/configuration.md for the config file."
    )
    optParameters = [
        ["config", "c", None, "Path of the TOML config file"],
        ["listen", "l", None, "Twisted endpoint to listen on; overrides [server] listen"],
    ]
    optFlags = [
        ["demo", None, f"Run with built-in stub upstreams on {DEFAULT_LISTEN}, no config needed"],
    ]

    def postOptions(self) -> None:
        if bool(self["config"]) == bool(self["demo"]):
            raise usage.UsageError("give exactly one of --config PATH or --demo")
        if self["listen"] is not None:

            def error(message: str) -> usage.UsageError:
                return usage.UsageError(f"--listen: {message}")

            check_endpoint(self["listen"], error)


def makeService(options: Options) -> IService:
    from twisted.internet import reactor

    from homelab_gateway.service import DemoService, GatewayService, json_log_stream

    if options["demo"]:
        from homelab_gateway.dev.demo import demo_setup

        return DemoService(reactor, options["listen"] or DEFAULT_LISTEN, demo_setup)
    try:
        config = load_config(options["config"])
    except ConfigError as e:
        raise SystemExit(f"homelab-gateway: config error: {e}") from None
    json_log = None
    if config.server.log_format == "json":
        twistd_options = getattr(options, "parent", None) or {}
        json_log = json_log_stream(twistd_options.get("logfile"))
    service: Any = GatewayService(
        config, reactor, options["listen"], json_log=json_log, config_path=options["config"]
    )
    return service
