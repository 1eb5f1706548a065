"""The container image as operators run it (docs/deploy.md), built and run with podman.

No registry is reachable here, so the image is built FROM a stand-in for the official python
image: Debian's own python3 in a root file system that mmdebstrap makes and `podman import`
stores, once (podman's image store keeps it, and the build's layers, between runs). These
machines need runc as the runtime, the host's network (the stub upstream listens on the host's
loopback, and so does each gateway, on a free port that HOMELAB_GATEWAY_PORT tells the
healthcheck), lower rlimits than podman's defaults, and the docker image format, which keeps
the HEALTHCHECK. The host's pip.conf and CA bundle reach pip in the build as read-only volumes,
never as files of the image.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from testsupport.processes import one_upstream_config, start_stub, wait_until

ROOT = Path(__file__).resolve().parents[1]
STAND_IN = "localhost/homelab-gateway-stand-in:bookworm"
IMAGE = "localhost/homelab-gateway:test"
PODMAN = ["podman", "--runtime", "runc"]
LIMITS = ["--network", "host", "--ulimit", "nofile=4096:4096", "--ulimit", "nproc=4096:4096"]
HOST_FILES = ["/etc/pip.conf", "/etc/ssl/certs/ca-certificates.crt"]
CONFIG = "/etc/homelab-gateway/gateway.toml"
STATE = "/var/lib/homelab-gateway"
MB = 1_000_000


def podman(*args: str, timeout: float = 120.0) -> str:
    """A podman command that must succeed; its standard output."""
    done = subprocess.run(
        [*PODMAN, *args], capture_output=True, text=True, timeout=timeout, check=False
    )
    assert done.returncode == 0, f"podman {' '.join(args)}: {done.returncode}\n{done.stderr}"
    return done.stdout


def inspect(kind: str, name: str) -> dict[str, Any]:
    return json.loads(podman(kind, "inspect", name))[0]


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The image's ID, built FROM the stand-in base (made first where podman has none). The
    tests use the ID: the tag is for people, and another checkout's run may move it."""
    for tool in ("podman", "runc", "mmdebstrap"):
        assert shutil.which(tool), f"{tool} is missing: `make test` installs it"
    exists = subprocess.run([*PODMAN, "image", "exists", STAND_IN], check=False)
    if exists.returncode != 0:
        debootstrap = subprocess.Popen(
            [
                "mmdebstrap",
                "--quiet",
                "--variant=apt",
                "--include=python3,python3-venv,ca-certificates",
                "bookworm",
                "-",
            ],
            stdout=subprocess.PIPE,
        )
        imported = subprocess.run(
            [*PODMAN, "import", "-", STAND_IN],
            stdin=debootstrap.stdout,
            capture_output=True,
            timeout=600,
            check=False,
        )
        assert debootstrap.wait(timeout=60) == 0, "mmdebstrap failed"
        assert imported.returncode == 0, imported.stderr
    mounts = [f"--volume={path}:{path}:ro" for path in HOST_FILES if Path(path).exists()]
    iidfile = tmp_path_factory.mktemp("build") / "iid"
    podman(
        "build",
        "--format=docker",
        *LIMITS,
        *mounts,
        f"--build-arg=BASE={STAND_IN}",
        f"--tag={IMAGE}",
        f"--iidfile={iidfile}",
        str(ROOT),
        timeout=900,
    )
    return iidfile.read_text().strip()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Containers:
    """Containers and volumes of this run, under names no other run uses, all removed at the end."""

    def __init__(self, image: str, config: Path) -> None:
        self.image = image
        self.config = config
        self.prefix = f"hgw-test-{uuid.uuid4().hex[:8]}"
        self.names: list[str] = []
        self.volumes: list[str] = []

    def volume(self, label: str) -> str:
        name = f"{self.prefix}-{label}"
        podman("volume", "create", name)
        self.volumes.append(name)
        return name

    def run(self, label: str, *args: str, volume: str | None = None) -> tuple[str, str]:
        """Start a container on a free port of the host's loopback and wait until its
        healthcheck passes; its name and URL. `args` replace the image's default arguments
        (the config, which is the test's config, mounted where the image looks)."""
        name = f"{self.prefix}-{label}-{len(self.names)}"
        port = free_port()
        self.names.append(name)
        mounts = [f"--volume={self.config}:{CONFIG}:ro"]
        if volume is not None:
            mounts.append(f"--volume={volume}:{STATE}")
        podman(
            "run",
            "--detach",
            f"--name={name}",
            *LIMITS,
            f"--env=HOMELAB_GATEWAY_PORT={port}",
            *mounts,
            self.image,
            *(args or ["--config", CONFIG, "--listen", f"tcp:{port}:interface=127.0.0.1"]),
        )
        wait_healthy(name)
        return name, f"http://127.0.0.1:{port}"

    def remove(self) -> None:
        if self.names:
            podman("rm", "--force", "--ignore", "--volumes", "--time=0", *self.names)
        if self.volumes:
            podman("volume", "rm", "--force", *self.volumes)


