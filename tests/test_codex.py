"""OpenAI's Codex CLI (the npm package `@openai/codex` at the version package-lock.json pins,
installed by `make test`) against the real daemon and stub, both run by twistd: a plain turn, a
tool call Codex answers and sends back, and a turn that waits in the line first.

Codex is configured as a user would for a local model: a provider of its own (never named
"OpenAI") whose `base_url` is the gateway's /llm/v1, with `wire_api = "responses"`, no retries
(any broken stream fails the run), and a CODEX_HOME and HOME of the test's own, so nothing of
the machine's configuration is read. Offline, Codex's start-up look-ups (chatgpt.com, a plugin
repository) fail quietly; they change neither the output nor the exit code.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from homelab_gateway.dev.generation import CONTENT_TEXT, REASONING_TEXT
from testsupport.processes import start_gateway, start_stub, upstream_status, wait_until

ROOT = Path(__file__).resolve().parent.parent
CODEX = ROOT / "node_modules" / ".bin" / "codex"
KEY_VARIABLE = "HOMELAB_GATEWAY_KEY"
CONTENT_TOKENS = 8
REASONING_TOKENS = 4
ANSWER = "".join(word + " " for word in CONTENT_TEXT.split()[:CONTENT_TOKENS])
"""The stub's answer, one token per word: what Codex must print as the agent's message."""
TIMEOUT = 60.0  # a run takes well under a second here; this bound only matters on failure


class StubLog:
    """A stub's --log file: a line per event, `<time> <event> id=N key=value ...`."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def lines(self) -> list[tuple[str, dict[str, str]]]:
        if not self.path.exists():
            return []
        out = []
        for line in self.path.read_text().splitlines():
            _, event, *fields = line.split(" ")
            out.append((event, dict(field.split("=", 1) for field in fields)))
        return out

    def since(self, mark: int) -> list[tuple[str, dict[str, str]]]:
        return self.lines()[mark:]

    def mark(self) -> int:
        return len(self.lines())


@dataclass
class Setup:
    gateway: str
    cwd: Path
    codex_home: Path
    fast: StubLog
    slow: StubLog


@dataclass
class Run:
    returncode: int
    events: list[dict[str, Any]]
    stderr: str
    codex_home: Path

    def messages(self) -> list[str]:
        return [
            e["item"]["text"]
            for e in self.events
            if e["type"] == "item.completed" and e["item"]["type"] == "agent_message"
        ]

    def errors(self) -> list[str]:
        """Error items, less the warning any model name outside OpenAI's catalog gets."""
        return [
            e["item"]["message"]
            for e in self.events
            if e["type"] == "item.completed"
            and e["item"]["type"] == "error"
            and "Defaulting to fallback metadata" not in e["item"]["message"]
        ]

    def usage(self) -> dict[str, int]:
        (completed,) = [e for e in self.events if e["type"] == "turn.completed"]
        return completed["usage"]

    def recorded(self) -> list[dict[str, Any]]:
        """The response items of the session's rollout: what Codex read from the gateway's
        answers and put in the input of its next request."""
        (thread,) = [e["thread_id"] for e in self.events if e["type"] == "thread.started"]
        (rollout,) = self.codex_home.glob(f"sessions/**/rollout-*-{thread}.jsonl")
        lines = [json.loads(line) for line in rollout.read_text().splitlines()]
        return [line["payload"] for line in lines if line["type"] == "response_item"]

    def explain(self) -> str:
        return f"exit {self.returncode}\nstdout: {self.events}\nstderr:\n{self.stderr}"


def codex_config(gateway: str) -> str:
    return f"""model = "local-coder"
model_provider = "gw"

[model_providers.gw]
name = "homelab-gateway"
base_url = "{gateway}/llm/v1"
wire_api = "responses"
env_key = "{KEY_VARIABLE}"
request_max_retries = 0
stream_max_retries = 0
stream_idle_timeout_ms = 20000
"""


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    if not os.access(CODEX, os.X_OK):
        pytest.fail(
            f"{CODEX} is missing: `make test` installs the Codex CLI that package-lock.json "
            "pins (npm ci --no-audit --no-fund)"
        )
    cwd = tmp_path_factory.mktemp("codex")
    tokens = ["--content-tokens", str(CONTENT_TOKENS), "--reasoning-tokens", str(REASONING_TOKENS)]
    fast, fast_url = start_stub(cwd, "--delay", "0.002", *tokens, "--log", str(cwd / "fast.log"))
    slow, slow_url = start_stub(cwd, "--delay", "0.002", *tokens, "--log", str(cwd / "slow.log"))
    config = f"""
[upstreams.fast]
url = "{fast_url}"
slots = 4

[upstreams.slow]
url = "{slow_url}"
slots = 1

[models.local-coder]
upstream = "fast"

[models.queued-coder]
upstream = "slow"

[models."gpt-*"]
upstream = "fast"
upstream_model = "local-coder"
"""
    gateway, url = start_gateway(cwd, config)
    codex_home = cwd / "codex-home"
    codex_home.mkdir()
    (codex_home / "config.toml").write_text(codex_config(url))
    yield Setup(url, cwd, codex_home, StubLog(cwd / "fast.log"), StubLog(cwd / "slow.log"))
    for process in (gateway, fast, slow):
        process.stop()


