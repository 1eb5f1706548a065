"""A stand-in for vLLM's OpenAI-compatible server, for the demo, the tests and the benchmarks.

It serves POST /v1/chat/completions, /v1/completions, /v1/embeddings and /tokenize, and GET
/v1/models, in vLLM's wire format, including what trips translators: a first chunk of
`{"role":"assistant","content":""}`, reasoning as `delta.reasoning` (or `reasoning_content`, or
both, as vLLM versions did), `{"content":""}` at the reasoning/content switch and in the finish
chunk, a non-standard `stop_reason`, usage on every chunk with `continuous_usage_stats`, a final
`"choices": []` usage chunk, then `data: [DONE]`. Headers go out at once and the first token
after `hold` seconds, like a prefill; a whole answer (an embedding always) after `hold`.

A word in the prompt picks a scenario (see SCENARIOS): in chat's last user message, in any text
prompt of a completion or input of an embedding. A chat that ends with a tool result is answered
content-only instead of calling a tool again (TOOL_SCENARIOS), as a model answers its tools'
output, so an agent's tool loop ends. The log gets a line, naming the `endpoint`,
when a request starts (with a digest of its prompt, so a test can tell whether one request ran
twice, even across restarts of the stub), when it completes (when `[DONE]` is written, as
vLLM's engine is done by then), when it is refused, on a `hangup` and, the moment the client
leaves early, `cancelled`.

`--load-time SECONDS` opens the port only that long after start, as vLLM opens its port only
once its model is loaded: until then its health probe's connection is refused.
"""

from __future__ import annotations

import json
import sys

from twisted.application.internet import StreamServerEndpointService
from twisted.application.service import IService, Service
from twisted.internet.defer import Deferred, succeed
from twisted.internet.interfaces import IDelayedCall, IReactorTime, IStreamServerEndpoint
from twisted.python import usage
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET, Request, Site

from homelab_gateway.dev.completions import Completion
from homelab_gateway.dev.embeddings import EMBEDDING_SCENARIOS, Embedding
from homelab_gateway.dev.generation import (
    CHAT_ONLY,
    SCENARIOS,
    Exchange,
    Generation,
    HTTPError,
    cached_tokens,
    prompt_words,
)
from homelab_gateway.dev.state import StubLog, StubSettings, StubStats


def _error_body(status: int, message: str) -> bytes:
    kind = {400: "BadRequestError", 404: "NotFoundError", 503: "ServiceUnavailableError"}
    error = {
        "message": message,
        "type": kind.get(status, "InternalServerError"),
        "param": None,
        "code": status,
    }
    return json.dumps({"error": error}).encode()


