"""Upstream context-overflow refusals -> Anthropic's wording, which Claude Code parses.

Each body below is as the server sends it (vLLM's VLLMValidationError through its error
response; llama.cpp's format_error_response for exceed_context_size_error; Ollama's runner).
"""

from __future__ import annotations

import json
import re

import pytest

from homelab_gateway.core.errors import ContextOverflow, context_overflow

# What Claude Code matches in an API error's message to size its recovery.
CLAUDE_CODE_PROMPT = re.compile(r"prompt is too long: (\d+) tokens > (\d+) maximum")
CLAUDE_CODE_TOTAL = re.compile(
    r"input length and `max_tokens` exceed context limit: (\d+) \+ (\d+) > (\d+)"
)


def vllm(message: str) -> bytes:
    error = {"message": message, "type": "BadRequestError", "param": "input_tokens", "code": 400}
    return json.dumps({"error": error}).encode()


CASES = [
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
    (  # llama.cpp's server
        json.dumps(
            {
                "error": {
                    "code": 400,
                    "message": "request (13392 tokens) exceeds the available context size "
                    "(8192 tokens), try increasing it",
                    "type": "exceed_context_size_error",
                    "n_prompt_tokens": 13392,
                    "n_ctx": 8192,
                }
            }
        ).encode(),
        ContextOverflow(13392, 8192),
    ),
    (  # Ollama's OpenAI layer
        json.dumps(
            {
                "error": {
                    "message": "the input length exceeds the context length",
                    "type": "invalid_request_error",
                    "param": None,
                    "code": None,
                }
            }
        ).encode(),
        ContextOverflow(None, None),
    ),
]


@pytest.mark.parametrize(("body", "expected"), CASES)
def test_each_upstreams_overflow_is_recognised_with_its_numbers(
    body: bytes, expected: ContextOverflow
) -> None:
    assert context_overflow(body) == expected


@pytest.mark.parametrize(
    "body",
    [
        vllm("The model `x` does not exist."),
        b"upstream exploded",
        b'{"error": "model not found"}',
        vllm("max_tokens must be at least 1, got 0."),
    ],
)
def test_other_errors_are_not_overflows(body: bytes) -> None:
    assert context_overflow(body) is None


def test_the_prompt_alone_too_long_is_anthropics_prompt_is_too_long() -> None:
    error = ContextOverflow(2100, 2048).error()
    assert error.status == 400 and error.error_type == "invalid_request_error"
    assert error.message == "prompt is too long: 2100 tokens > 2048 maximum"
    assert CLAUDE_CODE_PROMPT.search(error.message).groups() == ("2100", "2048")  # type: ignore[union-attr]
    # a prompt the upstream refused is longer than the window, even counted as exactly filling it
    assert (
        ContextOverflow(8192, 8192).error().message
        == "prompt is too long: 8193 tokens > 8192 maximum"
    )
    # too long on its own even though max_tokens was counted too
    assert ContextOverflow(3000, 2048, 100).error().message.startswith("prompt is too long: 3000")


def test_a_prompt_that_fits_without_its_max_tokens_is_the_max_tokens_wording() -> None:
    message = ContextOverflow(2778, 4096, 8000).error().message
    assert message == (
        "input length and `max_tokens` exceed context limit: 2778 + 8000 > 4096, "
        "decrease input length or `max_tokens` and try again"
    )
    assert CLAUDE_CODE_TOTAL.search(message).groups() == ("2778", "8000", "4096")  # type: ignore[union-attr]


def test_with_no_numbers_at_all_it_still_says_prompt_is_too_long() -> None:
    assert ContextOverflow(None, None).error().message.startswith("prompt is too long")
