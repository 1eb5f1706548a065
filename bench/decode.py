"""The per-token path alone, in process: a recorded vLLM-shaped stream through decode ->
translate -> encode, as `Messages.relay` and `EventStream.send` run it, with no sockets.

`python -m bench.decode [--tokens 2000] [--read 65536] [--no-usage] [--rounds 5]
[--surface messages|responses]` prints the
wall-clock time per 1,000 tokens (best of the rounds) and a digest of the bytes a client would
get, so two versions of the code can be checked for the same output. Its real use is under
callgrind, whose instruction count does not depend on what else the machine runs:

    valgrind --tool=callgrind --callgrind-out-file=/tmp/cg.out \\
        .venv/bin/python -m bench.decode --rounds 1
    callgrind_annotate /tmp/cg.out | head -30

The stream is what vLLM 0.3x writes (pydantic's compact JSON, `continuous_usage_stats` on, as
the gateway asks by default): a role chunk, reasoning tokens, the empty `content` switch
chunk, content tokens (one in ten carrying an escaped newline or quote, as code does), the
finish chunk, the usage chunk and `[DONE]`, cut into reads of `--read` bytes.
"""

from __future__ import annotations

import argparse
import hashlib
import time
from typing import Any

import orjson

from homelab_gateway.config import ModelConfig
from homelab_gateway.core.response_stream import ResponseStream
from homelab_gateway.core.responses import map_responses
from homelab_gateway.core.translator import StreamTranslator, UpstreamDecoder
from homelab_gateway.surfaces.responses import PING_COMMENT
from homelab_gateway.surfaces.stream import EventStream

MODEL = ModelConfig(name="reasoning", upstream="vllm", upstream_model="Qwen/Qwen3-32B")

WORDS = ["The ", "quick ", "brown ", "fox ", "jumps ", "über ", "the ", "lazy ", "dog", ".\n"]


def recorded_stream(tokens: int, usage: bool = True) -> bytes:
    prompt = 52
    out = []

    def chunk(delta: dict[str, Any], n: int, finish: str | None = None) -> None:
        choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None}
        choice["finish_reason"] = finish
        if finish is not None:
            choice["stop_reason"] = None
        envelope: dict[str, Any] = {
            "id": "chatcmpl-8d7e0a0c2f5b4c3e9a1d6b7f8e9c0a1b",
            "object": "chat.completion.chunk",
            "created": 1764547200,
            "model": "Qwen/Qwen3-32B",
            "choices": [choice],
        }
        if usage:
            envelope["usage"] = {
                "prompt_tokens": prompt,
                "total_tokens": prompt + n,
                "completion_tokens": n,
            }
        out.append(b"data: " + orjson.dumps(envelope) + b"\n\n")

    chunk({"role": "assistant", "content": ""}, 0)
    thinking = tokens // 4
    for n in range(1, tokens + 1):
        word = WORDS[n % len(WORDS)]
        if n == thinking + 1:
            chunk({"content": ""}, n - 1)
        chunk({"reasoning": word} if n <= thinking else {"content": word}, n)
    chunk({"content": ""}, tokens, finish="stop")
    final = {
        "id": "chatcmpl-8d7e0a0c2f5b4c3e9a1d6b7f8e9c0a1b",
        "object": "chat.completion.chunk",
        "created": 1764547200,
        "model": "Qwen/Qwen3-32B",
        "choices": [],
        "usage": {
            "prompt_tokens": prompt,
            "total_tokens": prompt + tokens,
            "completion_tokens": tokens,
        },
    }
    out.append(b"data: " + orjson.dumps(final) + b"\n\ndata: [DONE]\n\n")
    return b"".join(out)


class _Sink:
    """The parts of a Twisted request that `EventStream` touches (Twisted's method names)."""

    def __init__(self) -> None:
        self.digest = hashlib.sha256()
        self.bytes = 0

    def notifyFinish(self) -> Any:
        from twisted.internet.defer import Deferred

        return Deferred()

    def setResponseCode(self, code: int) -> None:
        pass

    def setHeader(self, name: bytes, value: bytes) -> None:
        pass

    def write(self, data: bytes) -> None:
        self.digest.update(data)
        self.bytes += len(data)


def run(stream: bytes, read: int, surface: str = "messages") -> _Sink:
    from twisted.internet.task import Clock

    sink = _Sink()
    if surface == "responses":
        mapped = map_responses({"model": "reasoning", "input": "hi"}, MODEL)
        response = ResponseStream(mapped, response_id="resp_0", now=lambda: 1764547200.0)
        events = EventStream(
            sink,  # type: ignore[arg-type]
            Clock(),
            15.0,
            response.queue_frame,
            opening="response.in_progress",
            ping=PING_COMMENT,
        )
        decoder = UpstreamDecoder(
            StreamTranslator(model="reasoning", input_tokens=52, tool_id=response.call_id)
        )
        for start in range(0, len(stream), read):
            events.send(response.feed(decoder.feed(stream[start : start + read])))
    else:
        events = EventStream(sink, Clock(), 15.0)  # type: ignore[arg-type]
        decoder = UpstreamDecoder(
            StreamTranslator(model="reasoning", input_tokens=52, message_id="msg_0")
        )
        for start in range(0, len(stream), read):
            events.send(decoder.feed(stream[start : start + read]))
    events.close()
    return sink


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--read", type=int, default=65536)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--no-usage", action="store_true")
    parser.add_argument("--surface", choices=("messages", "responses"), default="messages")
    args = parser.parse_args()
    stream = recorded_stream(args.tokens, usage=not args.no_usage)
    best = float("inf")
    for _ in range(args.rounds):
        started = time.perf_counter()
        sink = run(stream, args.read, args.surface)
        best = min(best, time.perf_counter() - started)
    print(
        f"{args.tokens} tokens, {len(stream)} bytes in, {sink.bytes} bytes out "
        f"(sha256 {sink.digest.hexdigest()[:16]}): {best * 1e6 / args.tokens:.2f} ms "
        "per 1,000 tokens (best of the rounds)"
    )


if __name__ == "__main__":
    main()
