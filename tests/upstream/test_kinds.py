"""Upstream kinds: each server's health probe, overflow wording and extensions, as its source
has them (vLLM's api_server, llama.cpp's tools/server, Ollama's server/routes.go and
llm/llama_server.go), and a gateway that sends a kind only what it takes."""

from __future__ import annotations

import ast
import json
from pathlib import Path
from typing import Any

import pytest
from twisted.trial.unittest import TestCase
from twisted.web.resource import Resource
from twisted.web.server import Site

import homelab_gateway.upstream as upstream_package
from homelab_gateway.config import ConfigError, parse_config
from homelab_gateway.core.errors import ContextOverflow
from homelab_gateway.upstream.kinds import KINDS, Health
from homelab_gateway.upstream.kinds.llamacpp import LLAMA_CPP
from homelab_gateway.upstream.kinds.ollama import OLLAMA
from homelab_gateway.upstream.kinds.openai import OPENAI
from homelab_gateway.upstream.kinds.vllm import VLLM
from tests.core.test_core_imports import imports_alone
from tests.surfaces.test_proxy import async_test
from testsupport.helpers import Servers, chat, gateway_document, raw_request, wait_for


def error_body(message: str, **fields: Any) -> bytes:
    return json.dumps({"error": {"message": message, **fields}}).encode()


def vllm(message: str) -> bytes:
    """vLLM's VLLMValidationError through its error response."""
    return error_body(message, type="BadRequestError", param="input_tokens", code=400)


VLLM_OVERFLOWS = [
    (  # vLLM 0.2x-0.32 renderer: the prompt counted only to the room left
        vllm(
            "This model's maximum context length is 2048 tokens. However, you requested 100 "
            "output tokens and your prompt contains at least 1949 input tokens, for a total of "
            "at least 2049 tokens. Please reduce the length of the input prompt or the number of "
            "requested output tokens. (parameter=input_tokens, value=1949)"
        ),
        ContextOverflow(1949, 2048, 100, at_least=True),
    ),
    (  # the same with no output requested (max_tokens left to the server)
        vllm(
            "This model's maximum context length is 2048 tokens. However, you requested 0 output "
            "tokens and your prompt contains at least 2049 input tokens, for a total of at least "
            "2049 tokens."
        ),
        ContextOverflow(2049, 2048, None, at_least=True),
    ),
    (  # vLLM early 2026 renderer
        vllm(
            "You passed 31745 input tokens and requested 1024 output tokens. However, the model's "
            "context length is only 32768 tokens, resulting in a maximum input length of 31744 "
            "tokens. Please reduce the length of the input prompt. "
            "(parameter=input_tokens, value=31745)"
        ),
        ContextOverflow(31745, 32768, 1024, at_least=True),
    ),
    (  # its character pre-check: no token count at all
        vllm(
            "You passed 900000 input characters and requested 1024 output tokens. However, the "
            "model's context length is only 32768 tokens, resulting in a maximum input length of "
            "31744 tokens (at most 888832 characters). Please reduce the length of the input "
            "prompt."
        ),
        ContextOverflow(None, 32768, 1024, at_least=True),
    ),
    (  # vLLM 0.6-0.10, the example
        vllm(
            "This model's maximum context length is 2048 tokens. However, your prompt contains "
            "2100 input tokens, please reduce the length of the input messages."
        ),
        ContextOverflow(2100, 2048),
    ),
    (
        vllm(
            "This model's maximum context length is 50000 tokens. However, your prompt contains "
            "at least 50001 input tokens"
        ),
        ContextOverflow(50001, 50000, at_least=True),
    ),
    (
        vllm(
            "This model's maximum context length is 4096 tokens. However, your request has 5000 "
            "input tokens. Please reduce the length of the input messages."
        ),
        ContextOverflow(5000, 4096),
    ),
    (  # vLLM's max_tokens check
        vllm(
            "'max_tokens' or 'max_completion_tokens' is too large: 8000. This model's maximum "
            "context length is 4096 tokens and your request has 2778 input tokens "
            "(8000 > 4096 - 2778). None"
        ),
        ContextOverflow(2778, 4096, 8000),
    ),
    (  # the oldest vLLM serving layer
        vllm(
            "This model's maximum context length is 131072 tokens. However, you requested 611051 "
            "tokens (603051 in the messages, 8000 in the completion). Please reduce the length "
            "of the messages or completion."
        ),
        ContextOverflow(603051, 131072, 8000),
    ),
    (
        vllm(
            "This model's maximum context length is 4096 tokens. However, you requested 5000 "
            "tokens in the messages, Please reduce the length of the messages."
        ),
        ContextOverflow(5000, 4096),
    ),
]
LLAMA_CPP_REFUSAL = error_body(  # format_error_response for ERROR_TYPE_EXCEED_CONTEXT_SIZE
    "request (13392 tokens) exceeds the available context size (8192 tokens), try increasing it",
    code=400,
    type="exceed_context_size_error",
    n_prompt_tokens=13392,
    n_ctx=8192,
)
LLAMA_CPP_OVERFLOWS = [
    (LLAMA_CPP_REFUSAL, ContextOverflow(13392, 8192)),
    (  # the numbers only in the message
        error_body(
            "request (5000 tokens) exceeds the available context size (4096 tokens), try "
            "increasing it"
        ),
        ContextOverflow(5000, 4096),
    ),
    (  # older builds: the type, and no number at all
        error_body(
            "the request exceeds the available context size, try increasing it",
            code=400,
            type="exceed_context_size_error",
        ),
        ContextOverflow(None, None),
    ),
]
OLLAMA_OVERFLOWS = [
    (  # its runner (and its embeddings' check): no number
        error_body(
            "the input length exceeds the context length",
            type="invalid_request_error",
            param=None,
            code=None,
        ),
        ContextOverflow(None, None),
    ),
    (  # llm/llama_server.go with no context shift
        error_body(
            "the prompt is longer than the context length currently available to the model; "
            "shorten the prompt or adjust the context length in settings",
            type="invalid_request_error",
        ),
        ContextOverflow(None, None),
    ),
    (  # the llama.cpp server it runs refused it: that body is Ollama's message
        error_body(LLAMA_CPP_REFUSAL.decode(), type="invalid_request_error"),
        ContextOverflow(13392, 8192),
    ),
]
NOT_OVERFLOWS = [
    vllm("The model `x` does not exist."),
    b"upstream exploded",
    b'{"error": "model not found"}',
    vllm("max_tokens must be at least 1, got 0."),
    error_body("Loading model", type="unavailable_error", code=503),
]


