"""A server's processes: started in a session of their own, their output logged a line at a
time, and their group checked and signalled as a whole (a server's workers are its children).

Liveness is read from /proc: a pid with the start time it had when recorded is the same process,
and a zombie has exited (a reaper that never reaps must not keep a server alive).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from twisted.internet.protocol import ProcessProtocol
from twisted.logger import Logger
from twisted.python.failure import Failure

log = Logger()

LINE_LIMIT = 8192  # bytes of a line without an end logged as it stands
NEW_SESSION = """\
import os, signal, sys
os.setsid()
signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
try:
    os.execvp(sys.argv[1], sys.argv[1:])
except OSError as e:
    sys.exit(f"{sys.argv[1]}: {e.strerror}")
"""
"""Runs an argv in a new session: spawnProcess takes no preexec function, and Python is the one
program sure to be there (util-linux's `setsid` is not, and forks when its caller leads a group).
SIGPIPE stays ignored as Python leaves it, so a server outlives its dead gateway's output pipes
and the next gateway can adopt it."""


@dataclass(slots=True)
class Running:
    """One server process: `pid` leads its process group. `start` tells a reused pid apart."""

    pid: int
    start: str | None
    output: Output | None  # None: adopted, not our child
    exited: str | None = None  # how our child ended, once it has

    def alive(self) -> bool:
        if self.output is not None:
            return self.exited is None
        return self.start is not None and start_time(self.pid) == self.start


class Output(ProcessProtocol):
    """A process's stdout and stderr into the log, a line at a time, named by `label`."""

    def __init__(self, label: str, lines: deque[str]) -> None:
        self.label = label
        self.lines = lines
        self.exited: Callable[[str], None] = lambda how: None
        self._partial = {1: b"", 2: b""}

    def childDataReceived(self, childFD: int, data: bytes) -> None:
        text = self._partial.get(childFD, b"") + data.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        *complete, rest = text.split(b"\n")
        if len(rest) > LINE_LIMIT:
            complete.append(rest)
            rest = b""
        self._partial[childFD] = rest
        for line in complete:
            self._line(line)

    def _line(self, raw: bytes) -> None:
        line = raw.decode("utf-8", "replace").rstrip()
        if line:
            self.lines.append(line)
            log.info("{upstream}: {line}", upstream=self.label, line=line)

    def processExited(self, reason: Failure) -> None:
        code = getattr(reason.value, "exitCode", None)
        number = getattr(reason.value, "signal", None)
        how = f"killed by signal {number}" if number else f"exited with code {code or 0}"
        self.exited(how)

    def processEnded(self, reason: Failure) -> None:
        for fd, rest in self._partial.items():
            self._partial[fd] = b""
            self._line(rest)


def stat(pid: int) -> list[bytes] | None:
    """/proc/PID/stat's fields after the command's name: state, ppid, pgrp, ... starttime."""
    try:
        text = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    return text[text.rindex(b")") + 2 :].split()


def start_time(pid: int) -> str | None:
    """When `pid` started (clock ticks since boot), None if nothing runs as `pid` (a zombie
    has exited: a reaper that never reaps must not keep it alive)."""
    fields = stat(pid)
    if fields is None or fields[0] in (b"Z", b"X"):
        return None
    return fields[19].decode()


def group_alive(running: Running) -> bool:
    """Whether anything of the server runs: its leader, or any live member of its group."""
    if running.alive():
        return True
    try:
        os.killpg(running.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            fields = stat(int(entry.name))
            if fields and fields[2] == str(running.pid).encode() and fields[0] not in (b"Z", b"X"):
                return True
    return False


def signal_group(running: Running, number: int) -> None:
    try:
        os.killpg(running.pid, number)
    except ProcessLookupError:
        # A child not yet in its own session (between its start and setsid) has no group.
        if running.alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(running.pid, number)
    except PermissionError as e:
        log.error("cannot signal process group {pid}: {e}", pid=running.pid, e=e)


def spawn(
    reactor: Any,
    label: str,
    argv: Sequence[str],
    lines: deque[str],
    on_exit: Callable[[Running], None] = lambda running: None,
) -> Running:
    """Run `argv` (no shell) in a new session, its output logged as `label`'s; `on_exit` is told
    when it has exited."""
    output = Output(label, lines)
    transport = reactor.spawnProcess(
        output,
        sys.executable,
        [sys.executable, "-I", "-c", NEW_SESSION, *argv],
        env=dict(os.environ),
        usePTY=False,
    )
    transport.closeStdin()
    running = Running(transport.pid, start_time(transport.pid), output)

    def exited(how: str) -> None:
        running.exited = how
        on_exit(running)

    output.exited = exited
    return running
