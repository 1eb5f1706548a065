"""What `--demo` runs: two stub upstreams shaped like the homelab's real ones.

`reasoning` stands for the vLLM reasoning model (2 slots, a 3 s prefill, tokens at a pace a
person can watch, logging to /tmp/stub-reasoning.log, emptied at start so its `cancelled`
count is this run's); `qwen2.5:3b-instruct` stands for a small, fast Ollama model (4 slots).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from twisted.web.server import Site

from homelab_gateway.config import Config, parse_config
from homelab_gateway.dev.stub import StubLog, StubSettings, stub_site

REASONING_LOG = "/tmp/stub-reasoning.log"


def demo_setup(reactor: Any) -> tuple[Callable[[Mapping[str, str]], Config], dict[str, Site]]:
    """The stub sites to start, and how to build the config once their URLs are known."""
    reasoning_log = StubLog(open(REASONING_LOG, "w", buffering=1))  # noqa: SIM115 - process lifetime
    sites = {
        "vllm": stub_site(
            StubSettings(
                hold=3.0,
                delay=0.08,
                reasoning_tokens=12,
                content_tokens=24,
                models=("Qwen/QwQ-32B",),
            ),
            reactor,
            reasoning_log,
        ),
        "ollama": stub_site(
            StubSettings(
                delay=0.01, reasoning_tokens=0, content_tokens=24, models=("qwen2.5:3b-instruct",)
            ),
            reactor,
            StubLog(None),
        ),
    }

    def config(urls: Mapping[str, str]) -> Config:
        document = {
            "upstreams": {
                "vllm": {"url": urls["vllm"], "slots": 2},
                "ollama": {"url": urls["ollama"], "slots": 4},
            },
            "models": {
                "reasoning": {
                    "upstream": "vllm",
                    "upstream_model": "Qwen/QwQ-32B",
                    "max_tokens": 32768,
                    "map_thinking": True,
                    "map_effort": True,
                },
                "qwen2.5:3b-instruct": {"upstream": "ollama"},
            },
            "routes": [{"prefix": "/openai/", "upstream": "vllm"}],
            # The demo's usage is its stubs': shown by /llm/v1/usage, never left in a file.
            "usage": {"database": ":memory:"},
        }
        return parse_config(document, source="<demo>", environ={})

    return config, sites