@pytest.mark.parametrize(
    ("kind", "body", "expected"),
    [(VLLM, body, expected) for body, expected in VLLM_OVERFLOWS]
    + [(LLAMA_CPP, body, expected) for body, expected in LLAMA_CPP_OVERFLOWS]
    + [(OLLAMA, body, expected) for body, expected in OLLAMA_OVERFLOWS],
)
def test_each_kind_recognises_its_overflow_with_its_numbers(
    kind: Any, body: bytes, expected: ContextOverflow
) -> None:
    assert kind.overflow(body) == expected


@pytest.mark.parametrize(
    ("body", "expected"), VLLM_OVERFLOWS + LLAMA_CPP_OVERFLOWS + OLLAMA_OVERFLOWS
)
def test_any_openai_server_is_read_in_every_known_wording(
    body: bytes, expected: ContextOverflow
) -> None:
    assert OPENAI.overflow(body) == expected


@pytest.mark.parametrize("kind", KINDS.values(), ids=KINDS)
@pytest.mark.parametrize("body", NOT_OVERFLOWS)
def test_other_errors_are_no_overflow_for_any_kind(kind: Any, body: bytes) -> None:
    assert kind.overflow(body) is None


@pytest.mark.parametrize(
    ("kind", "probe"),
    [
        (VLLM, "http://gpu:8000/health"),
        (LLAMA_CPP, "http://gpu:8000/health"),
        (OLLAMA, "http://gpu:8000/"),
        (OPENAI, "http://gpu:8000/v1/models"),
    ],
)
def test_each_kind_probes_its_own_endpoint(kind: Any, probe: str) -> None:
    assert kind.probe("http://gpu:8000/v1") == probe


@pytest.mark.parametrize(
    ("kind", "status", "body", "health"),
    [
        (VLLM, 200, b"", Health(True, "ok")),
        (VLLM, 503, b"", Health(False, "GET /health answered 503")),  # its engine died
        (LLAMA_CPP, 200, b'{"status":"ok"}', Health(True, "ok")),
        (
            LLAMA_CPP,
            503,
            error_body("Loading model", type="unavailable_error", code=503),
            Health(False, "GET /health answered 503: Loading model"),
        ),
        (OLLAMA, 200, b"Ollama is running", Health(True, "ok")),
        (OLLAMA, 200, b"{}", Health(False, "GET / answered, but not as Ollama does")),
        (OLLAMA, 404, b"404 page not found", Health(False, "GET / answered 404")),
        (OPENAI, 200, b'{"object":"list","data":[]}', Health(True, "ok")),
        (OPENAI, 401, b"", Health(False, "GET /models answered 401")),
    ],
)
def test_each_kind_reads_its_probes_answer(
    kind: Any, status: int, body: bytes, health: Health
) -> None:
    assert kind.health(status, body) == health


