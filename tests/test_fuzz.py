"""Fuzzing what clients send: every answer is a 2xx or an Anthropic-shaped 4xx, never a 500
or a dropped connection. Bodies are posted over HTTP to a real twistd gateway."""

from __future__ import annotations

import http.client
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from homelab_gateway.config import ModelConfig
from homelab_gateway.core.mapping import InvalidRequest, map_request
from testsupport.grammar import check_stream
from testsupport.processes import one_upstream_config, start_gateway, start_stub

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=20),
    st.sampled_from(["", "\u0000", "\ud7ff\ue000", "\U0001f600" * 5, "\u202e", "user"]),
)
json_values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)
blocks = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=30)}),
    st.fixed_dictionaries(
        {
            "type": st.just("image"),
            "source": st.fixed_dictionaries(
                {
                    "type": st.sampled_from(["base64", "url", "file"]),
                    "media_type": st.sampled_from(["image/png", "image/jpeg", "text/plain"]),
                    "data": st.sampled_from(["aGk=", "!!!notbase64", "", "aGk"]),
                    "url": st.sampled_from(["https://example.org/a.png", "file:///etc/passwd", ""]),
                }
            ),
        }
    ),
    st.fixed_dictionaries(
        {
            "type": st.just("tool_use"),
            "id": st.text(max_size=6),
            "name": st.text(max_size=6),
            "input": json_values,
        }
    ),
    st.fixed_dictionaries(
        {"type": st.just("tool_result"), "tool_use_id": st.text(max_size=6), "content": json_values}
    ),
    st.fixed_dictionaries(
        {"type": st.sampled_from(["thinking", "redacted_thinking", "document", "video", ""])}
    ),
    json_values,
)
messages = st.lists(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["user", "assistant", "system", "tool", ""]),
            "content": st.one_of(st.text(max_size=40), st.lists(blocks, max_size=4), json_values),
        }
    )
    | json_values,
    max_size=4,
)
# Any text as a model name, lone surrogates included: none may become a metric label.
model_names = st.one_of(
    st.sampled_from(["reasoning", "ghost", "", 5, None]),
    st.text(st.characters(exclude_categories=()), max_size=12),
)
request_bodies = st.fixed_dictionaries(
    {"model": model_names},
    optional={
        "max_tokens": st.one_of(st.integers(-5, 2**64), st.sampled_from([0, 1, 64]), json_values),
        "messages": messages,
        "stream": st.one_of(st.booleans(), json_values),
        "system": st.one_of(st.text(max_size=20), st.lists(blocks, max_size=2), json_values),
        "tools": st.one_of(
            st.lists(
                st.fixed_dictionaries({"name": st.text(max_size=5), "input_schema": json_values}),
                max_size=2,
            ),
            json_values,
        ),
        "tool_choice": st.one_of(
            st.fixed_dictionaries({"type": st.sampled_from(["auto", "any", "tool", "x"])}),
            json_values,
        ),
        "temperature": st.one_of(st.floats(allow_nan=False), json_values),
        "top_k": json_values,
        "top_p": json_values,
        "stop_sequences": json_values,
        "metadata": json_values,
        "thinking": json_values,
        "output_config": json_values,
        "unknown_field": json_values,
    },
)
raw_bodies = st.one_of(
    request_bodies.map(lambda b: json.dumps(b).encode()),
    st.binary(max_size=60),
    st.integers(1, 5000).map(lambda n: b"[" * n + b"]" * n),
    st.sampled_from(
        [
            b"",
            b"null",
            b"[]",
            b'"x"',
            b'{"model": NaN}',
            b'{"max_tokens": Infinity}',
            b'{"model": "reasoning", "max_tokens": 1e999}',
            b'{"model": "x\\ud800", "max_tokens": 1, "messages": []}',
        ]
    ),
)


def valid_base(body: dict[str, Any]) -> dict[str, Any]:
    return {
        "model": "reasoning",
        "max_tokens": 16,
        "messages": [{"role": "user", "content": "hi"}],
        **body,
    }


