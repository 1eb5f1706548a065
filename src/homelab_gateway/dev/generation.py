"""What the stub says as vLLM writes it (`stub` serves it): the scenarios a prompt picks, what
every endpoint's exchange shares, and a chat completion's chunks, paced on the clock and
pausable by its client (`completions` and `embeddings` build on these)."""

from __future__ import annotations

import hashlib
import json
import secrets
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Iterator
from typing import Any, ClassVar

from twisted.internet.interfaces import IDelayedCall
from twisted.web.server import Request

from homelab_gateway.dev.state import Stub, StubSettings

ENDLESS_CAP = 32 * 1024 * 1024
"""What "never ends" means for endless-error and long-line: past any sane gateway's limit, yet
a broken gateway reading it all cannot take the machine down; after it, silence."""
REASONING_TEXT = "The user wants a short friendly answer so I will greet them and keep it brief"
CONTENT_TEXT = "Hello! I am a stub model answering from the homelab gateway test upstream."
TOOL_ARGUMENTS = ['{"city', '": "', "Par", 'is", "unit', '": "c', 'elsius"}']
ENGINE_DIED = "stub: the engine died"

SCENARIOS = {
    "content-only": "content and no reasoning",
    "reasoning-only": "reasoning until max_tokens runs out (finish_reason length)",
    "tool": "a little text, then a tool call whose arguments arrive in fragments (after a tool "
    "result: content-only)",
    "parallel-tools": "two tool calls, index 0 and 1 (after a tool result: content-only)",
    "stop": "content, then a stop on the request's first stop string",
    "long": "2,000 content tokens",
    "fail": "a few tokens, then a vLLM error chunk and [DONE]",
    "garbage": "a few tokens, then a line that is not JSON",
    "reset": "a few tokens, then the connection is reset",
    "truncate": "a few tokens, then a clean close with no finish_reason or [DONE]",
    "stall": "a few tokens, then silence until the client leaves",
    "abort": "a few tokens, then finish_reason abort",
    "error500": "HTTP 500 before the stream",
    "error400": "HTTP 400 (prompt too long) before the stream",
    "overloaded": "HTTP 503 before the stream",
    "open-after-done": "the whole answer and [DONE], then the body stays open",
    "endless-error": "HTTP 500 whose body never ends (32 MiB, then silence)",
    "long-line": "a few tokens, then a data line that never ends (32 MiB, then silence)",
    "hangup": "reads the request, then closes the connection without answering",
}
TOOL_SCENARIOS = frozenset({"tool", "parallel-tools"})
"""Scenarios that call tools, unless the conversation ends with a tool result: then the stub
answers it with content-only, as a model answers its tools' output (an agent that sends the
output back would otherwise be called again forever)."""
CHAT_ONLY = frozenset({"content-only", "reasoning-only", *TOOL_SCENARIOS})
"""Scenarios about a chat message's parts: a text completion has no reasoning or tool calls."""
FAULTS = frozenset({"fail", "garbage", "reset", "truncate", "stall", "abort", "long-line"})
"""Scenarios that break a stream off after a few tokens."""


def prompt_words(messages: Any) -> list[str]:
    words: list[str] = []
    for message in messages if isinstance(messages, list) else ():
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            words.extend(content.split())
        elif isinstance(content, list):
            for part in content:
                if isinstance(part, dict) and isinstance(part.get("text"), str):
                    words.extend(part["text"].split())
    return words


def prompt_tokens(messages: Any) -> list[str]:
    """The prompt as the stub's tokens: a word each, and 4 for each message's framing."""
    tokens: list[str] = []
    for message in messages if isinstance(messages, list) else ():
        role = message.get("role") if isinstance(message, dict) else None
        tokens += [f"<{role}>", *prompt_words([message]), "", "", ""]
    return tokens


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value
    )


def batch(value: Any) -> list[str | list[int]] | None:
    """vLLM's `prompt` / `input` shapes as a list of items (a string, or token ids): a string, a
    list of ids, or a list of strings or of id lists; None for anything else."""
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not value:
        return None
    if _is_token_ids(value):
        return [value]
    if all(isinstance(v, str) for v in value) or all(_is_token_ids(v) for v in value):
        return list(value)
    return None


def text_tokens(item: str | list[int]) -> list[str]:
    """A completion prompt or an embedding input as the stub's tokens: a word each (no BOS, as
    /tokenize counts), or its token ids as they are."""
    return item.split() if isinstance(item, str) else [str(t) for t in item]


PREFIX_CACHE_BLOCK = 16  # vLLM's default block size: the prefix cache hits whole blocks