class StubResource(Resource):
    """The stub server's whole URL space."""

    isLeaf = True

    def __init__(self, settings: StubSettings, clock: IReactorTime, log: StubLog) -> None:
        super().__init__()
        self.settings = settings
        self.clock = clock
        self.log = log
        self.stats = StubStats()
        self._counter = 0
        self._last_prompt: list[str] = []  # the prefix cache's one remembered prompt

    def render_GET(self, request: Request) -> bytes:
        path = request.path.rstrip(b"/")
        request.setHeader(b"content-type", b"application/json")
        if path == b"/v1/models":
            names = self.settings.models or ("stub",)
            data = [
                {
                    "id": n,
                    "object": "model",
                    "created": 0,
                    "owned_by": "homelab-stub",
                }
                for n in names
            ]
            if self.settings.max_model_len is not None:
                for entry in data:
                    entry["max_model_len"] = self.settings.max_model_len
            return json.dumps({"object": "list", "data": data}).encode()
        if path == b"/stub/status":
            return json.dumps(self.stats.__dict__).encode()
        if path == b"/health":
            return b"{}"
        request.setResponseCode(404)
        return _error_body(404, f"no route for GET {path.decode()}")

    def _too_long(self, exchange: Exchange) -> tuple[int, str] | None:
        """vLLM's context check of each prompt, and its prefix cache's view of those that
        pass, one after the other."""
        window = self.settings.max_model_len
        output = exchange.output_tokens
        for tokens in exchange.prompts:
            if window is not None and len(tokens) + output > window:
                return 400, _overflow_message(window, len(tokens), output)
        if exchange.prefix_cache:
            for index, tokens in enumerate(exchange.prompts):
                exchange.cache_hits[index] = cached_tokens(tokens, self._last_prompt)
                self._last_prompt = tokens
        return None

    def render_POST(self, request: Request) -> bytes | int:
        path = request.path.rstrip(b"/")
        request.setHeader(b"content-type", b"application/json")
        try:
            body = json.loads(request.content.read())
        except ValueError:
            body = None
        if not isinstance(body, dict):
            request.setResponseCode(400)
            return _error_body(400, "request body is not JSON")
        if path == b"/tokenize":
            words = prompt_words(body.get("messages")) or str(body.get("prompt", "")).split()
            count = len(words) + 4 * len(body.get("messages") or [])
            return json.dumps(
                {
                    "count": count,
                    "max_model_len": self.settings.max_model_len or 32768,
                    "tokens": list(range(count)),
                }
            ).encode()
        kind = ENDPOINTS.get(path)
        if kind is None:
            request.setResponseCode(404)
            return _error_body(404, f"no route for POST {path.decode()}")
        problem = kind.invalid(body, self.settings)
        if problem is not None:
            request.setResponseCode(400)
            return _error_body(400, problem)
        model = body.get("model")
        priority = body.get("priority", 0)
        if isinstance(priority, bool) or not isinstance(priority, int):
            request.setResponseCode(400)
            return _error_body(400, "priority: Input should be a valid integer")
        if priority != 0 and self.settings.scheduling_policy != "priority":
            # vLLM's protocol: "Any priority other than 0 will raise an error if the served
            # model does not use priority scheduling."
            request.setResponseCode(400)
            return _error_body(
                400, f"Got priority {priority} but Priority scheduling is not enabled."
            )
        if self.settings.models and model not in self.settings.models:
            request.setResponseCode(404)
            return _error_body(404, f"The model `{model}` does not exist.")
        self._counter += 1
        exchange = kind(self, request, body, f"{self._counter}")
        stats = self.stats
        stats.requests += 1
        stats.models[str(model)] = stats.models.get(str(model), 0) + 1
        exchange.log(
            "start",
            model=model,
            stream=exchange.streaming,
            scenario=exchange.scenario,
            user=body.get("user"),
            priority=body.get("priority"),
            prompt=exchange.digest,
        )
        refusal = REFUSALS.get(exchange.scenario) or self._too_long(exchange)
        if refusal is not None:
            exchange.log("refused", status=refusal[0])
            request.setResponseCode(refusal[0])
            return _error_body(*refusal)
        if exchange.scenario == "hangup":
            stats.hangups += 1
            exchange.log("hangup")
            request.channel.transport.loseConnection()
            return NOT_DONE_YET
        stats.in_flight += 1
        stats.max_in_flight = max(stats.max_in_flight, stats.in_flight)
        request.notifyFinish().addErrback(exchange.client_left)
        if isinstance(exchange, Generation) and exchange.scenario == "endless-error":
            request.setResponseCode(500)
            exchange.start(b"application/json")
            return NOT_DONE_YET
        if isinstance(exchange, Generation) and exchange.streaming:
            exchange.start()
            return NOT_DONE_YET

        def answer() -> None:
            try:
                payload = exchange.answer_whole()
            except HTTPError as e:
                request.setResponseCode(e.status)
                payload = _error_body(e.status, e.message)
            exchange.finish("complete")
            request.write(payload)
            request.finish()

        exchange.call_later(self.settings.hold, answer)
        return NOT_DONE_YET


ENDPOINTS: dict[bytes, type[Exchange]] = {
    b"/v1/chat/completions": Generation,
    b"/v1/completions": Completion,
    b"/v1/embeddings": Embedding,
}
REFUSALS = {
    "error500": (500, "stub: internal error before the stream"),
    "error400": (
        400,
        "This model's maximum context length is 32768 tokens. However, you requested 99999 tokens.",
    ),
    "overloaded": (503, "stub: the server is overloaded"),
}
"""What the refusal scenarios answer, before any token."""


def _overflow_message(window: int, prompt: int, output: int) -> str:
    """vLLM 0.32's renderer wording: it tokenizes only one token past the room left, so the
    prompt is "at least" that long whatever its real length."""
    counted = min(prompt, max(window - output, 0) + 1)
    return (
        f"This model's maximum context length is {window} tokens. However, you requested "
        f"{output} output tokens and your prompt contains at least {counted} input tokens, for a "
        f"total of at least {counted + output} tokens. Please reduce the length of the input "
        f"prompt or the number of requested output tokens. "
        f"(parameter=input_tokens, value={counted})"
    )