def wait_healthy(name: str, timeout: float = 60.0) -> None:
    """Run the image's healthcheck until it passes (podman runs it on a systemd timer, which
    these machines lack), failing at once, with the log, if the container has stopped."""

    def healthy() -> bool:
        check = subprocess.run(
            [*PODMAN, "healthcheck", "run", name], capture_output=True, check=False
        )
        if check.returncode == 0:
            return True
        state = inspect("container", name)["State"]
        assert state["Running"], f"{name} exited {state['ExitCode']}:\n{podman('logs', name)}"
        return False

    wait_until(healthy, timeout)


@pytest.fixture(scope="module")
def containers(image: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Containers]:
    """A stub upstream on the host's loopback, slow enough (about 2.5 s an answer) for a stop
    to land in the middle of one, and a config that names it."""
    cwd = tmp_path_factory.mktemp("container")
    stub, stub_url = start_stub(cwd, "--delay", "0.05", "--content-tokens", "40")
    config = cwd / "gateway.toml"
    config.write_text(one_upstream_config(stub_url, slots=2))
    config.chmod(0o644)  # read by the image's user
    running = Containers(image, config)
    try:
        yield running
    finally:
        running.remove()
        stub.stop()


def ask(url: str, stream: bool, model: str = "reasoning") -> Any:
    """A request for `model`; the open response."""
    body = {
        "model": model,
        "max_tokens": 64,
        "stream": stream,
        "messages": [{"role": "user", "content": "hi"}],
    }
    request = urllib.request.Request(
        url + "/llm/v1/messages",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
    )
    return urllib.request.urlopen(request, timeout=30)


def events(lines: Iterator[bytes]) -> list[str]:
    return [line.decode().strip() for line in lines if line.startswith(b"event:")]


def usage_rows(url: str) -> list[dict[str, Any]]:
    with urllib.request.urlopen(url + "/llm/v1/usage?by=model", timeout=10) as response:
        return json.load(response)["rows"]


def test_the_image_is_what_the_contract_says(image: str) -> None:
    config = inspect("image", image)["Config"]
    assert config["User"] == "homelab-gateway"
    assert config["WorkingDir"] == STATE
    assert STATE in config["Volumes"]
    assert "8080/tcp" in config["ExposedPorts"]
    assert config["Cmd"] == ["--config", CONFIG]
    assert "twistd --nodaemon --pidfile= homelab-gateway" in " ".join(config["Entrypoint"])
    test = inspect("image", image)["Healthcheck"]["Test"]
    assert test[:2] == ["CMD", "python"] and "/healthz" in test[-1]
    base = inspect("image", STAND_IN)["Size"]
    assert inspect("image", image)["Size"] - base <= 120 * MB


def test_a_streamed_answer_completes_through_the_container(containers: Containers) -> None:
    name, url = containers.run("stream")
    assert inspect("container", name)["State"]["Health"]["Status"] == "healthy"
    with ask(url, stream=True) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        seen = events(response)
    assert seen[0] == "event: message_start" and seen[-1] == "event: message_stop"
    assert "event: content_block_delta" in seen


