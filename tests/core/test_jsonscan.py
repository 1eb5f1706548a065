"""`TopLevelObject`: a whole answer's top-level `usage`, wherever it stands, however the
answer is split into reads."""

from __future__ import annotations

import json
from typing import Any

import orjson
from hypothesis import given
from hypothesis import strategies as st

from homelab_gateway.core.jsonscan import TopLevelObject
from homelab_gateway.core.openai import WholeRelay

KEYS = st.sampled_from(["usage", "usag", "usages", 'us"age', "u\\sage", "x", ""]) | st.text(
    max_size=6
)
values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**53), 2**53)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.sampled_from(["usage", '"usage":{}', "\\", '\\"', "{[", "]}"])
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(KEYS, inner, max_size=3),
    max_leaves=12,
)


def scanned(data: bytes, cuts: list[int]) -> dict[str, Any] | None:
    scanner = TopLevelObject("usage")
    points = sorted({min(c, len(data)) for c in cuts})
    for a, b in zip([0, *points], [*points, len(data)], strict=True):
        scanner.feed(data[a:b])
    return scanner.value


@given(
    st.dictionaries(KEYS, values, max_size=5),
    st.lists(st.integers(0, 600), max_size=8),
    st.booleans(),
)
def test_the_top_level_object_is_found_however_the_answer_is_split(
    document: dict[str, Any], cuts: list[int], spaced: bool
) -> None:
    data = json.dumps(document).encode() if spaced else orjson.dumps(document)
    usage = document.get("usage")
    assert scanned(data, cuts) == (usage if isinstance(usage, dict) else None)


def test_the_usage_before_megabytes_of_prompt_logprobs_is_read() -> None:
    """vLLM with `prompt_logprobs`, `return_token_ids` or `return_prompt_text` writes `usage`
    before those fields: 8 tokens were charged where the answer said 700."""
    usage = {"prompt_tokens": 600, "completion_tokens": 100, "total_tokens": 700}
    document = {
        "id": "chatcmpl-1",
        "model": "Qwen/QwQ-32B",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}}],
        "usage": usage,
        "prompt_logprobs": [None]
        + [
            {str(i): {"logprob": -1.5, "rank": 1, "decoded_token": ' "usage":{'}}
            for i in range(600)
        ],
        "prompt_token_ids": list(range(600)),
        "prompt_text": "a long prompt\n" * 400,
    }
    data = orjson.dumps(document)
    relay = WholeRelay("mine")
    out = b"".join(relay.feed(data[at : at + 1000]) for at in range(0, len(data), 1000))
    out += relay.end()
    assert relay.usage == usage
    assert orjson.loads(out) == {**document, "model": "mine"}


def test_a_usage_that_is_no_object_or_too_long_is_none() -> None:
    assert scanned(b'{"usage":null,"x":{"a":1}}', []) is None
    assert scanned(b'{"usage":[{"a":1}]}', []) is None
    long = TopLevelObject("usage", limit=10)
    long.feed(b'{"usage":{"prompt_tokens":12345')
    long.feed(b"}}")
    assert long.value is None