class Codex:
    """One `codex exec --json` run, started in the background, from an empty directory."""

    def __init__(self, setup: Setup, prompt: str, *options: str) -> None:
        self.codex_home = setup.codex_home
        work = Path(os.path.realpath(setup.cwd)) / f"work-{time.monotonic_ns()}"
        (work / "home").mkdir(parents=True)
        self.stdout, self.stderr = work / "stdout.jsonl", work / "stderr.txt"
        env = {
            "PATH": os.environ["PATH"],  # node, which runs the launcher
            "HOME": str(work / "home"),
            "CODEX_HOME": str(setup.codex_home),
            KEY_VARIABLE: "sk-homelab-test",
            "LANG": "C.UTF-8",
        }
        with self.stdout.open("wb") as out, self.stderr.open("wb") as err:
            self.process = subprocess.Popen(
                [str(CODEX), "exec", "--skip-git-repo-check", "--json", *options, prompt],
                cwd=work,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                start_new_session=True,  # the launcher and the binary it runs: one group
            )

    def finish(self, give_up: Callable[[], str | None] = lambda: None) -> Run:
        """Waits for the exit, within TIMEOUT; `give_up` names a state that means the run will
        never end well (it is killed at once)."""
        deadline = time.monotonic() + TIMEOUT
        try:
            while self.process.poll() is None:
                reason = give_up()
                assert reason is None and time.monotonic() < deadline, (
                    f"codex killed: {reason or f'still running after {TIMEOUT}s'}\n"
                    + self.stderr.read_text()
                )
                time.sleep(0.02)
        finally:
            if self.process.poll() is None:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        events = [
            json.loads(line)
            for line in self.stdout.read_text().splitlines()
            if line.startswith("{")
        ]
        return Run(self.process.returncode, events, self.stderr.read_text(), self.codex_home)


def errors_logged(stderr: str) -> list[str]:
    """Codex's ERROR log lines (its own complaints about a stream, say an orphan text delta)."""
    return [line for line in stderr.splitlines() if " ERROR " in line]


def test_a_plain_turn_prints_the_stubs_answer_and_its_usage(setup: Setup) -> None:
    mark = setup.fast.mark()
    run = Codex(setup, "say hello").finish()
    assert run.returncode == 0, run.explain()
    assert run.messages() == [ANSWER], run.explain()
    assert run.errors() == [] and errors_logged(run.stderr) == [], run.explain()
    [(start, request), (end, answer)] = setup.fast.since(mark)
    assert (start, request["model"], request["stream"]) == ("start", "local-coder", "True")
    assert (end, answer["finish"]) == ("complete", "stop")
    # usage end to end: the stub's count, through the gateway's response.completed
    usage = run.usage()
    assert usage["input_tokens"] > 0
    assert usage["output_tokens"] == int(answer["tokens"]) == REASONING_TOKENS + CONTENT_TOKENS
    assert usage["reasoning_output_tokens"] == REASONING_TOKENS
    # the reasoning reached Codex as a reasoning item, its text the stub's
    (reasoning,) = [item for item in run.recorded() if item["type"] == "reasoning"]
    text = " ".join(part["text"] for part in reasoning["content"])
    assert text.split() == REASONING_TEXT.split()[:REASONING_TOKENS]


def test_a_catalog_model_name_brings_codexs_freeform_tools_and_they_map(setup: Setup) -> None:
    """Under a name of OpenAI's catalog, Codex offers more: the freeform `apply_patch` (a
    custom tool), `tool_search`, `web_search` with content types, `text.verbosity`, an effort.
    The gateway maps them all (a refusal would end the run with an error)."""
    mark = setup.fast.mark()
    run = Codex(setup, "say hello", "-m", "gpt-5.5").finish()
    assert run.returncode == 0, run.explain()
    assert run.messages() == [ANSWER], run.explain()
    [(start, request), (end, _)] = setup.fast.since(mark)
    assert (start, request["model"], end) == ("start", "local-coder", "complete")


