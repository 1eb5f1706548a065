"""A real Redis server for the tests of lines shared between gateways (Debian's redis-server,
which `make test` installs when it is missing), on a free loopback port in a temporary
directory, without persistence: a restart is Redis losing its data."""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisServer:
    def __init__(self, *options: str) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="hg-redis-"))
        self.port = free_port()
        self.options = options  # more of redis-server's options (--replicaof HOST PORT)
        self.popen: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 20.0) -> None:
        """Start it and wait until it answers PING (bounded)."""
        self.popen = subprocess.Popen(
            [
                REDIS_SERVER,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.dir),
                "--logfile",
                str(self.dir / "redis.log"),
                *self.options,
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.ping():
                return
            if self.popen.poll() is not None:
                raise RuntimeError(f"redis-server exited: {(self.dir / 'redis.log').read_text()}")
            time.sleep(0.02)
        raise RuntimeError("redis-server did not answer PING")

    def ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def command(self, *args: str) -> int | str | None:
        """One command over a raw socket (RESP), for a test to look at Redis itself."""
        request = f"*{len(args)}\r\n" + "".join(f"${len(a)}\r\n{a}\r\n" for a in args)
        with socket.create_connection(("127.0.0.1", self.port), timeout=5) as s:
            s.sendall(request.encode())
            reply = s.recv(65536).decode()
        kind, rest = reply[0], reply[1:].split("\r\n")[0]
        if kind == ":":
            return int(rest)
        if kind == "+":
            return rest
        if kind == "$":
            return None if rest == "-1" else reply.split("\r\n")[1]
        raise RuntimeError(reply)

    def stop(self) -> None:
        """Kill it (SIGKILL: an outage, not a shutdown) and wait for the process to end."""
        if self.popen is not None and self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait(10)
        self.popen = None

    def pause(self) -> None:
        """SIGSTOP: a slow disk, a fork for a snapshot, a VM's hiccup. Its sockets stay open."""
        assert self.popen is not None
        self.popen.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.popen is not None
        self.popen.send_signal(signal.SIGCONT)

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


class SentinelSet:
    """A primary, its replica and one Sentinel watching them as `MASTER` (quorum 1, down after
    half a second): killing the primary promotes the replica within a few seconds."""

    MASTER = "hg"

    def __init__(self) -> None:
        self.primary = RedisServer()
        self.primary.start()
        self.replica = RedisServer("--replicaof", "127.0.0.1", str(self.primary.port))
        self.replica.start()
        self.dir = Path(tempfile.mkdtemp(prefix="hg-sentinel-"))
        self.port = free_port()
        config = self.dir / "sentinel.conf"
        config.write_text(
            f"port {self.port}\nbind 127.0.0.1\ndir {self.dir}\n"
            f"sentinel monitor {self.MASTER} 127.0.0.1 {self.primary.port} 1\n"
            f"sentinel down-after-milliseconds {self.MASTER} 500\n"
            f"sentinel failover-timeout {self.MASTER} 2000\n"
        )
        self.sentinel = subprocess.Popen(
            [REDIS_SERVER, str(config), "--sentinel", "--logfile", str(self.dir / "log")],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not self._sentinel_knows_the_replica():
            time.sleep(0.05)

    def _sentinel_knows_the_replica(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as s:
                s.sendall(f"SENTINEL REPLICAS {self.MASTER}\r\n".encode())
                return str(self.replica.port).encode() in s.recv(65536)
        except OSError:
            return False

    def close(self) -> None:
        if self.sentinel.poll() is None:
            self.sentinel.kill()
            self.sentinel.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)
        self.replica.close()
        self.primary.close()
