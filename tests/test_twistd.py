"""The daemon as users run it: `twistd homelab-gateway` / `homelab-stub` as subprocesses."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from testsupport.processes import (
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
    result = run_to_end([sys.executable, "-m", "homelab_gateway.dev.stub", "--help"])
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
        gateway.signal(signal.SIGTERM)
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


def whole(url: str, results: dict[str, Any], name: str, model: str = "reasoning") -> None:
    """One non-streaming request; its (status, body) or the exception lands in `results`."""
    request = urllib.request.Request(
        url + "/llm/v1/messages",
        data=json.dumps(
            {"model": model, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
        ).encode(),
        headers={"content-type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            results[name] = (response.status, json.loads(response.read()))
    except urllib.error.HTTPError as e:
        results[name] = (e.code, json.loads(e.read()))
    except Exception as e:  # the test reports what the client saw
        results[name] = e


def test_sigterm_delivers_every_whole_answer_finished_in_the_grace(tmp_path: Path) -> None:
    """Two non-streaming answers in flight at SIGTERM, the second finishing last: both reach
    their clients before the process exits, and it exits 0."""
    stub, stub_url = start_stub(tmp_path, "--hold", "1.5")
    try:
        gateway, url = start_gateway(
            tmp_path, one_upstream_config(stub_url, slots=2, server="shutdown_grace = 20")
        )
        results: dict[str, Any] = {}
        threads = []
        for n, name in enumerate(("first", "last"), start=1):
            threads.append(threading.Thread(target=whole, args=(url, results, name)))
            threads[-1].start()
            wait_until(lambda n=n: status(url)["in_use"] == n)
        gateway.signal(signal.SIGTERM)
        for thread in threads:
            thread.join(30)
        for name in ("first", "last"):
            assert isinstance(results[name], tuple), results[name]
            code, document = results[name]
            assert code == 200 and document["type"] == "message", results[name]
        assert gateway.stopped_cleanly(), "".join(gateway.output)
    finally:
        stub.stop()


def test_a_second_sigterm_ends_the_grace_with_a_503_and_no_traceback(tmp_path: Path) -> None:
    stub, stub_url = start_stub(tmp_path, "--hold", "60")
    try:
        gateway, url = start_gateway(
            tmp_path, one_upstream_config(stub_url, server="shutdown_grace = 30")
        )
        results: dict[str, Any] = {}
        client = threading.Thread(target=whole, args=(url, results, "cut"))
        client.start()
        wait_until(lambda: stub_status(stub_url)["in_flight"] == 1)
        gateway.signal(signal.SIGTERM)
        gateway.wait_for_line(r"draining: 1 requests in flight")
        gateway.signal(signal.SIGTERM)
        gateway.wait_for_line(r"again: ending the grace period now")
        client.join(30)
        assert gateway.stopped_cleanly(), "".join(gateway.output)
    finally:
        stub.stop()
    code, document = results["cut"]
    assert code == 503 and document["error"]["type"] == "overloaded_error", results["cut"]


def stub_status(stub_url: str) -> dict[str, Any]:
    with urllib.request.urlopen(stub_url.removesuffix("/v1") + "/stub/status", timeout=5) as r:
        return json.load(r)


def test_sighup_reloads_under_load_and_keeps_running_on_an_invalid_file(tmp_path: Path) -> None:
    """A real twistd under load: a valid file adds a slot (the queued request gets it) and a
    model; an invalid one is one logged line and changes nothing; nothing in flight is lost."""
    stub, stub_url = start_stub(tmp_path, "--hold", "1", "--delay", "0.05", "--content-tokens", "6")
    try:
        gateway, url = start_gateway(tmp_path, one_upstream_config(stub_url))
        results: dict[str, list[str]] = {}

        def stream(name: str) -> None:
            request = urllib.request.Request(
                url + "/llm/v1/messages",
                data=json.dumps(
                    {
                        "model": "reasoning",
                        "max_tokens": 16,
                        "stream": True,
                        "messages": [{"role": "user", "content": "hi"}],
                    }
                ).encode(),
                headers={"content-type": "application/json"},
            )
            with urllib.request.urlopen(request, timeout=30) as response:
                results[name] = read_sse_events(response)

        threads = [threading.Thread(target=stream, args=(name,)) for name in ("held", "queued")]
        threads[0].start()
        wait_until(lambda: status(url)["in_use"] == 1)
        threads[1].start()
        wait_until(lambda: status(url)["waiting"] == 1)

        config = tmp_path / "gateway.toml"
        config.write_text(
            one_upstream_config(stub_url, slots=2)
            + '\n[models.fast]\nupstream = "vllm"\nupstream_model = "reasoning"\n'
        )
        gateway.signal(signal.SIGHUP)
        gateway.wait_for_line(r"config reloaded from .*gateway\.toml: 2 changes")
        slots = {k: v for k, v in status(url).items() if k in ("slots", "in_use", "waiting")}
        assert slots == {"slots": 2, "in_use": 2, "waiting": 0}
        with urllib.request.urlopen(url + "/llm/v1/models", timeout=5) as response:
            assert [m["id"] for m in json.load(response)["data"]] == ["reasoning", "fast"]

        config.write_text("[upstreams.vllm]\nurl = 'http://x/v1'\nslots = 0\n")
        gateway.signal(signal.SIGHUP)
        failed = gateway.wait_for_line(r"reload failed, still running the previous config: (.*)")
        assert "upstreams.vllm.slots: must be an integer >= 1" in failed.group(1)
        assert status(url)["slots"] == 2
        for thread in threads:
            thread.join(30)
        after: dict[str, Any] = {}
        whole(url, after, "fast", model="fast")
        assert after["fast"][0] == 200
        assert gateway.stopped_cleanly(), "".join(gateway.output)
    finally:
        stub.stop()
    for name in ("held", "queued"):
        assert results[name][-1] == "event: message_stop", results


def test_sighup_right_after_listening_reloads_rather_than_kills(tmp_path: Path) -> None:
    """`systemctl reload` just after start: SIGHUP's default action would end the process."""
    gateway, _ = start_gateway(tmp_path, "")
    gateway.signal(signal.SIGHUP)
    gateway.wait_for_line(r"config reloaded from .*gateway\.toml: 0 changes")
    assert gateway.stopped_cleanly(), "".join(gateway.output)