def stub_site(settings: StubSettings, clock: IReactorTime, log: StubLog) -> Site:
    site = Site(StubResource(settings, clock, log))
    site.displayTracebacks = False
    site.noisy = False
    return site


class Options(usage.Options):
    synopsis = "[options]"
    longdesc = (
        "A vLLM-faithful stub upstream. Scenarios (a word in the prompt): "
        + ", ".join(f"{k} ({v})" for k, v in SCENARIOS.items())
        + ". Completions take all but "
        + ", ".join(sorted(CHAT_ONLY))
        + "; embeddings only "
        + ", ".join(sorted(EMBEDDING_SCENARIOS))
        + "."
    )
    optParameters = [
        ["port", "p", "8001", "Port, or a Twisted endpoint string, to listen on", str],
        ["interface", None, "127.0.0.1", "Interface for a plain port number", str],
        ["hold", None, 0.0, "Seconds before the first token (the prefill)", float],
        ["delay", None, 0.0, "Seconds between tokens", float],
        ["reasoning-tokens", None, 8, "Reasoning tokens per answer (0: no reasoning)", int],
        ["content-tokens", None, 8, "Content tokens per answer", int],
        ["reasoning-field", None, "reasoning", "reasoning | reasoning_content | both", str],
        ["max-model-len", None, None, "Context window, enforced as vLLM's", int],
        ["embedding-size", None, 8, "Length of an embedding (the model's hidden size)", int],
        ["load-time", None, 0.0, "Seconds after start before the port opens (a model load)", float],
        ["log", None, None, "Append a line per request start, completion, cancellation, hangup"],
    ]

    def __init__(self) -> None:
        super().__init__()
        self["models"] = []

    def opt_model(self, name: str) -> None:
        """Serve this model name (repeatable; default: answer any name)"""
        self["models"].append(name)

    optFlags = [
        ["enable-prompt-tokens-details", None, "Report prefix-cache hits in usage, as vLLM"],
    ]

    def postOptions(self) -> None:
        if self["reasoning-field"] not in ("reasoning", "reasoning_content", "both"):
            raise usage.UsageError("--reasoning-field must be reasoning, reasoning_content or both")

    def settings(self) -> StubSettings:
        return StubSettings(
            hold=self["hold"],
            delay=self["delay"],
            reasoning_tokens=self["reasoning-tokens"],
            content_tokens=self["content-tokens"],
            reasoning_field=self["reasoning-field"],
            models=tuple(self["models"]),
            max_model_len=self["max-model-len"],
            prompt_tokens_details=bool(self["enable-prompt-tokens-details"]),
            embedding_size=self["embedding-size"],
        )

    def endpoint_description(self) -> str:
        port = self["port"]
        return f"tcp:{port}:interface={self['interface']}" if port.isdigit() else port


def open_log(path: str | None) -> StubLog:
    return StubLog(open(path, "a", buffering=1) if path else None)


class LoadingService(StreamServerEndpointService):
    """Listens only `load_time` seconds after it starts: a server loading its model."""

    def __init__(
        self, endpoint: IStreamServerEndpoint, site: Site, clock: IReactorTime, load_time: float
    ) -> None:
        super().__init__(endpoint, site)
        self.clock = clock
        self.load_time = load_time
        self._loading: IDelayedCall | None = None

    def privilegedStartService(self) -> None:
        Service.privilegedStartService(self)

    def startService(self) -> None:
        Service.startService(self)
        listen = super().privilegedStartService
        self._loading = self.clock.callLater(self.load_time, listen)

    def stopService(self) -> Deferred[None]:
        if self._loading is not None and self._loading.active():
            self._loading.cancel()
            self.running = False
            return succeed(None)
        return super().stopService()


def makeService(options: Options) -> IService:
    from twisted.internet import reactor
    from twisted.internet.endpoints import serverFromString

    site = stub_site(options.settings(), reactor, open_log(options["log"]))
    endpoint = serverFromString(reactor, options.endpoint_description())
    return LoadingService(endpoint, site, reactor, options["load-time"])


def main(argv: list[str] | None = None) -> None:
    """`homelab-stub` / `python -m homelab_gateway.dev.stub`: the stub in the foreground."""
    from twisted.scripts.twistd import run

    sys.argv = [
        "twistd",
        "--nodaemon",
        "--pidfile=",
        "homelab-stub",
        *(sys.argv[1:] if argv is None else argv),
    ]
    run()


if __name__ == "__main__":
    main()
