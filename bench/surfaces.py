"""The surfaces side by side: 8 concurrent 10,000-token streams through /llm/v1/chat/completions,
/llm/v1/messages and /llm/v1/responses, and from the stub asked directly, in the same run.

`python -m bench.surfaces [--paced SECONDS --tokens N]` (also scenario 9 of `python -m bench`)
starts the stub (writing as fast as it can, or paced like a GPU) and the gateway as twistd
processes. Each round asks all three in a rotating order, so a noisy moment
falls on every side; a surface's ratio is the median of its rounds' ratios to the direct stub
of the same round, and its CPU per 1,000 tokens is the gateway process's own (utime + stime from
/proc) over that surface's passes. The chat surface only renames, the Messages surface
translates: `chat_cpu_vs_messages` is the one's CPU per token over the other's. The Responses
surface translates the Messages surface's blocks on into larger events:
`responses_cpu_vs_messages` is its CPU per token over the Messages surface's.
Measurements, not tests: nothing fails on a figure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.scenarios import (
    STREAM_TOKENS,
    ProcessStats,
    anthropic_body,
    is_anthropic_token,
    is_openai_token,
    machine,
    openai_body,
    streams_rate,
)
from testsupport.processes import Process, start_gateway, start_stub

CONFIG = """
[upstreams.bulk]
url = "{big}"
slots = 8

[models.bulk]
upstream = "bulk"

[models.renamed]
upstream = "bulk"
upstream_model = "bulk"
"""


async def surfaces(
    direct: str, gateway: str, stats: ProcessStats, rounds: int, tokens: int = STREAM_TOKENS
) -> dict[str, Any]:
    # A name the upstream does not answer with, so every chunk is renamed, as in real use.
    chat = {**openai_body("content-only", tokens), "model": "renamed"}
    sides = {
        "direct": (
            direct + "/chat/completions",
            openai_body("content-only", tokens),
            is_openai_token,
        ),
        "chat": (gateway + "/llm/v1/chat/completions", chat, is_openai_token),
        "messages": (
            gateway + "/llm/v1/messages",
            anthropic_body("bulk", "content-only", tokens),
            is_anthropic_token,
        ),
        "responses": (
            gateway + "/llm/v1/responses",
            {
                "model": "bulk",
                "input": "content-only",
                "max_output_tokens": tokens,
                "stream": True,
            },
            is_responses_token,
        ),
    }
    rates: dict[str, list[float]] = {name: [] for name in sides}
    cpu: dict[str, list[float]] = {"chat": [], "messages": [], "responses": []}
    order = list(sides)
    for round_ in range(rounds):
        turn = round_ % len(order)
        for name in order[turn:] + order[:turn]:
            url, body, is_token = sides[name]
            before = stats.cpu_seconds()
            rate, counted = await streams_rate(url, body, 8, is_token)
            rates[name].append(rate)
            if name in cpu:
                cpu[name].append(1e6 * (stats.cpu_seconds() - before) / counted)
    out: dict[str, Any] = {"streams": 8, "tokens_per_stream": tokens, "rounds": rounds}
    for name in sides:
        out[f"{name}_tokens_per_s"] = round(statistics.median(rates[name]))
    for name in cpu:
        ratios = [g / d for g, d in zip(rates[name], rates["direct"], strict=True)]
        out[f"{name}_ratio"] = round(statistics.median(ratios), 3)
        out[f"{name}_ratio_all"] = [round(r, 3) for r in ratios]
        out[f"{name}_cpu_ms_per_1000_tokens"] = round(statistics.median(cpu[name]), 2)
        out[f"{name}_cpu_ms_per_1000_tokens_all"] = [round(c, 2) for c in cpu[name]]
    for name in ("chat", "responses"):
        out[f"{name}_cpu_vs_messages"] = round(
            out[f"{name}_cpu_ms_per_1000_tokens"] / out["messages_cpu_ms_per_1000_tokens"], 3
        )
    return out


def is_responses_token(frame: Any) -> bool:
    return frame.event == "response.output_text.delta"


def run(
    workdir: Path, rounds: int, delay: float = 0.0, tokens: int = STREAM_TOKENS
) -> dict[str, Any]:
    """Against a stub that writes as fast as it can, or one token every `delay` seconds per
    stream, as a GPU does: there each read is one token, and what a surface does per token
    shows beside what every read costs."""
    processes: list[Process] = []
    try:
        big_stub, big = start_stub(
            workdir,
            "--reasoning-tokens",
            "0",
            "--content-tokens",
            "40000",
            "--delay",
            str(delay),
        )
        processes.append(big_stub)
        gateway, url = start_gateway(workdir, CONFIG.format(big=big))
        processes.append(gateway)
        stats = ProcessStats(gateway.popen.pid)
        return asyncio.run(surfaces(big, url, stats, rounds, tokens))
    finally:
        for process in processes:
            process.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument(
        "--paced", type=float, default=0.0, help="seconds between a stream's tokens (0: none)"
    )
    parser.add_argument("--tokens", type=int, default=STREAM_TOKENS, help="per stream")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as workdir:
        figures = run(Path(workdir), args.rounds, args.paced, args.tokens)
        report = {"machine": machine(), "9_surfaces": figures}
    json.dump(report, sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    main()
