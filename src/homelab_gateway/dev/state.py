"""What the stub's scenarios read and write of the stub: its settings, its counters and its
log, and `Stub`, the view of the stub an exchange is given. Here, apart from stub.py, so that
the scenario modules need nothing of the module that serves them."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Protocol, TextIO

from twisted.internet.interfaces import IReactorTime


@dataclass
class StubSettings:
    hold: float = 0.0
    delay: float = 0.0
    reasoning_tokens: int = 8
    content_tokens: int = 8
    reasoning_field: str = "reasoning"  # reasoning | reasoning_content | both
    models: tuple[str, ...] = ()  # empty: answer any model name
    # vLLM's --max-model-len: reported by /v1/models and /tokenize, enforced with its wording.
    # None: nothing enforced (benchmarks and tests ask for huge max_tokens), /tokenize says 32768.
    max_model_len: int | None = None
    # vLLM's --enable-prompt-tokens-details: usage says the prefix-cache hits (cached_tokens)
    # and what the prefill wrote to the cache (created_cache_tokens)
    prompt_tokens_details: bool = False
    # vLLM's --scheduling-policy: "fcfs" refuses a non-zero `priority`, "priority" takes it.
    scheduling_policy: str = "fcfs"
    embedding_size: int = 8  # the embedding model's hidden size: a vector's length
    # The model is matryoshka: `dimensions` slices its vectors (else vLLM refuses `dimensions`)
    matryoshka: bool = True


@dataclass
class StubStats:
    requests: int = 0
    in_flight: int = 0
    max_in_flight: int = 0
    completed: int = 0
    cancelled: int = 0
    paused: int = 0  # times a client's full send buffer paused a generation (backpressure)
    hangups: int = 0  # requests read and then dropped unanswered (scenario hangup)
    held_open: int = 0  # bodies open right now after their [DONE] (scenario open-after-done)
    endless_bytes: int = 0  # the most an endless-error/long-line body sent before it was cut
    models: dict[str, int] = field(default_factory=dict)


class StubLog:
    """Line-per-event log; each line is flushed at once so tests can watch it."""

    def __init__(self, stream: TextIO | None) -> None:
        self._stream = stream

    def write(self, event: str, request_id: str, **fields: Any) -> None:
        if self._stream is None:
            return
        extra = "".join(f" {k}={v}" for k, v in fields.items() if v is not None)
        stamp = datetime.now().isoformat(timespec="milliseconds")
        self._stream.write(f"{stamp} {event} id={request_id}{extra}\n")
        self._stream.flush()


class Stub(Protocol):
    """What an exchange uses of the stub serving it (stub.StubResource)."""

    settings: StubSettings
    clock: IReactorTime
    log: StubLog
    stats: StubStats