def cached_tokens(tokens: list[str], previous: list[str]) -> int:
    """vLLM's automatic prefix caching, for the stub's one remembered prompt: the whole blocks
    shared with it, and never the last token (vLLM always computes at least one)."""
    shared = 0
    for mine, theirs in zip(tokens, previous, strict=False):
        if mine != theirs:
            break
        shared += 1
    shared = min(shared, len(tokens) - 1)
    return shared - shared % PREFIX_CACHE_BLOCK


def prompt_details(prompt: int, cached: int) -> dict[str, int]:
    """vLLM's `prompt_tokens_details`: the prefix-cache hits, and what the prefill wrote to the
    cache (`PrefillStats.finalize`: the prompt's whole blocks, less those that were hits)."""
    return {
        "cached_tokens": cached,
        "created_cache_tokens": max(0, prompt - prompt % PREFIX_CACHE_BLOCK - cached),
    }


def digest(prompt: Any) -> str:
    """A short digest of the prompt: vLLM logs each request's prompt, the stub only this."""
    text = json.dumps(prompt, sort_keys=True).encode()
    return hashlib.sha256(text).hexdigest()[:16]


def _scenario(words: list[str], known: Collection[str]) -> str:
    for word in words:
        if word.lower() in known:
            return word.lower()
    return "default"


def words(text: str, n: int) -> Iterator[str]:
    """`n` tokens cycling through the words of `text`, each with its trailing space."""
    words = text.split()
    for i in range(n):
        yield words[i % len(words)] + " "


def literal(name: str, value: Any, allowed: tuple[str, ...]) -> str | None:
    """Pydantic's refusal of a value outside a Literal, as a 400's message."""
    if value in allowed:
        return None
    choices = ", ".join(f"'{a}'" for a in allowed[:-1]) + f" or '{allowed[-1]}'"
    return f"{name}: Input should be {choices}"


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class Exchange(ABC):
    """One request to one endpoint: its prompts as the stub's tokens, its scenario, and what
    every endpoint shares (in_flight, the log's lines, a client that leaves early)."""

    endpoint: ClassVar[str]
    scenarios: ClassVar[Collection[str]]
    prefix_cache: ClassVar[bool] = True  # whether vLLM's prefix cache sees it (and reports it)

    def __init__(self, stub: Stub, request: Request, body: dict[str, Any], request_id: str) -> None:
        self.stub = stub
        self.request = request
        self.body = body
        self.id = request_id
        self.model = body.get("model", "stub")
        self.created = int(time.time())
        self.streaming = False
        self.prompts = self._prompts()
        self.prompt_tokens = sum(len(p) for p in self.prompts)
        self.cache_hits = [0] * len(self.prompts)  # per prompt, set by the stub's prefix cache
        self.scenario = self._pick_scenario()
        self.completion_tokens = 0
        self.finish_reason: str | None = None
        self._call: IDelayedCall | None = None
        self._done = False

    @classmethod
    def invalid(cls, body: dict[str, Any], settings: StubSettings) -> str | None:
        """vLLM's validation of the request body: a 400's message, or None."""
        return None

    @abstractmethod
    def _prompts(self) -> list[list[str]]:
        """Each prompt (vLLM schedules a sequence for each) as the stub's tokens."""

    @abstractmethod
    def _scenario_words(self) -> list[str]:
        """The words a scenario is picked from."""

    def _pick_scenario(self) -> str:
        return _scenario(self._scenario_words(), self.scenarios)

    @property
    @abstractmethod
    def output_tokens(self) -> int:
        """The output tokens vLLM's context check adds to each prompt."""

    @property
    @abstractmethod
    def digest(self) -> str:
        """The digest of the prompt for the `start` line."""

    @abstractmethod
    def answer_whole(self) -> bytes:
        """The whole answer's body (setting any header of its own); HTTPError refuses it."""

    def log(self, event: str, **fields: Any) -> None:
        self.stub.log.write(event, self.id, endpoint=self.endpoint, **fields)

    def call_later(self, delay: float, f: Callable[[], None]) -> None:
        """Runs `f` on the stub's clock, unless the client leaves first."""
        self._call = self.stub.clock.callLater(delay, f)

    def finish(self, event: str) -> None:
        """The exchange is over: out of in_flight, and its one closing line in the log."""
        if self._done:
            return
        self._done = True
        self.stub.stats.in_flight -= 1
        self.stub.stats.completed += event == "complete"
        if event == "complete":
            self.log(event, finish=self.finish_reason, tokens=self.completion_tokens)
        else:
            self.log(event)

    def client_left(self, reason: Any) -> None:
        self._cancel_call()
        if not self._done:
            self.stub.stats.cancelled += 1
            self.finish("cancelled")

    def _cancel_call(self) -> None:
        if self._call is not None:
            self._call.cancel()
            self._call = None