@settings(max_examples=250, suppress_health_check=[HealthCheck.too_slow])
@given(request_bodies.map(valid_base))
def test_mapping_only_ever_raises_invalid_request(body: dict[str, Any]) -> None:
    model = ModelConfig(
        name="reasoning", upstream="v", upstream_model="m", map_thinking=True, map_effort=True
    )
    try:
        mapped = map_request(body, model)
    except InvalidRequest as e:
        assert str(e).split(":")[0], "a 400 must name the field"
    else:
        json.dumps(mapped.body)  # what goes upstream is always serialisable


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, int]]:
    cwd: Path = tmp_path_factory.mktemp("fuzz")
    stub, stub_url = start_stub(cwd, "--content-tokens", "3", "--reasoning-tokens", "2")
    process, url = start_gateway(cwd, one_upstream_config(stub_url, slots=4))
    parts = urlsplit(url)
    address = parts.hostname or "127.0.0.1", parts.port or 0
    yield address
    connection = http.client.HTTPConnection(*address, timeout=20)
    connection.request("GET", "/metrics")
    scrape = connection.getresponse()
    assert scrape.status == 200, "a fuzzed model name broke /metrics"
    labels = set(re.findall(r'model="([^"]*)"', scrape.read().decode()))
    assert labels <= {"reasoning", "unknown", ""}, "fuzzed model names became labels"
    connection.close()
    process.stop()
    stub.stop()
    assert "Unhandled" not in "".join(process.output)


def post(address: tuple[str, int], body: bytes) -> tuple[int, bytes]:
    connection = http.client.HTTPConnection(*address, timeout=20)
    try:
        connection.request(
            "POST", "/llm/v1/messages", body=body, headers={"content-type": "application/json"}
        )
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def check_answer(status: int, payload: bytes) -> None:
    if status == 200 and payload.startswith(b"event:"):
        frames = [
            json.loads(line[6:]) for line in payload.split(b"\n") if line.startswith(b"data: ")
        ]
        assert check_stream(frames, allow_queue=False) in ("complete", "error")
        return
    document = json.loads(payload)
    if status == 200:
        assert document["type"] == "message"
        return
    assert document["type"] == "error" and document["error"]["message"], document
    # 4xx: the client's mistake. 502/529 only as an honest upstream failure (the stub acting
    # out a scenario word the fuzzer happened to write), never a gateway 500.
    assert 400 <= status < 500 or (
        status in (502, 529) and "upstream" in document["error"]["message"]
    ), (status, document)


@settings(
    max_examples=250,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(raw_bodies)
def test_any_body_gets_a_2xx_or_an_anthropic_4xx(gateway: tuple[str, int], body: bytes) -> None:
    status, payload = post(gateway, body)
    check_answer(status, payload)


@pytest.fixture(scope="module")
def misbehaving(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """A gateway in front of a stub that breaks the rules when a prompt asks it to; pings
    every 0.2 s so a stream left open after `message_stop` shows one."""
    cwd: Path = tmp_path_factory.mktemp("misbehaving")
    stub, stub_url = start_stub(cwd, "--content-tokens", "3", "--reasoning-tokens", "2")
    process, url = start_gateway(
        cwd, one_upstream_config(stub_url, slots=1, server="ping_interval = 0.2")
    )
    yield url, stub_url.removesuffix("/v1")
    process.stop()
    stub.stop()
    assert "Unhandled" not in "".join(process.output)


def get(url: str) -> dict[str, Any]:
    parts = urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=10)
    try:
        connection.request("GET", parts.path)
        return json.loads(connection.getresponse().read())
    finally:
        connection.close()


MISBEHAVIOURS = ["open-after-done", "endless-error", "long-line", "hangup", "fail", "default"]


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(st.sampled_from(MISBEHAVIOURS), st.booleans(), st.integers(0, 10**6))
def test_a_misbehaving_upstream_never_holds_a_slot_past_the_answer(
    misbehaving: tuple[str, str], scenario: str, stream: bool, n: int
) -> None:
    """Whatever the upstream does (a body open after [DONE], an endless error body or line,
    reading a request and hanging up), the client is answered well inside `idle_timeout`
    (300 s; the client here gives up after 20), nothing follows `message_stop`, the slot is
    free once the answer is in, and the upstream saw the request once."""
    gateway_url, stub_url = misbehaving
    body = {
        "model": "reasoning",
        "max_tokens": 16,
        "stream": stream,
        "messages": [{"role": "user", "content": f"{scenario} #{n}"}],
    }
    before = get(stub_url + "/stub/status")
    parts = urlsplit(gateway_url)
    status, payload = post(
        (parts.hostname or "127.0.0.1", parts.port or 0), json.dumps(body).encode()
    )
    check_answer(status, payload)
    names = [line[7:] for line in payload.split(b"\n") if line.startswith(b"event: ")]
    if b"message_stop" in names:
        assert names[-1] == b"message_stop", names[-3:]
    assert get(gateway_url + "/llm/v1/status")["upstreams"]["vllm"]["in_use"] == 0
    after = get(stub_url + "/stub/status")
    assert after["requests"] - before["requests"] == 1, "the upstream was sent it twice"