def test_only_vllm_takes_its_extensions() -> None:
    chat_body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": []}
    assert VLLM.continuous_usage_stats and VLLM.priority == {
        "interactive": -1,
        "normal": 0,
        "batch": 1,
    }
    url, payload = VLLM.tokenize("http://gpu:8000/v1", chat_body) or ("", b"")
    assert url == "http://gpu:8000/tokenize"
    assert json.loads(payload) == {**chat_body, "add_generation_prompt": True}
    assert VLLM.counted(b'{"count": 7, "max_model_len": 64, "tokens": []}') == (7, 64)
    assert VLLM.counted(b'{"count": -1, "max_model_len": true}') == (None, None)
    listing = b'{"data": [{"id": "a", "max_model_len": 64}, {"id": "b", "max_model_len": 0}]}'
    assert VLLM.windows(listing) == {"a": 64}
    for kind in (LLAMA_CPP, OLLAMA, OPENAI):
        assert not kind.continuous_usage_stats and kind.priority is None, kind.name
        assert kind.tokenize("http://gpu:8000/v1", chat_body) is None, kind.name
        assert kind.listing("http://gpu:8000/v1") is None, kind.name


def upstream(**fields: Any) -> dict[str, Any]:
    return {
        "upstreams": {"v": {"url": "http://gpu:8000/v1", "slots": 1, **fields}},
        "models": {"m": {"upstream": "v"}},
    }


def config_error(document: dict[str, Any]) -> str:
    with pytest.raises(ConfigError) as info:
        parse_config(document, source="gw.toml", environ={})
    message = str(info.value)
    assert "\n" not in message
    return message


def test_the_kind_is_vllm_unless_it_says_otherwise() -> None:
    assert parse_config(upstream(), source="gw.toml", environ={}).upstreams["v"].kind == "vllm"
    for name in KINDS:
        config = parse_config(upstream(kind=name), source="gw.toml", environ={})
        assert config.upstreams["v"].kind == name


def test_an_unknown_kind_is_one_line_naming_it() -> None:
    assert config_error(upstream(kind="tgi")) == (
        "gw.toml: upstreams.v.kind: must be one of vllm, llama.cpp, ollama, openai, got 'tgi'"
    )


def test_forward_priority_is_refused_for_a_kind_without_one() -> None:
    message = config_error(upstream(kind="ollama", forward_priority=True))
    assert message == "gw.toml: upstreams.v.forward_priority: kind 'ollama' takes no priority field"


class FakeServer(Resource):
    """A server's GET answers: path -> (status, body)."""

    isLeaf = True

    def __init__(self, answers: dict[bytes, tuple[int, bytes]]) -> None:
        super().__init__()
        self.answers = answers

    def render_GET(self, request: Any) -> bytes:
        status, body = self.answers.get(request.path, (404, b"404 page not found"))
        request.setResponseCode(status)
        return body


class Probes(TestCase):
    """The background probe asks each upstream as its kind says, on real sockets."""

    def gateway(self, answers: dict[bytes, tuple[int, bytes]], kind: str) -> Any:
        servers = Servers(self)
        server = FakeServer(answers)
        url = f"http://127.0.0.1:{servers.listen(Site(server))}/v1"
        servers.start_gateway(
            gateway_document(url, upstream={"kind": kind}, server={"probe_interval": 0.2})
        )
        readiness = servers.gateway.readiness
        readiness.start()
        self.addCleanup(readiness.stop)
        return server, readiness

    @async_test
    async def test_llama_cpp_is_not_ready_while_it_loads_its_model(self) -> None:
        loading = (503, error_body("Loading model", type="unavailable_error", code=503))
        server, readiness = self.gateway({b"/health": loading}, "llama.cpp")
        await wait_for(lambda: readiness.probes["vllm"].at is not None, what="a probe")
        self.assertEqual(
            readiness.report(),
            (
                False,
                {"vllm": {"ready": False, "detail": "GET /health answered 503: Loading model"}},
            ),
        )
        server.answers[b"/health"] = (200, b'{"status":"ok"}')
        await wait_for(lambda: readiness.report()[0], what="the model to be loaded")

    @async_test
    async def test_ollama_is_ready_when_it_says_it_runs(self) -> None:
        _, readiness = self.gateway({b"/": (200, b"Ollama is running")}, "ollama")
        await wait_for(lambda: readiness.report()[0], what="Ollama's probe")

    @async_test
    async def test_a_server_that_is_not_ollama_is_not_ready_as_one(self) -> None:
        _, readiness = self.gateway({b"/health": (200, b"")}, "ollama")
        await wait_for(lambda: readiness.probes["vllm"].at is not None, what="a probe")
        self.assertEqual(readiness.report()[1]["vllm"]["detail"], "GET / answered 404")

    @async_test
    async def test_vllm_with_a_dead_engine_is_not_ready_though_it_lists_models(self) -> None:
        models = (200, b'{"object":"list","data":[{"id":"m","max_model_len":64}]}')
        server, readiness = self.gateway({b"/health": (503, b""), b"/v1/models": models}, "vllm")
        await wait_for(lambda: readiness.probes["vllm"].at is not None, what="a probe")
        self.assertEqual(readiness.report()[1]["vllm"]["detail"], "GET /health answered 503")
        server.answers[b"/health"] = (200, b"")
        await wait_for(lambda: readiness.report()[0], what="a healthy engine")
        self.assertEqual(readiness.context_window("vllm", "m"), 64)  # from its listing

    @async_test
    async def test_any_openai_server_is_probed_by_its_model_listing(self) -> None:
        models = (200, b'{"object":"list","data":[{"id":"m","max_model_len":64}]}')
        server, readiness = self.gateway({b"/v1/models": (401, b"")}, "openai")
        await wait_for(lambda: readiness.probes["vllm"].at is not None, what="a probe")
        self.assertEqual(readiness.report()[1]["vllm"]["detail"], "GET /models answered 401")
        server.answers[b"/v1/models"] = models
        await wait_for(lambda: readiness.report()[0], what="its listing to answer")
        self.assertIsNone(readiness.context_window("vllm", "m"))  # no vLLM field is read


