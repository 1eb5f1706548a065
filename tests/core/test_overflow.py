"""A context overflow -> Anthropic's wording, which Claude Code parses. How each kind of
upstream words its overflow is in tests/upstream/test_kinds.py."""

from __future__ import annotations

import re

from homelab_gateway.core.errors import ContextOverflow

# What Claude Code matches in an API error's message to size its recovery.
CLAUDE_CODE_PROMPT = re.compile(r"prompt is too long: (\d+) tokens > (\d+) maximum")
CLAUDE_CODE_TOTAL = re.compile(
    r"input length and `max_tokens` exceed context limit: (\d+) \+ (\d+) > (\d+)"
)


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
