"""twistd plugins for homelab-gateway. Only ServiceMakers: importing this must stay cheap and
must not import the reactor (twistd scans every plugin before it picks one)."""

from twisted.application.service import ServiceMaker

gateway = ServiceMaker(
    "homelab-gateway",
    "homelab_gateway.tap",
    "An Anthropic Messages front door for self-hosted OpenAI-compatible LLM servers",
    "homelab-gateway",
)

stub = ServiceMaker(
    "homelab-stub",
    "homelab_gateway.dev.stub",
    "A vLLM-faithful stub upstream for demos, tests and benchmarks",
    "homelab-stub",
)