def test_the_demo_listens_on_every_interface(containers: Containers) -> None:
    """`docker run -p 8080:8080 IMAGE --demo`: the demo's arguments replace the config, and it
    listens on all of the container's interfaces, so a published port reaches it."""
    name, url = containers.run("demo", "--demo")
    assert "homelab-gateway listening on http://0.0.0.0:" in podman("logs", name)
    with ask(url, stream=False, model="qwen2.5:3b-instruct") as response:
        assert json.load(response)["content"][0]["type"] == "text"


def test_a_stop_during_a_stream_lets_it_complete_and_exits_0(containers: Containers) -> None:
    name, url = containers.run("stop")
    with ask(url, stream=True) as response:
        lines = iter(response)
        for line in lines:
            if line.startswith(b"event: content_block_delta"):
                break  # the answer is under way
        else:
            pytest.fail("the stream ended before its answer began")
        # A timeout far above the drain's needs: a kill would show as a failure, not a pass.
        stop = subprocess.Popen([*PODMAN, "stop", "--time=60", name], stdout=subprocess.DEVNULL)
        seen = events(lines)
    assert stop.wait(timeout=90) == 0
    assert seen[-1] == "event: message_stop" and "event: error" not in seen
    state = inspect("container", name)["State"]
    log = podman("logs", name)
    assert state["ExitCode"] == 0 and not state["OOMKilled"], log
    assert "homelab-gateway draining: 1 requests in flight" in log
    assert "Server Shut Down." in log and "Traceback" not in log


def test_the_ledger_survives_replacing_the_container(containers: Containers) -> None:
    volume = containers.volume("state")
    first, url = containers.run("ledger", volume=volume)
    with ask(url, stream=False) as response:
        assert json.load(response)["type"] == "message"
    rows = usage_rows(url)
    assert [(row["model"], row["requests"]) for row in rows] == [("reasoning", 1)]
    podman("stop", "--time=60", first)
    podman("rm", first)
    containers.names.remove(first)
    mountpoint = Path(inspect("volume", volume)["Mountpoint"])
    assert (mountpoint / "usage.sqlite3").exists()
    _, url = containers.run("ledger", volume=volume)
    assert usage_rows(url) == rows


def test_compose_runs_the_demo_as_the_contract_says(image: str) -> None:
    text = (ROOT / "compose.yaml").read_text()
    compose = yaml.safe_load(text)
    gateway = compose["services"]["gateway"]
    assert gateway["build"] == "."
    assert gateway["command"] == ["--demo"]
    assert "8080:8080" in gateway["ports"]
    assert f"./etc/homelab-gateway.toml:{CONFIG}:ro" in gateway["volumes"]
    (state,) = [v for v in gateway["volumes"] if v.endswith(f":{STATE}")]
    assert state.split(":")[0] in compose["volumes"]
    assert gateway["init"] is True and gateway["restart"] == "unless-stopped"
    assert gateway["healthcheck"]["test"] == inspect("image", image)["Healthcheck"]["Test"]
    examples = {name: commented_service(text, name) for name in ("vllm", "redis")}
    (gpu,) = examples["vllm"]["deploy"]["resources"]["reservations"]["devices"]
    assert gpu["driver"] == "nvidia" and gpu["capabilities"] == ["gpu"]
    assert examples["redis"]["image"].startswith("redis:")


def commented_service(text: str, name: str) -> dict[str, Any]:
    """A commented-out service of compose.yaml, uncommented as an editor does (the `# ` after
    the indentation removed): it must be ready to run."""
    lines = text.splitlines()
    start = lines.index(f"  # {name}:")
    block = [lines[start]]
    for line in lines[start + 1 :]:
        if not line.startswith("  #   "):
            break
        block.append(line)
    uncommented = "\n".join(line[:2] + line[4:] for line in block)
    return yaml.safe_load("services:\n" + uncommented)["services"][name]
