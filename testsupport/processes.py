"""Real `twistd` processes for the tests that run the gateway the way its users do.

Each process runs from a temporary directory with no PYTHONPATH, so `twistd homelab-gateway`
must find the plugin where `pip install` put it, not in this checkout.
"""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from testsupport.client import get_json

BIN = Path(sys.executable).parent
TWISTD = str(BIN / "twistd")


def clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
    env["PYTHONUNBUFFERED"] = "1"
    return env


class Process:
    """A child process whose output is read line by line on a thread, so waits are bounded."""

    def __init__(self, args: list[str], cwd: Path, env: dict[str, str] | None = None) -> None:
        self.args = args
        self.popen = subprocess.Popen(
            args,
            cwd=cwd,
            env=env or clean_env(),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.terminated = False
        self.output: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def wait_for_line(self, pattern: str, timeout: float = 20.0) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                break
            if line is None:
                break
            self.output.append(line)
            match = re.search(pattern, line)
            if match:
                return match
        raise AssertionError(
            f"{pattern!r} not seen from {self.args}; output:\n{''.join(self.output)}"
        )

    def signal(self, number: int) -> None:
        if number == signal.SIGTERM:
            self.terminated = True
        self.popen.send_signal(number)

    def stop(self, timeout: float = 10.0) -> int:
        """SIGTERM (unless already sent: a second one would end the grace period, or find the
        default action back once the reactor has stopped), then wait for the exit."""
        if self.popen.poll() is None and not self.terminated:
            self.signal(signal.SIGTERM)
        if self.popen.poll() is None:
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        return self.popen.returncode

    def output_so_far(self) -> str:
        """Everything the process wrote up to now, without waiting for more."""
        while True:
            try:
                line = self.lines.get_nowait()
            except queue.Empty:
                break
            if line is None:
                self.lines.put(None)  # a later call finds the end again
                break
            self.output.append(line)
        return "".join(self.output)

    def all_output(self) -> str:
        """Everything the process wrote, once it has exited (read to the end of its output)."""
        while (line := self.lines.get(timeout=5)) is not None:
            self.output.append(line)
        self.lines.put(None)  # a later call finds the end again
        return "".join(self.output)

    def stopped_cleanly(self) -> bool:
        """SIGTERM, then a clean shutdown: exit status 0 (the gateway does not re-raise the
        signal the way twistd would; the stub, plain twistd, does), no traceback."""
        code = self.stop()
        text = self.all_output()
        expected = 0 if "homelab-gateway" in self.args else -signal.SIGTERM
        return code == expected and "Server Shut Down." in text and "Traceback" not in text


def one_upstream_config(stub_url: str, *, slots: int = 1, server: str = "") -> str:
    """A config with one upstream `vllm` serving the model `reasoning`; `server` is the body
    of a [server] table."""
    head = f"[server]\n{server}\n\n" if server else ""
    return (
        f'{head}[upstreams.vllm]\nurl = "{stub_url}"\nslots = {slots}\n\n'
        '[models.reasoning]\nupstream = "vllm"\n'
    )


def start_stub(cwd: Path, *options: str) -> tuple[Process, str]:
    process = Process(
        [
            TWISTD,
            "--nodaemon",
            "--pidfile=",
            "homelab-stub",
            "--port",
            "tcp:0:interface=127.0.0.1",
            *options,
        ],
        cwd,
    )
    port = process.wait_for_line(r"Site starting on (\d+)").group(1)
    return process, f"http://127.0.0.1:{port}/v1"


def start_gateway(
    cwd: Path, config: str, *options: str, env: dict[str, str] | None = None
) -> tuple[Process, str]:
    """`env` adds to the clean environment (e.g. HOMELAB_GATEWAY_PROFILE)."""
    path = cwd / "gateway.toml"
    path.write_text(config)
    args = [
        TWISTD,
        "--nodaemon",
        "--pidfile=",
        "homelab-gateway",
        "--config",
        str(path),
        "--listen",
        "tcp:0:interface=127.0.0.1",
        *options,
    ]
    process = Process(args, cwd, {**clean_env(), **(env or {})})
    # The listen line, in the text log format or the JSON one.
    line = process.wait_for_line(r"homelab-gateway listening on").string
    match = re.search(r"http://127\.0\.0\.1:\d+", line)
    assert match is not None, line
    return process, match.group(0)


def free_port() -> int:
    """A port nothing listens on now: for a server the gateway itself starts later."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(condition: Any, timeout: float = 20.0) -> None:
    """Poll a condition across processes until it holds: a bounded wait for a state, never a
    fixed sleep. The bound is generous because a passing wait ends as soon as the state holds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"condition not met within {timeout}s"
        time.sleep(0.02)


def upstream_status(url: str, upstream: str) -> dict[str, int]:
    """One upstream's slots, in use and waiting, from a running gateway's /llm/v1/status."""
    with urllib.request.urlopen(url + "/llm/v1/status", timeout=5) as response:
        return json.load(response)["upstreams"][upstream]


def linked(gateway: str, timeout: float = 30.0) -> None:
    """Wait (bounded) until a gateway with [cluster] reports its link to Redis up: until then
    it answers 529."""
    deadline = time.monotonic() + timeout
    while get_json(gateway + "/llm/v1/status").get("cluster", {}).get("redis") != "up":
        if time.monotonic() > deadline:
            raise TimeoutError(f"{gateway} never linked to Redis")
        time.sleep(0.05)


def load_average() -> str:
    """1, 5 and 15 minutes: the machine is shared, and the figures move with its load."""
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])