class Batch:
    """An exchange whose prompt is a batch in one field (a completion's `prompt`, an
    embedding's `input`): a string, or a list of strings or token-id lists."""

    prompt_field: ClassVar[str]
    body: dict[str, Any]

    def _items(self) -> list[str | list[int]]:
        return batch(self.body.get(self.prompt_field)) or []

    def _prompts(self) -> list[list[str]]:
        return [text_tokens(item) for item in self._items()]

    def _scenario_words(self) -> list[str]:
        """Every word of every text prompt (token-id prompts have none)."""
        return [w for item in self._items() if isinstance(item, str) for w in item.split()]

    @property
    def digest(self) -> str:
        return digest(self.body.get(self.prompt_field))


class Generation(Exchange):
    """A chat completion: the chunks it sends, paced on the clock, pausable by the client. A
    subclass says other chunks with the same pacing, faults and usage framing."""

    endpoint = "chat"
    scenarios = SCENARIOS.keys()
    LONG_LINE = b'data: {"choices": [{"index": 0, "delta": {"content": "'

    def __init__(self, stub: Stub, request: Request, body: dict[str, Any], request_id: str) -> None:
        super().__init__(stub, request, body, request_id)
        self.streaming = bool(body.get("stream"))
        self._paused = False
        self._held_open = False
        self.sent = 0
        options = body.get("stream_options") or {}
        self.include_usage = bool(options.get("include_usage"))
        self.continuous = bool(options.get("continuous_usage_stats"))
        self._chunks = self._plan()

    def _prompts(self) -> list[list[str]]:
        return [prompt_tokens(self.body.get("messages"))]

    def _scenario_words(self) -> list[str]:
        messages = self.body.get("messages")
        messages = messages if isinstance(messages, list) else []
        last_user = [m for m in messages if isinstance(m, dict) and m.get("role") == "user"][-1:]
        return prompt_words(last_user)

    def _pick_scenario(self) -> str:
        """The last user message's scenario, but content-only for a tool scenario once the
        conversation ends with a tool result (the word stays in that user message)."""
        scenario = super()._pick_scenario()
        messages = self.body.get("messages")
        last = messages[-1] if isinstance(messages, list) and messages else None
        if scenario in TOOL_SCENARIOS and isinstance(last, dict) and last.get("role") == "tool":
            return "content-only"
        return scenario

    @property
    def output_tokens(self) -> int:
        output = self.body.get("max_tokens") or self.body.get("max_completion_tokens")
        return output if isinstance(output, int) else 0

    @property
    def digest(self) -> str:
        return digest(self.body.get("messages"))

    # -- what to say -------------------------------------------------------------------------

    def _plan(self) -> Iterator[bytes | str]:
        """Yields SSE payloads (bytes, already framed) or control words: 'reset', 'truncate',
        'stall', 'hold-open' (after [DONE]: leave the body open)."""
        scenario = self.scenario
        if scenario == "endless-error":
            yield b'{"error": {"message": "stub: '
            yield from _endless(16384)
            return
        yield from self._tokens(short=scenario in FAULTS)
        if scenario == "fail":
            error = {
                "message": ENGINE_DIED,
                "type": "InternalServerError",
                "param": None,
                "code": 500,
            }
            yield frame({"error": error})
            yield DONE_FRAME
            return
        if scenario == "garbage":
            yield b"data: {this is not json\n\n"
            return
        if scenario == "long-line":
            yield self.LONG_LINE
            yield from _endless(65536)
            return
        if scenario in ("reset", "truncate", "stall"):
            yield scenario
            return
        yield from self._close()
        if self.include_usage:
            yield self._usage_frame()
        yield DONE_FRAME
        if scenario == "open-after-done":
            yield "hold-open"

    def _counts(self) -> tuple[int, int, int]:
        """The reasoning and content tokens the scenario wants, and max_tokens."""
        settings = self.stub.settings
        max_tokens = self.body.get("max_tokens") or self.body.get("max_completion_tokens") or 10**9
        reasoning, content = settings.reasoning_tokens, settings.content_tokens
        if self.scenario in ("content-only", "tool", "parallel-tools", "stop", "long"):
            reasoning = 0
        if self.scenario == "long":
            content = 2000
        if self.scenario == "reasoning-only":
            reasoning, content = 10**9, 0
        return reasoning, content, max_tokens

    def _tokens(self, *, short: bool) -> Iterator[bytes]:
        """The role chunk, then reasoning and content until max_tokens (a few if `short`)."""
        reasoning_n, content_n, max_tokens = self._counts()
        if short:
            reasoning_n, content_n = min(reasoning_n, 2), 2
        yield self._chunk({"role": "assistant", "content": ""})
        reasoning = min(reasoning_n, max_tokens)
        content = min(content_n, max_tokens - reasoning)
        for word in words(REASONING_TEXT, reasoning):
            yield self._token(self._reasoning(word))
        if reasoning and content:
            yield self._chunk({"content": ""})
        for word in words(CONTENT_TEXT, content):
            yield self._token({"content": word, **self._null_reasoning()})

    def _close(self) -> Iterator[bytes]:
        """Any tool calls, then the finish chunk."""
        if self.scenario in TOOL_SCENARIOS:
            yield from self._tool_calls(2 if self.scenario == "parallel-tools" else 1)
            finish = "tool_calls"
        elif self.scenario == "abort":
            finish = "abort"
        else:
            reasoning_n, content_n, max_tokens = self._counts()
            finish = "length" if reasoning_n + content_n > max_tokens else "stop"
        stop_reason = None
        stops = self.body.get("stop")
        if self.scenario == "stop" and isinstance(stops, list) and stops:
            stop_reason = stops[0]
        self.finish_reason = finish
        yield self._chunk({"content": ""}, finish=finish, stop_reason=stop_reason)

    def _usage_frame(self) -> bytes:
        return frame(self._envelope([], usage=True))

    def _tool_calls(self, count: int) -> Iterator[bytes]:
        tools = self.body.get("tools") or []
        names = [t["function"]["name"] for t in tools if isinstance(t, dict) and "function" in t]
        for index in range(count):
            name = names[index % len(names)] if names else "get_weather"
            head = {
                "id": f"chatcmpl-tool-{secrets.token_hex(8)}",
                "type": "function",
                "index": index,
                "function": {"name": name},
            }
            yield self._token({"tool_calls": [head]})
            for fragment in TOOL_ARGUMENTS:
                yield self._token(
                    {"tool_calls": [{"index": index, "function": {"arguments": fragment}}]}
                )

    def _reasoning(self, word: str) -> dict[str, Any]:
        field_name = self.stub.settings.reasoning_field
        if field_name == "both":
            return {"reasoning": word, "reasoning_content": word}
        return {field_name: word}

    def _null_reasoning(self) -> dict[str, Any]:
        return {"reasoning_content": None} if self.stub.settings.reasoning_field == "both" else {}

    def _token(self, delta: dict[str, Any]) -> bytes:
        return self._chunk(delta, count=True)

    def _chunk(
        self,
        delta: dict[str, Any],
        *,
        finish: str | None = None,
        stop_reason: Any = None,
        count: bool = False,
    ) -> bytes:
        if count:
            self.completion_tokens += 1
        choice: dict[str, Any] = {
            "index": 0,
            "delta": delta,
            "logprobs": None,
            "finish_reason": finish,
        }
        if finish is not None:
            choice["stop_reason"] = stop_reason
        return frame(self._envelope([choice], usage=self.continuous))

    def _envelope(self, choices: list[Any], *, usage: bool) -> dict[str, Any]:
        envelope: dict[str, Any] = {
            "id": f"chatcmpl-{self.id}",
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": self.model,
            "choices": choices,
        }
        if usage:
            envelope["usage"] = self._usage(
                {
                    "prompt_tokens": self.prompt_tokens,
                    "total_tokens": self.prompt_tokens + self.completion_tokens,
                    "completion_tokens": self.completion_tokens,
                }
            )
        return envelope

    def _usage(self, usage: dict[str, Any]) -> dict[str, Any]:
        """vLLM's UsageInfo: `prompt_tokens_details` only with --enable-prompt-tokens-details."""
        if self.stub.settings.prompt_tokens_details:
            usage["prompt_tokens_details"] = prompt_details(self.prompt_tokens, self.cache_hits[0])
        return usage

    # -- sending it --------------------------------------------------------------------------

    def start(self, content_type: bytes = b"text/event-stream") -> None:
        self.request.setHeader(b"content-type", content_type)
        self.request.setHeader(b"cache-control", b"no-cache")
        self.request.write(b"")  # headers now, like vLLM; tokens after the prefill
        self.request.registerProducer(self, True)
        self._schedule(self.stub.settings.hold)

    def _schedule(self, delay: float) -> None:
        if not self._done and not self._paused and self._call is None:
            self._call = self.stub.clock.callLater(delay, self._step)

    def _step(self) -> None:
        self._call = None
        chunk = next(self._chunks, None)
        if chunk is None:
            self.finish("complete")
            self.request.unregisterProducer()
            self.request.finish()
            return
        if chunk == "reset":
            self.finish("reset")
            self.request.channel.transport.abortConnection()
            return
        if chunk == "truncate":
            self.finish("truncated")
            self.request.unregisterProducer()
            self.request.channel.transport.loseConnection()
            return
        if chunk == "stall":
            return  # nothing more until the client gives up
        assert isinstance(chunk, bytes)
        self.request.write(chunk)
        self.sent += len(chunk)
        if chunk == DONE_FRAME:
            # vLLM's engine has finished the sequence before it yields [DONE]: the generation
            # is over here, and the body's end follows at once (unless the scenario holds it).
            self.finish("complete")
            if next(self._chunks, None) == "hold-open":
                self._held_open = True
                self.stub.stats.held_open += 1
            else:
                self.request.unregisterProducer()
                self.request.finish()
            return
        self._schedule(self.stub.settings.delay)

    def client_left(self, reason: Any) -> None:
        stats = self.stub.stats
        if self._held_open:
            self._held_open = False
            stats.held_open -= 1
        if self.scenario in ("endless-error", "long-line"):
            stats.endless_bytes = max(stats.endless_bytes, self.sent)
        super().client_left(reason)

    # IPushProducer: the client's socket buffer is full, or has room again.
    def pauseProducing(self) -> None:
        if not self._paused:
            self.stub.stats.paused += 1
        self._paused = True
        self._cancel_call()

    def resumeProducing(self) -> None:
        self._paused = False
        self._schedule(self.stub.settings.delay)

    def stopProducing(self) -> None:
        self._cancel_call()

    def _documents(self) -> Iterator[dict[str, Any]]:
        """The plan's events, unpaced, for a whole answer: an error event is the HTTP 500 it
        stands for, and a line that is not JSON (or never ends) cuts the answer before it."""
        for chunk in self._chunks:
            if not isinstance(chunk, bytes) or not chunk.startswith(b"data: {"):
                continue
            if not chunk.endswith(b"\n\n"):
                return
            for event in chunk[:-2].split(b"\n\n"):
                try:
                    document = json.loads(event.removeprefix(b"data: "))
                except ValueError:
                    return
                if "error" in document:
                    raise HTTPError(500, document["error"]["message"])
                yield document

    def answer_whole(self) -> bytes:
        """The non-streaming `chat.completion`, by running the same plan without pacing."""
        message: dict[str, Any] = {"role": "assistant", "content": "", "tool_calls": []}
        reasoning = []
        finish = None
        for document in self._documents():
            for choice in document.get("choices", []):
                delta = choice["delta"]
                message["content"] += delta.get("content") or ""
                reasoning.append(delta.get("reasoning") or delta.get("reasoning_content") or "")
                for call in delta.get("tool_calls", []):
                    if "id" in call:
                        message["tool_calls"].append(
                            {**call, "function": {**call["function"], "arguments": ""}}
                        )
                    else:
                        message["tool_calls"][call["index"]]["function"]["arguments"] += call[
                            "function"
                        ]["arguments"]
                finish = choice.get("finish_reason") or finish
        if "".join(reasoning):
            message[self.stub.settings.reasoning_field.replace("both", "reasoning")] = "".join(
                reasoning
            )
        for call in message["tool_calls"]:
            call.pop("index", None)
        completion = {
            "id": f"chatcmpl-{self.id}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.model,
            "choices": [
                {"index": 0, "message": message, "logprobs": None, "finish_reason": finish}
            ],
            "usage": self._usage(
                {
                    "prompt_tokens": self.prompt_tokens,
                    "completion_tokens": self.completion_tokens,
                    "total_tokens": self.prompt_tokens + self.completion_tokens,
                }
            ),
        }
        return json.dumps(completion).encode()


DONE_FRAME = b"data: [DONE]\n\n"


def _endless(size: int) -> Iterator[bytes | str]:
    for _ in range(ENDLESS_CAP // size):
        yield b"x" * size
    yield "stall"


class HTTPError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def frame(data: Any) -> bytes:
    """One event as vLLM writes it: pydantic's compact JSON, UTF-8 as is."""
    text = (
        data
        if isinstance(data, str)
        else json.dumps(data, separators=(",", ":"), ensure_ascii=False)
    )
    return f"data: {text}\n\n".encode()
