"""The servers of managed upstreams: started, watched and stopped by the gateway.

A `ManagedServer` runs its upstream's `start` argv (no shell) in a session of its own, so that
a stop reaches the whole process group (vLLM's engine core is a child process that would keep
the accelerator's memory). Its stdout and stderr go to the gateway's log a line at a time,
named by the upstream; the last lines are kept for the failure report. It is loaded once its
health probe answers "ready". A `SleepingServer` is a vLLM server in sleep mode: it stays up,
and loading and unloading are its wake_up and sleep endpoints.

Their log says what happens to the process (started, adopted, stopped, killed) and why one
failed; the states themselves (loaded, unloaded) are the residency's to log.

Both report each change of state through `on_state(state, failure)`: `loading`, `loaded`,
`unloading` and `unloaded` as the gateway asks, and `failure` (a `ServerFailed`) when the server
exits, is not healthy within `load_timeout`, or cannot be put to sleep; such a change goes
through `unloading` while anything of the server still runs (its memory counts as used until
then) and ends in `failed`.
"""

from __future__ import annotations

import json
import signal
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from twisted.internet.defer import CancelledError, Deferred, ensureDeferred, succeed
from twisted.internet.interfaces import IDelayedCall, IReactorProcess, IReactorTime
from twisted.internet.task import deferLater
from twisted.logger import Logger
from twisted.python.failure import Failure

from homelab_gateway.upstream.kinds.base import root
from homelab_gateway.upstream.processes import Running, group_alive, signal_group, spawn, start_time

log = Logger()

Probe = Callable[[], Awaitable[str]]
"""A health probe: "ready", "loading" (it answers, not yet ready) or "down" (no answer). While
its process lives, a server that is not ready is still loading, whatever the probe says."""
OnState = Callable[[str, "ServerFailed | None"], None]

PROBE_TIMEOUT = 5.0  # seconds a health probe may take: longer is "down"
STOP_POLL = 0.1  # seconds between checks that a stopped server's processes are gone


class ServerFailed(Exception):
    """Why a server failed, with the last lines it printed."""

    def __init__(self, reason: str, lines: Sequence[str] = ()) -> None:
        super().__init__(reason)
        self.reason = reason
        self.lines = tuple(lines)

    def __str__(self) -> str:
        if not self.lines:
            return self.reason
        return self.reason + "; its last lines:\n" + "\n".join(self.lines)


class _Resident:
    """A state, the callback told each change, and those waiting for a load or an unload."""

    def __init__(self, name: str, on_state: OnState, clock: IReactorTime) -> None:
        self.name = name
        self.on_state = on_state
        self.clock = clock
        self.state = "unloaded"
        self.failure: ServerFailed | None = None
        self.load_seconds: float | None = None  # how long the last load took
        self._loads: list[Deferred[None]] = []
        self._unloads: list[Deferred[None]] = []

    def _set(self, state: str, failure: ServerFailed | None = None) -> None:
        if state == self.state and failure is self.failure:
            return
        self.state = state
        self.failure = failure
        self.on_state(state, failure)

    @staticmethod
    def _wait(waiters: list[Deferred[None]]) -> Deferred[None]:
        def forget(d: Deferred[None]) -> None:
            if d in waiters:
                waiters.remove(d)

        d: Deferred[None] = Deferred(forget)
        waiters.append(d)
        return d

    @staticmethod
    def _fire(waiters: list[Deferred[None]], error: BaseException | None = None) -> None:
        fired = list(waiters)
        waiters.clear()
        for d in fired:
            if error is None:
                d.callback(None)
            else:
                d.errback(Failure(error))


