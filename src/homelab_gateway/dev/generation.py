"""What the stub says: the scenarios a prompt picks and one chat completion's chunks, paced on
the clock and pausable by its client, as vLLM writes them (`stub` serves them)."""

from __future__ import annotations

import hashlib
import json
import secrets
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from twisted.internet.interfaces import IDelayedCall
from twisted.web.server import Request

if TYPE_CHECKING:
    from homelab_gateway.dev.stub import StubResource

ENDLESS_CAP = 32 * 1024 * 1024
"""What "never ends" means for endless-error and long-line: past any sane gateway's limit, yet
a broken gateway reading it all cannot take the machine down; after it, silence."""
REASONING_TEXT = "The user wants a short friendly answer so I will greet them and keep it brief"
CONTENT_TEXT = "Hello! I am a stub model answering from the homelab gateway test upstream."
TOOL_ARGUMENTS = ['{"city', '": "', "Par", 'is", "unit', '": "c', 'elsius"}']

SCENARIOS = {
    "content-only": "content and no reasoning",
    "reasoning-only": "reasoning until max_tokens runs out (finish_reason length)",
    "tool": "a little text, then a tool call whose arguments arrive in fragments",
    "parallel-tools": "two tool calls, index 0 and 1",
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


def digest(messages: Any) -> str:
    """A short digest of the prompt: vLLM logs each request's prompt, the stub only this."""
    text = json.dumps(messages, sort_keys=True).encode()
    return hashlib.sha256(text).hexdigest()[:16]


def _scenario(messages: Any) -> str:
    last_user = [m for m in messages if isinstance(m, dict) and m.get("role") == "user"][-1:]
    for word in prompt_words(last_user):
        if word.lower() in SCENARIOS:
            return word.lower()
    return "default"


def _words(text: str, n: int) -> Iterator[str]:
    """`n` tokens cycling through the words of `text`, each with its trailing space."""
    words = text.split()
    for i in range(n):
        yield words[i % len(words)] + " "


class Generation:
    """One chat completion: the chunks it sends, paced on the clock, pausable by the client."""

    def __init__(
        self, stub: StubResource, request: Request, body: dict[str, Any], request_id: str
    ) -> None:
        self.stub = stub
        self.request = request
        self.body = body
        self.id = request_id
        self.model = body.get("model", "stub")
        self.scenario = _scenario(body.get("messages") or [])
        self.prompt_tokens = len(prompt_words(body.get("messages"))) + 4 * len(
            body.get("messages") or []
        )
        self.cached_tokens = 0
        self.completion_tokens = 0
        self.finish_reason: str | None = None
        self._call: IDelayedCall | None = None
        self._paused = False
        self._done = False
        self._held_open = False
        self.sent = 0
        options = body.get("stream_options") or {}
        self.include_usage = bool(options.get("include_usage"))
        self.continuous = bool(options.get("continuous_usage_stats"))
        self._chunks = self._plan()

    # -- what to say -------------------------------------------------------------------------

    def _plan(self) -> Iterator[bytes | str]:
        """Yields SSE payloads (bytes, already framed) or control words: 'reset', 'truncate',
        'stall', 'hold-open' (after [DONE]: leave the body open)."""
        settings = self.stub.settings
        max_tokens = self.body.get("max_tokens") or self.body.get("max_completion_tokens") or 10**9
        scenario = self.scenario
        reasoning_n = settings.reasoning_tokens
        content_n = settings.content_tokens
        if scenario in ("content-only", "tool", "parallel-tools", "stop", "long"):
            reasoning_n = 0
        if scenario == "long":
            content_n = 2000
        if scenario == "reasoning-only":
            reasoning_n, content_n = 10**9, 0
        if scenario == "endless-error":
            yield b'{"error": {"message": "stub: '
            yield from _endless(16384)
            return
        if scenario in ("fail", "garbage", "reset", "truncate", "stall", "abort", "long-line"):
            reasoning_n, content_n = min(reasoning_n, 2), 2

        yield self._chunk({"role": "assistant", "content": ""})
        reasoning = min(reasoning_n, max_tokens)
        content = min(content_n, max_tokens - reasoning)
        for word in _words(REASONING_TEXT, reasoning):
            yield self._token(self._reasoning(word))
        if reasoning and content:
            yield self._chunk({"content": ""})
        for word in _words(CONTENT_TEXT, content):
            yield self._token({"content": word, **self._null_reasoning()})

        if scenario == "fail":
            error = {
                "message": "stub: the engine died",
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
            yield b'data: {"choices": [{"index": 0, "delta": {"content": "'
            yield from _endless(65536)
            return
        if scenario in ("reset", "truncate", "stall"):
            yield scenario
            return
        if scenario in ("tool", "parallel-tools"):
            yield from self._tool_calls(2 if scenario == "parallel-tools" else 1)
            finish = "tool_calls"
        elif scenario == "abort":
            finish = "abort"
        else:
            finish = "length" if reasoning_n + content_n > max_tokens else "stop"
        stop_reason = None
        stops = self.body.get("stop")
        if scenario == "stop" and isinstance(stops, list) and stops:
            stop_reason = stops[0]
        self.finish_reason = finish
        yield self._chunk({"content": ""}, finish=finish, stop_reason=stop_reason)
        if self.include_usage:
            yield frame(self._envelope([], usage=True))
        yield DONE_FRAME
        if scenario == "open-after-done":
            yield "hold-open"

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
            usage["prompt_tokens_details"] = {"cached_tokens": self.cached_tokens}
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
            self._finish("complete", finish=self.finish_reason, tokens=self.completion_tokens)
            self.request.unregisterProducer()
            self.request.finish()
            return
        if chunk == "reset":
            self._finish("reset")
            self.request.channel.transport.abortConnection()
            return
        if chunk == "truncate":
            self._finish("truncated")
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
            self._finish("complete", finish=self.finish_reason, tokens=self.completion_tokens)
            if next(self._chunks, None) == "hold-open":
                self._held_open = True
                self.stub.stats.held_open += 1
            else:
                self.request.unregisterProducer()
                self.request.finish()
            return
        self._schedule(self.stub.settings.delay)

    def _finish(self, event: str, **fields: Any) -> None:
        if not self._done:
            self._done = True
            self.stub.stats.in_flight -= 1
            self.stub.stats.completed += event == "complete"
            self.stub.log.write(event, self.id, **fields)

    def client_left(self, reason: Any) -> None:
        self._cancel_call()
        stats = self.stub.stats
        if self._held_open:
            self._held_open = False
            stats.held_open -= 1
        if self.scenario in ("endless-error", "long-line"):
            stats.endless_bytes = max(stats.endless_bytes, self.sent)
        if not self._done:
            self.stub.stats.cancelled += 1
            self._finish("cancelled")

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

    def _cancel_call(self) -> None:
        if self._call is not None:
            self._call.cancel()
            self._call = None

    def answer_whole(self) -> bytes:
        """The non-streaming `chat.completion`, by running the same plan without pacing."""
        message: dict[str, Any] = {"role": "assistant", "content": "", "tool_calls": []}
        reasoning = []
        finish = None
        for chunk in self._chunks:
            if not isinstance(chunk, bytes) or not chunk.startswith(b"data: {"):
                continue
            if not chunk.endswith(b"\n\n"):
                break  # a line that never ends (long-line): answer with what came before it
            document = json.loads(chunk[6:])
            if "error" in document:
                raise HTTPError(500, document["error"]["message"])
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