def test_a_tool_call_round_trip(setup: Setup) -> None:
    """The stub calls the first tool Codex offers (exec_command) with arguments that are not
    exec_command's; Codex answers the call with a function_call_output all the same, and the
    stub answers that with text."""
    mark = setup.fast.mark()

    def looping() -> str | None:
        starts = [f for e, f in setup.fast.since(mark) if e == "start"]
        return f"the stub was asked {len(starts)} times: a loop" if len(starts) > 2 else None

    run = Codex(setup, "run a tool now").finish(give_up=looping)
    assert run.returncode == 0, run.explain()
    # The tool scenario's text before its call, then the answer to the tool's output.
    assert run.messages() == [ANSWER, ANSWER], run.explain()
    assert run.errors() == [], run.explain()
    lines = setup.fast.since(mark)
    # Two requests: the second ended with the tool's output (a role "tool" message upstream),
    # which is what makes the stub answer content-only.
    assert [(e, f.get("scenario"), f.get("finish")) for e, f in lines] == [
        ("start", "tool", None),
        ("complete", None, "tool_calls"),
        ("start", "content-only", None),
        ("complete", None, "stop"),
    ], lines
    items = run.recorded()
    (call,) = [item for item in items if item["type"] == "function_call"]
    # the stub's own id for the call, passed through; the tool's name as Codex offered it
    assert call["call_id"].startswith("chatcmpl-tool-") and call["name"] == "exec_command"
    assert json.loads(call["arguments"]) == {"city": "Paris", "unit": "celsius"}
    (output,) = [item for item in items if item["type"] == "function_call_output"]
    assert output["call_id"] == call["call_id"]
    assert "failed to parse function arguments" in output["output"]
    assert items.index(output) == items.index(call) + 1
    assert items[-1]["type"] == "message" and items[-1]["content"][0]["text"] == ANSWER
    (complaint,) = errors_logged(run.stderr)  # Codex's own log line about those arguments
    assert "failed to parse function arguments" in complaint


def hold_the_slow_slot(setup: Setup) -> socket.socket:
    """A stream to the slow upstream whose stub falls silent after a few tokens (`stall`): it
    holds the only slot until its connection closes."""
    body = json.dumps(
        {
            "model": "queued-coder",
            "stream": True,
            "messages": [{"role": "user", "content": "stall"}],
        }
    ).encode()
    host, port = setup.gateway.removeprefix("http://").split(":")
    connection = socket.create_connection((host, int(port)), timeout=10)
    connection.sendall(
        b"POST /llm/v1/chat/completions HTTP/1.1\r\n"
        + f"Host: {host}:{port}\r\nContent-Type: application/json\r\n".encode()
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    return connection


def test_a_turn_that_waits_for_a_slot_completes(setup: Setup) -> None:
    """Codex reads `response.created` (status queued), `response.queued` and then
    `response.in_progress` as the gateway's line moves, and the answer after them."""
    mark = setup.slow.mark()
    holder = hold_the_slow_slot(setup)
    try:
        wait_until(lambda: upstream_status(setup.gateway, "slow")["in_use"] == 1)
        codex = Codex(setup, "say hello", "-m", "queued-coder")
        wait_until(
            lambda: (
                upstream_status(setup.gateway, "slow")["waiting"] == 1
                or codex.process.poll() is not None
            )
        )
        assert codex.process.poll() is None, codex.finish().explain()  # it waits in the line
    finally:
        holder.close()  # the gateway cancels the stalled generation: the slot is Codex's
    run = codex.finish()
    assert run.returncode == 0, run.explain()
    assert run.messages() == [ANSWER], run.explain()
    assert run.errors() == [] and errors_logged(run.stderr) == [], run.explain()
    lines = setup.slow.since(mark)
    # The stalled stream was cancelled, and Codex's request reached the stub only after it
    # started (the stub may read the new request before the old connection's close).
    by_request = {f["id"]: [] for e, f in lines if e == "start"}
    for event, fields in lines:
        by_request[fields["id"]].append((event, fields.get("scenario")))
    assert list(by_request.values()) == [
        [("start", "stall"), ("cancelled", None)],
        [("start", "default"), ("complete", None)],
    ], lines
    wait_until(lambda: upstream_status(setup.gateway, "slow")["in_use"] == 0)
    assert upstream_status(setup.gateway, "slow")["waiting"] == 0