class ManagedServer(_Resident):
    """A server the gateway starts on demand and stops; see the module's docstring.

    `state_file` records the running server (pid, its start time, argv, url): a gateway that
    crashed leaves it behind, and the next one's `adopt` (or first `load`) takes over the server
    it names, if that still runs this argv and url, rather than start a second one; a server of
    another config is stopped. An adopted server is not our child: its exit is seen by polling
    /proc, and its output, which went to the dead gateway, is not logged.
    """

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        url: str,
        probe: Probe,
        on_state: OnState,
        *,
        reactor: Any,  # IReactorProcess and IReactorTime
        state_file: Path,
        stop_argv: Sequence[str] | None = None,
        load_timeout: float = 600.0,
        stop_timeout: float = 30.0,
        poll_interval: float = 0.5,
        keep_lines: int = 20,
    ) -> None:
        super().__init__(name, on_state, reactor)
        self.reactor: IReactorProcess = reactor
        self.argv = list(argv)
        self.url = url
        self.probe = probe
        self.state_file = state_file
        self.stop_argv = list(stop_argv) if stop_argv else None
        self.load_timeout = load_timeout
        self.stop_timeout = stop_timeout
        self.poll_interval = poll_interval
        self.lines: deque[str] = deque(maxlen=keep_lines)
        self._running: Running | None = None
        self._stopper: Running | None = None  # the stop argv's process
        self._timer: IDelayedCall | None = None
        self._probing: Deferred[str] | None = None
        self._since = 0.0  # when the load or the stop began
        self._cause: str | None = None  # the failure a stop ends in
        self._killed = False

    @property
    def pid(self) -> int | None:
        return self._running.pid if self._running is not None else None

    def adopt(self) -> bool:
        """At the gateway's start: take over the server a previous run left, if it runs this
        config (then loading, and loaded once its probe answers). Else forget the record."""
        return self.state == "unloaded" and self._adopt()

    def load(self) -> Deferred[None]:
        """Fires once the server is loaded; fails with `ServerFailed`, or CancelledError if it
        is unloaded first. A load while loading waits for the same start."""
        if self.state == "loaded":
            return succeed(None)
        d = self._wait(self._loads)
        if self.state in ("unloaded", "failed"):
            self._start()
        return d  # unloading: started again once the stop is over

    def unload(self) -> Deferred[None]:
        """Stop the server (a load in progress is cancelled); fires once its processes have
        exited."""
        self._fire(self._loads, CancelledError(f"{self.name} was unloaded"))
        if self.state in ("unloaded", "failed"):
            return succeed(None)
        d = self._wait(self._unloads)
        if self.state != "unloading":
            self._stop(None)
        return d

    def _start(self) -> None:
        if self._adopt() or self.state == "unloading":
            return  # adopted, or stopping a server of another config first
        self.lines.clear()  # a failure reports this run's lines
        try:
            running = spawn(self.reactor, self.name, self.argv, self.lines, self._exited)
        except OSError as e:
            failure = ServerFailed(f"could not start: {e}")
            log.error("{upstream}: {why}", upstream=self.name, why=failure)
            self._set("failed", failure)
            self._fire(self._loads, failure)
            return
        self._running = running
        self._record()
        log.info(
            "{upstream}: started {argv} as pid {pid}",
            upstream=self.name,
            argv=" ".join(self.argv),
            pid=running.pid,
        )
        self._loading()

    def _adopt(self) -> bool:
        try:
            record = json.loads(self.state_file.read_text())
            pid, start = record["pid"], record["start"]
        except FileNotFoundError:
            return False
        except (OSError, ValueError, KeyError, TypeError):
            self.state_file.unlink(missing_ok=True)
            return False
        if not isinstance(pid, int) or start is None or start_time(pid) != start:
            self.state_file.unlink(missing_ok=True)
            return False
        self._running = Running(pid, start, None)
        if record.get("argv") != self.argv or record.get("url") != self.url:
            log.warn(
                "{upstream}: pid {pid}, left by an earlier run, runs another config: stopping it",
                upstream=self.name,
                pid=pid,
            )
            self._stop(None)
            return False
        log.info(
            "{upstream}: adopting pid {pid}, left by an earlier run", upstream=self.name, pid=pid
        )
        self._loading()
        return True

    def _record(self) -> None:
        assert self._running is not None
        record = {
            "pid": self._running.pid,
            "pgid": self._running.pid,
            "start": self._running.start,
            "argv": self.argv,
            "url": self.url,
        }
        self.state_file.parent.mkdir(parents=True, exist_ok=True)
        partial = self.state_file.with_name(self.state_file.name + ".partial")
        partial.write_text(json.dumps(record))
        partial.replace(self.state_file)

    def _loading(self) -> None:
        self._since = self.clock.seconds()
        self._timer = self.clock.callLater(0, self._poll)
        self._set("loading")

    def _poll(self) -> None:
        """One health probe while loading; an adopted server's exit is noticed here too."""
        self._timer = None
        running = self._running
        assert running is not None
        if not running.alive():
            self._stop("its process is gone")
            return
        if self.state == "loaded":
            self._timer = self.clock.callLater(self.poll_interval, self._poll)
            return
        if self.clock.seconds() - self._since >= self.load_timeout:
            self._stop(f"not healthy within {self.load_timeout:g}s")
            return
        d = self._probing = ensureDeferred(self.probe())
        d.addTimeout(PROBE_TIMEOUT, self.clock)

        def probed(answer: object) -> None:
            if self._probing is not d:
                return  # cancelled by a stop
            self._probing = None
            if answer == "ready":
                self._loaded()
            else:
                self._timer = self.clock.callLater(self.poll_interval, self._poll)

        d.addBoth(probed)

    def _loaded(self) -> None:
        assert self._running is not None
        self.load_seconds = self.clock.seconds() - self._since
        if self._running.output is None:  # adopted: its exit is seen by polling
            self._timer = self.clock.callLater(self.poll_interval, self._poll)
        self._set("loaded")
        self._fire(self._loads)

    def _exited(self, running: Running) -> None:
        if running is self._running and self.state in ("loading", "loaded"):
            self._stop(running.exited)

    def _stop(self, cause: str | None) -> None:
        """SIGTERM to the group (or the stop argv), SIGKILL after `stop_timeout`; `cause`: why
        the server failed, None for a stop the gateway asked for."""
        self._cancel()
        self._cause = cause
        self._since = self.clock.seconds()
        self._killed = False
        failure = ServerFailed(cause, self.lines) if cause is not None else None
        if failure is not None:
            log.error("{upstream}: {why}", upstream=self.name, why=failure)
        else:
            log.info("{upstream}: stopping pid {pid}", upstream=self.name, pid=self.pid)
        if self.stop_argv is not None:
            self._run_stop_argv()
        else:
            self._signal(signal.SIGTERM)
        self._timer = self.clock.callLater(STOP_POLL, self._stopping)
        self._set("unloading", failure)
        if failure is not None:
            self._fire(self._loads, failure)

    def _run_stop_argv(self) -> None:
        assert self.stop_argv is not None
        log.info("{upstream}: running {argv}", upstream=self.name, argv=" ".join(self.stop_argv))
        label = f"{self.name} (stop)"
        try:
            self._stopper = spawn(self.reactor, label, self.stop_argv, deque(maxlen=1))
        except OSError as e:
            log.error("{upstream}: could not run its stop: {e}", upstream=self.name, e=e)
            self._signal(signal.SIGTERM)

    def _stopping(self) -> None:
        self._timer = None
        assert self._running is not None
        stopper = self._stopper
        if not group_alive(self._running) and (stopper is None or not stopper.alive()):
            self._stopped()
            return
        if not self._killed and self.clock.seconds() - self._since >= self.stop_timeout:
            log.warn(
                "{upstream}: still running {seconds:g}s after its stop: SIGKILL",
                upstream=self.name,
                seconds=self.stop_timeout,
            )
            self._killed = True
            self._signal(signal.SIGKILL)
        self._timer = self.clock.callLater(STOP_POLL, self._stopping)

    def _stopped(self) -> None:
        self._running = self._stopper = None
        self.state_file.unlink(missing_ok=True)
        if self._cause is not None:
            self._set("failed", ServerFailed(self._cause, self.lines))
        else:
            self._set("unloaded")
        self._fire(self._unloads)
        if self._loads and self.state in ("unloaded", "failed"):
            self._start()

    def _signal(self, number: int) -> None:
        for running in (self._running, self._stopper):
            if running is not None:
                signal_group(running, number)

    def _cancel(self) -> None:
        if self._timer is not None and self._timer.active():
            self._timer.cancel()
        self._timer = None
        probing, self._probing = self._probing, None
        if probing is not None:
            probing.cancel()


