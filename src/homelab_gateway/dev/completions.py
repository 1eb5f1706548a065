"""What the stub answers on /v1/completions, as vLLM writes it: a chat completion's pacing and
faults, with text choices, vLLM's default of 16 tokens and its end-of-stream token."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from twisted.web.server import Request

from homelab_gateway.dev.generation import (
    CHAT_ONLY,
    CONTENT_TEXT,
    SCENARIOS,
    Batch,
    Generation,
    batch,
    frame,
    is_int,
    prompt_details,
    words,
)
from homelab_gateway.dev.state import Stub, StubSettings

COMPLETION_MAX_TOKENS = 16
"""vLLM's CompletionRequest.max_tokens default (chat has none: the context's room is the cap)."""


class Completion(Batch, Generation):
    """A legacy text completion (/v1/completions), as vLLM's OpenAIServingCompletion writes it:
    a choice per prompt, a chunk per token and prompt, `finish_reason` on the last token when
    max_tokens cuts it, else on an empty chunk after it (the EOS token, counted as vLLM does)."""

    endpoint = "completions"
    prompt_field = "prompt"
    scenarios = SCENARIOS.keys() - CHAT_ONLY
    LONG_LINE = b'data: {"choices": [{"index": 0, "text": "'

    def __init__(self, stub: Stub, request: Request, body: dict[str, Any], request_id: str) -> None:
        super().__init__(stub, request, body, request_id)
        max_tokens = body.get("max_tokens")
        self.max_tokens: int = COMPLETION_MAX_TOKENS if max_tokens is None else max_tokens
        self.choice_tokens = 0  # each choice's tokens so far (they all advance together)

    @classmethod
    def invalid(cls, body: dict[str, Any], settings: StubSettings) -> str | None:
        prompt, max_tokens = body.get("prompt"), body.get("max_tokens")
        if prompt is None or prompt == "":
            return "Either prompt or prompt_embeds must be provided and non-empty."
        if batch(prompt) is None:
            return "prompt: Input should be a valid string"
        if max_tokens is not None and not is_int(max_tokens):
            return "max_tokens: Input should be a valid integer"
        if max_tokens is not None and max_tokens < 1:
            return f"max_tokens must be at least 1, got {max_tokens}."
        if body.get("stream_options") and not body.get("stream"):
            return "Stream options can only be defined when `stream=True`."
        return None

    @property
    def output_tokens(self) -> int:
        return self.max_tokens

    def _content(self) -> int:
        return 2000 if self.scenario == "long" else self.stub.settings.content_tokens

    def _tokens(self, *, short: bool) -> Iterator[bytes]:
        """Content tokens until max_tokens (a few if `short`), the last one finishing the
        choices with `length` when max_tokens is what stopped them."""
        count = min(2 if short else self._content(), self.max_tokens)
        cut = not short and self._content() >= self.max_tokens
        for step, word in enumerate(words(CONTENT_TEXT, count)):
            yield self._choices(word, "length" if cut and step == count - 1 else None, count=True)

    def _close(self) -> Iterator[bytes]:
        if self.scenario == "abort":
            self.finish_reason = "abort"
            yield self._choices("", "abort")
        elif self._content() >= self.max_tokens:
            self.finish_reason = "length"  # said by the last token
        else:
            self.finish_reason = "stop"
            stops = self.body.get("stop")
            stop_reason = None
            if self.scenario == "stop" and stops:
                stop_reason = stops if isinstance(stops, str) else stops[0]
            yield self._choices("", "stop", stop_reason, count=True)

    def _choices(
        self, text: str, finish: str | None, stop_reason: Any = None, *, count: bool = False
    ) -> bytes:
        """One step of every choice: a `text_completion` chunk each (vLLM merges the prompts'
        streams; the stub's advance in step). Dumped with exclude_unset, as vLLM's are."""
        if count:
            self.choice_tokens += 1
            self.completion_tokens += len(self.prompts)
        frames = []
        for index, prompt in enumerate(self.prompts):
            choice = {
                "index": index,
                "text": text,
                "logprobs": None,
                "finish_reason": finish,
                "stop_reason": stop_reason,
                "prompt_token_ids": None,
                "token_ids": None,
            }
            chunk: dict[str, Any] = {**self._head(), "choices": [choice]}
            if self.continuous:  # this prompt's, and this choice's, with no details
                chunk["usage"] = {
                    "prompt_tokens": len(prompt),
                    "total_tokens": len(prompt) + self.choice_tokens,
                    "completion_tokens": self.choice_tokens,
                }
            frames.append(frame(chunk))
        return b"".join(frames)

    def _head(self) -> dict[str, Any]:
        return {
            "id": f"cmpl-{self.id}",
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
        }

    def _totals(self, details: dict[str, Any]) -> dict[str, Any]:
        usage: dict[str, Any] = {
            "prompt_tokens": self.prompt_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "completion_tokens": self.completion_tokens,
        }
        if self.stub.settings.prompt_tokens_details:
            usage["prompt_tokens_details"] = details
        return usage

    def _usage_frame(self) -> bytes:
        """The final usage chunk, dumped with exclude_none: vLLM takes the cache hits from the
        first output to arrive (the stub's first prompt)."""
        details = prompt_details(len(self.prompts[0]), self.cache_hits[0])
        return frame({**self._head(), "choices": [], "usage": self._totals(details)})

    def answer_whole(self) -> bytes:
        """vLLM's CompletionResponse.model_dump(): every field, nulls included, and the cache
        hits of the last prompt's output."""
        choices = [
            {
                "index": index,
                "text": "",
                "logprobs": None,
                "finish_reason": None,
                "stop_reason": None,
                "token_ids": None,
                "prompt_logprobs": None,
                "prompt_token_ids": None,
                "routed_experts": None,
            }
            for index in range(len(self.prompts))
        ]
        for document in self._documents():
            for choice in document.get("choices", []):
                mine = choices[choice["index"]]
                mine["text"] += choice["text"]
                if choice["finish_reason"] is not None:
                    mine["finish_reason"] = choice["finish_reason"]
                    mine["stop_reason"] = choice["stop_reason"]
        details = prompt_details(len(self.prompts[-1]), self.cache_hits[-1])
        usage = self._totals({**details, "multimodal_tokens": None})
        usage.setdefault("prompt_tokens_details", None)
        usage["completion_tokens_details"] = None
        response = {
            **self._head(),
            "choices": choices,
            "service_tier": None,
            "system_fingerprint": None,
            "usage": usage,
            "kv_transfer_params": None,
            "ec_transfer_params": None,
            "metrics": None,
        }
        return json.dumps(response, separators=(",", ":"), ensure_ascii=False).encode()