class Extensions(TestCase):
    """What the gateway sends an upstream of each kind, seen by the stub."""

    def start(self, kind: str, **upstream: Any) -> list[tuple[bytes, dict[str, Any]]]:
        self.servers = Servers(self)
        url, stub, _ = self.servers.stub()
        seen: list[tuple[bytes, dict[str, Any]]] = []
        render = stub.render_POST

        def recording(request: Any) -> Any:
            seen.append((request.path, json.loads(request.content.read())))
            request.content.seek(0)
            return render(request)

        stub.render_POST = recording  # type: ignore[method-assign]
        document = gateway_document(url, upstream={"kind": kind, **upstream})
        self.servers.start_gateway(document)
        return seen

    async def post(self, body: Any, path: str) -> Any:
        response = raw_request(self.servers.gateway_port, "POST", path, body)
        await response.closed
        self.assertEqual(response.status, 200, response.body_text())
        return response

    @async_test
    async def test_vllm_gets_its_extensions(self) -> None:
        seen = self.start("vllm", forward_priority=True)
        await self.post(chat(), "/llm/v1/messages")
        counted = {"model": "reasoning", "messages": [{"role": "user", "content": "a b c"}]}
        response = await self.post(counted, "/llm/v1/messages/count_tokens")
        self.assertEqual(json.loads(response.body_text()), {"input_tokens": 3 + 4})
        (path, body), (tokenize, _) = seen
        self.assertEqual((path, tokenize), (b"/v1/chat/completions", b"/tokenize"))
        self.assertEqual(
            body["stream_options"], {"include_usage": True, "continuous_usage_stats": True}
        )
        self.assertEqual(body["priority"], 0)

    @async_test
    async def test_any_openai_server_gets_nothing_beyond_openais_api(self) -> None:
        seen = self.start("openai")
        await self.post(chat(), "/llm/v1/messages")
        await self.post({"model": "reasoning", "input": "hi", "stream": True}, "/llm/v1/responses")
        await self.post(
            {"model": "reasoning", "messages": [{"role": "user", "content": "hi"}], "stream": True},
            "/llm/v1/chat/completions",
        )
        counted = {"model": "reasoning", "messages": [{"role": "user", "content": "a b c"}]}
        response = await self.post(counted, "/llm/v1/messages/count_tokens")
        self.assertNotEqual(json.loads(response.body_text()), {"input_tokens": 3 + 4})
        self.assertEqual([path for path, _ in seen], [b"/v1/chat/completions"] * 3)
        for _, body in seen:
            self.assertEqual(body["stream_options"], {"include_usage": True})
            self.assertNotIn("priority", body)


def test_the_kinds_import_without_twisted() -> None:
    """A kind is plain Python: the config and the core's parsing use it without a reactor."""
    result = imports_alone("homelab_gateway.upstream.kinds")
    assert result.returncode == 0, result.stderr


UPSTREAM = Path(upstream_package.__path__[0])


@pytest.mark.parametrize(
    "module", sorted(str(p.relative_to(UPSTREAM)) for p in UPSTREAM.rglob("*.py"))
)
def test_the_upstream_side_imports_nothing_of_the_surfaces(module: str) -> None:
    tree = ast.parse((UPSTREAM / module).read_text())
    names = [node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)]
    names += [a.name for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names]
    assert not [n for n in names if n.startswith("homelab_gateway.surfaces")], names