class HTTPClient(Protocol):
    """What the servers need of treq (or treq.testing.StubTreq)."""

    def get(self, url: str, **kwargs: Any) -> Deferred[Any]: ...

    def post(self, url: str, **kwargs: Any) -> Deferred[Any]: ...


class SleepingServer(_Resident):
    """A vLLM server in sleep mode (`--enable-sleep-mode`, VLLM_SERVER_DEV_MODE=1): it stays up;
    loaded is awake, unloaded is asleep at level 1. The gateway never starts or stops it."""

    def __init__(
        self,
        name: str,
        url: str,
        client: HTTPClient,
        on_state: OnState,
        *,
        clock: IReactorTime,
        load_timeout: float = 600.0,
        stop_timeout: float = 30.0,
        poll_interval: float = 0.5,
    ) -> None:
        super().__init__(name, on_state, clock)
        self.root = root(url)
        self.client = client
        self.load_timeout = load_timeout
        self.stop_timeout = stop_timeout
        self.poll_interval = poll_interval
        self._task: Deferred[Any] | None = None
        self._since = 0.0

    def adopt(self) -> None:
        """At the gateway's start: ask whether it is awake (loading until it answers: an awake
        server holds its memory), then loaded or unloaded."""
        if self.state != "unloaded":
            return
        self._since = self.clock.seconds()
        self._set("loading")
        if self.state == "loading":
            self._run(self._is_sleeping(), self._checked)

    def load(self) -> Deferred[None]:
        """Fires once it is awake; fails with `ServerFailed`, or CancelledError if it is
        unloaded first. A load while loading waits for the same wake."""
        if self.state == "loaded":
            return succeed(None)
        d = self._wait(self._loads)
        if self.state in ("unloaded", "failed"):
            self._wake()
        return d  # unloading: woken again once asleep

    def unload(self) -> Deferred[None]:
        """Put it to sleep (a wake in progress is cancelled); fires once it says it sleeps."""
        self._fire(self._loads, CancelledError(f"{self.name} was unloaded"))
        if self.state in ("unloaded", "failed"):
            return succeed(None)
        d = self._wait(self._unloads)
        if self.state != "unloading":
            self._set("unloading")
            if self.state == "unloading":
                self._run(self._until(True, "/sleep?level=1", self.stop_timeout), self._slept)
        return d

    def _checked(self, asleep: object) -> None:
        if asleep is False:
            self._woken(None)
        elif self._loads:
            self._run(self._until(False, "/wake_up", self.load_timeout), self._woken)
        else:
            if isinstance(asleep, Failure):
                log.warn("{upstream}: is it asleep? {e}", upstream=self.name, e=asleep.value)
            self._set("unloaded")

    def _wake(self) -> None:
        self._since = self.clock.seconds()
        self._set("loading")
        if self.state == "loading":
            self._run(self._until(False, "/wake_up", self.load_timeout), self._woken)

    def _woken(self, result: object) -> None:
        if isinstance(result, Failure):
            failure = _as_failed(result)
            log.error("{upstream}: {why}", upstream=self.name, why=failure)
            self._set("failed", failure)
            self._fire(self._loads, failure)
            return
        self.load_seconds = self.clock.seconds() - self._since
        self._set("loaded")
        self._fire(self._loads)

    def _slept(self, result: object) -> None:
        if isinstance(result, Failure):
            failure = _as_failed(result)
            log.error("{upstream}: {why}", upstream=self.name, why=failure)
            self._set("failed", failure)
        else:
            self._set("unloaded")
        self._fire(self._unloads)
        if self._loads and self.state in ("unloaded", "failed"):
            self._wake()

    def _run(self, work: Any, then: Callable[[object], None]) -> None:
        """Run `work`, cancelling the one before, and give `then` its outcome."""
        if self._task is not None:
            task, self._task = self._task, None
            task.cancel()
        task = Deferred.fromCoroutine(work)
        self._task = task

        def done(result: object) -> None:
            if self._task is task:
                self._task = None
                then(result)

        task.addBoth(done)

    async def _until(self, asleep: bool, command: str, timeout: float) -> None:
        """POST `command` until it is taken, then GET /is_sleeping until it says `asleep`."""
        deadline = self.clock.seconds() + timeout
        sent = False
        last = "no answer"
        while True:
            try:
                if not sent:
                    response = await self.client.post(self.root + command)
                    await response.content()
                    sent = response.code == 200
                    last = f"POST {command} answered {response.code}"
                if sent and await self._is_sleeping() is asleep:
                    return
            except CancelledError:
                raise
            except Exception as e:
                last = str(e) or type(e).__name__
            if self.clock.seconds() >= deadline:
                word = "asleep" if asleep else "awake"
                raise ServerFailed(f"not {word} within {timeout:g}s: {last}")
            await deferLater(self.clock, self.poll_interval)

    async def _is_sleeping(self) -> bool:
        response = await self.client.get(self.root + "/is_sleeping")
        body = await response.json()
        return bool(body["is_sleeping"])


def _as_failed(result: Failure) -> ServerFailed:
    if isinstance(result.value, ServerFailed):
        return result.value
    return ServerFailed(str(result.value) or type(result.value).__name__)
