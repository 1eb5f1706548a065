"""The usage ledger through the real daemon (`twistd`): its totals are what the clients were
told in their usage fields, before and after a SIGTERM, and after a kill -9 once the last
request's second has been written."""

from __future__ import annotations

import csv
import io
import json
import sqlite3
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

from testsupport.processes import one_upstream_config, start_gateway, start_stub, wait_until

PROMPT = "the same long prompt, so the prefix cache reads its blocks the second time " * 8
TOTALS = ("requests", "input_tokens", "output_tokens", "cached_tokens")


def post(url: str, body: dict[str, Any]) -> str:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"content-type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=20) as response:
        return str(response.read().decode())


def data_lines(body: str) -> list[Any]:
    lines = [line[6:] for line in body.splitlines() if line.startswith("data: ")]
    return [json.loads(line) for line in lines if line != "[DONE]"]


def messages(url: str) -> Counter[str]:
    """One streamed Messages answer: what its `message_delta` told the client."""
    body = {
        "model": "reasoning",
        "max_tokens": 32,
        "stream": True,
        "messages": [{"role": "user", "content": PROMPT}],
    }
    (usage,) = [
        e["usage"]
        for e in data_lines(post(url + "/llm/v1/messages", body))
        if e["type"] == "message_delta"
    ]
    return Counter(
        requests=1,
        input_tokens=usage["input_tokens"]
        + usage["cache_creation_input_tokens"]
        + usage["cache_read_input_tokens"],
        output_tokens=usage["output_tokens"],
        cached_tokens=usage["cache_read_input_tokens"],
    )


def chat(url: str) -> Counter[str]:
    """One streamed chat completion with its usage chunk: what that chunk told the client."""
    body = {
        "model": "reasoning",
        "max_tokens": 32,
        "stream": True,
        "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content": PROMPT}],
    }
    chunks = data_lines(post(url + "/llm/v1/chat/completions", body))
    (usage,) = [c["usage"] for c in chunks if c.get("usage")]
    return Counter(
        requests=1,
        input_tokens=usage["prompt_tokens"],
        output_tokens=usage["completion_tokens"],
        cached_tokens=usage["prompt_tokens_details"]["cached_tokens"],
    )


def ledger(url: str) -> Counter[str]:
    """The ledger's totals by /llm/v1/usage, as JSON and as CSV (which must agree)."""
    with urllib.request.urlopen(url + "/llm/v1/usage?by=surface", timeout=5) as response:
        rows = json.load(response)["rows"]
    with urllib.request.urlopen(url + "/llm/v1/usage?by=surface&format=csv", timeout=5) as r:
        assert r.headers["content-type"] == "text/csv; charset=utf-8"
        table = list(csv.DictReader(io.StringIO(r.read().decode())))
    assert [row["surface"] for row in rows] == [row["surface"] for row in table]
    for row, line in zip(rows, table, strict=True):
        assert {name: str(row[name]) for name in row} == line
    return Counter({name: sum(row[name] for row in rows) for name in TOTALS})


def written(database: Path) -> int:
    """The requests the daemon's timed writes have put in the file so far."""
    with sqlite3.connect(database) as connection:
        (count,) = connection.execute("SELECT COALESCE(SUM(requests), 0) FROM usage").fetchone()
    return int(count)


def test_the_ledger_is_what_clients_were_told_across_sigterm_and_kill_9(tmp_path: Path) -> None:
    stub, stub_url = start_stub(tmp_path, "--enable-prompt-tokens-details")
    config = one_upstream_config(stub_url, slots=2)
    gateway, url = start_gateway(tmp_path, config)
    try:
        told = messages(url) + messages(url) + chat(url) + chat(url)
        assert told["cached_tokens"] > 0, "the prefix cache read the repeated prompt"
        assert ledger(url) == told
        assert gateway.stopped_cleanly(), gateway.all_output()

        gateway, url = start_gateway(tmp_path, config)  # the same file: usage.sqlite3 here
        assert ledger(url) == told
        told += chat(url)
        wait_until(lambda: written(tmp_path / "usage.sqlite3") == told["requests"])
        gateway.popen.kill()
        gateway.popen.wait()

        gateway, url = start_gateway(tmp_path, config)
        assert ledger(url) == told
    finally:
        gateway.stop()
        stub.stop()
