"""The daemon as users run it: `twistd homelab-gateway` / `homelab-stub` as subprocesses."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.processes import (
    TWISTD,
    Process,
    clean_env,
    one_upstream_config,
    start_gateway,
    start_stub,
    upstream_status,
    wait_until,
)


def post(url: str, body: dict, timeout: float = 20.0) -> tuple[int, str, str]:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"content-type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return response.status, response.headers["content-type"], response.read().decode()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    cwd = tmp_path_factory.mktemp("twistd")
    stub, stub_url = start_stub(cwd, "--log", str(cwd / "stub.log"))
    config = f"""
[upstreams.vllm]
url = "{stub_url}"
slots = 2

[models.reasoning]
upstream = "vllm"
upstream_model = "Qwen/QwQ-32B"

[[routes]]
prefix = "/openai/"
upstream = "vllm"
"""
    gateway, url = start_gateway(cwd, config)
    yield url, cwd
    assert gateway.stopped_cleanly(), "".join(gateway.output)
    stub.stop()


def test_twistd_runs_the_installed_plugin_from_a_foreign_directory(stack: tuple[str, Path]) -> None:
    url, _ = stack
    with urllib.request.urlopen(url + "/healthz", timeout=5) as response:
        assert json.load(response) == {"status": "ok"}
    status, content_type, body = post(
        url + "/llm/v1/messages",
        {
            "model": "reasoning",
            "max_tokens": 32,
            "stream": True,
            "messages": [{"role": "user", "content": "hi"}],
        },
    )
    assert (status, content_type) == (200, "text/event-stream; charset=utf-8")
    events = [line for line in body.splitlines() if line.startswith("event:")]
    assert events[0] == "event: message_start" and events[-1] == "event: message_stop"


def test_stub_log_has_start_and_complete_lines(stack: tuple[str, Path]) -> None:
    url, cwd = stack
    post(
        url + "/openai/chat/completions",
        {"model": "Qwen/QwQ-32B", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]},
    )
    log = (cwd / "stub.log").read_text()
    assert " start id=" in log and " complete id=" in log


def run_to_end(args: list[str], cwd: Path | str = "/") -> subprocess.CompletedProcess[str]:
    """Run a command the way a user would (no PYTHONPATH, away from this checkout)."""
    return subprocess.run(
        args, cwd=cwd, env=clean_env(), capture_output=True, text=True, timeout=60
    )


def run_gateway(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return run_to_end([TWISTD, "--nodaemon", "--pidfile=", "homelab-gateway", *args], tmp_path)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (None, "gw.toml: file not found"),
        ("[server\n", "gw.toml: invalid TOML"),
        (
            "[upstreams.v]\nurl = 'http://x/v1'\nslots = 1\nspeed = 2\n",
            "gw.toml: upstreams.v.speed: unknown key",
        ),
        (
            "[models.m]\nupstream = 'ghost'\n",
            "gw.toml: models.m.upstream: names unknown upstream 'ghost'",
        ),
        ("[server]\nlisten = 'tcp:http'\n", "gw.toml: server.listen: bad endpoint string"),
    ],
)
def test_config_errors_stop_startup_with_one_line(
    tmp_path: Path, text: str | None, expected: str
) -> None:
    path = tmp_path / "gw.toml"
    if text is not None:
        path.write_text(text)
    result = run_gateway(tmp_path, "--config", str(path))
    assert result.returncode != 0
    assert "Traceback" not in result.stdout + result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert (
        len(lines) == 1
        and lines[0].startswith("homelab-gateway: config error: ")
        and expected in lines[0]
    )


def test_a_port_in_use_stops_startup_with_one_line(tmp_path: Path) -> None:
    holder = Process(
        [TWISTD, "--nodaemon", "--pidfile=", "homelab-stub", "--port", "tcp:0:interface=127.0.0.1"],
        tmp_path,
    )
    try:
        port = holder.wait_for_line(r"Site starting on (\d+)").group(1)
        (tmp_path / "gw.toml").write_text("")
        result = run_gateway(
            tmp_path,
            "--config",
            str(tmp_path / "gw.toml"),
            "--listen",
            f"tcp:{port}:interface=127.0.0.1",
        )
    finally:
        holder.stop()
    # By now twistd has sent stderr to its log: the message is one log line on stdout.
    output = result.stdout + result.stderr
    assert result.returncode != 0 and "Traceback" not in output
    lines = [line for line in output.splitlines() if "cannot listen" in line]
    assert len(lines) == 1 and f"cannot listen on 'tcp:{port}:interface=127.0.0.1'" in lines[0]


def test_options_need_a_config_or_the_demo(tmp_path: Path) -> None:
    result = run_gateway(tmp_path)
    assert (
        result.returncode != 0
        and "give exactly one of --config PATH or --demo" in result.stdout + result.stderr
    )


def test_the_demo_answers(tmp_path: Path) -> None:
    demo = Process(
        [
            TWISTD,
            "--nodaemon",
            "--pidfile=",
            "homelab-gateway",
            "--demo",
            "--listen",
            "tcp:0:interface=127.0.0.1",
        ],
        tmp_path,
    )
    try:
        url = demo.wait_for_line(r"homelab-gateway listening on (http://\S+)").group(1)
        status, _, body = post(
            url + "/llm/v1/messages",
            {
                "model": "qwen2.5:3b-instruct",
                "max_tokens": 8,
                "messages": [{"role": "user", "content": "hi"}],
            },
        )
        assert status == 200 and json.loads(body)["content"][0]["type"] == "text"
    finally:
        assert demo.stopped_cleanly(), "".join(demo.output)


def test_the_plugin_module_does_not_import_the_reactor() -> None:
    code = (
        "import sys, twisted.plugins.homelab_gateway_plugin as p; "
        "assert 'twisted.internet.reactor' not in sys.modules, 'reactor imported'; "
        "print(p.gateway.tapname, p.stub.tapname)"
    )
    result = run_to_end([sys.executable, "-c", code])
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["homelab-gateway", "homelab-stub"]


def test_stub_runs_as_a_module_and_lists_its_scenarios() -> None:
    result = run_to_end([sys.executable, "-m", "homelab_gateway.stub", "--help"])
    assert result.returncode == 0, result.stderr
    assert "reasoning-only" in result.stdout and "--hold" in result.stdout


def read_sse_events(response: Any) -> list[str]:
    return [line.decode().strip() for line in response if line.startswith(b"event:")]


def test_sigterm_drains_in_flight_and_fails_the_queued(tmp_path: Path) -> None:
    """A real twistd: SIGTERM lets the in-flight stream finish, fails the queued one with an
    error frame, and exits cleanly; the stub saw exactly one request."""
    stub, stub_url = start_stub(
        tmp_path,
        "--hold",
        "1",
        "--delay",
        "0.05",
        "--content-tokens",
        "6",
        "--reasoning-tokens",
        "0",
    )
    try:
        config = one_upstream_config(stub_url, server="shutdown_grace = 20")
        gateway, url = start_gateway(tmp_path, config)
        body = json.dumps(
            {
                "model": "reasoning",
                "max_tokens": 16,
                "stream": True,
                "messages": [{"role": "user", "content": "hi"}],
            }
        ).encode()
        results: dict[str, list[str]] = {}

        def stream(name: str) -> None:
            request = urllib.request.Request(
                url + "/llm/v1/messages", data=body, headers={"content-type": "application/json"}
            )
            with urllib.request.urlopen(request, timeout=30) as response:
                results[name] = read_sse_events(response)

        running = threading.Thread(target=stream, args=("running",))
        running.start()
        wait_until(lambda: status(url)["in_use"] == 1)
        queued = threading.Thread(target=stream, args=("queued",))
        queued.start()
        wait_until(lambda: status(url)["waiting"] == 1)
        gateway.popen.send_signal(signal.SIGTERM)
        running.join(30)
        queued.join(30)
        assert gateway.stopped_cleanly(), "".join(gateway.output)
        assert results["running"][0] == "event: message_start"
        assert results["running"][-1] == "event: message_stop"
        assert results["queued"] == ["event: queue", "event: error"]
        with urllib.request.urlopen(stub_url.removesuffix("/v1") + "/stub/status", timeout=5) as r:
            assert json.load(r)["requests"] == 1
    finally:
        stub.stop()


def status(url: str) -> dict[str, int]:
    return upstream_status(url, "vllm")


def test_json_log_format_writes_one_json_object_per_line(tmp_path: Path) -> None:
    stub, stub_url = start_stub(tmp_path)
    try:
        config = one_upstream_config(stub_url, server='log_format = "json"')
        gateway, url = start_gateway(tmp_path, config)
        post(
            url + "/llm/v1/messages",
            {
                "model": "reasoning",
                "max_tokens": 8,
                "messages": [{"role": "user", "content": "hi"}],
            },
        )
        wait_until(
            lambda: any('"homelab_gateway.requests"' in line for line in drain_lines(gateway))
        )
        assert gateway.stopped_cleanly()
    finally:
        stub.stop()
    events = [json.loads(line) for line in gateway.output if line.strip()]
    request = next(e for e in events if e.get("log_namespace") == "homelab_gateway.requests")
    assert (
        request["outcome"] == "completed"
        and request["status"] == 200
        and request["model"] == "reasoning"
    )


def drain_lines(process: Process) -> list[str]:
    while True:
        try:
            line = process.lines.get_nowait()
        except Exception:
            return process.output
        if line is None:
            return process.output
        process.output.append(line)
