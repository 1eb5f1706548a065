"""Models loaded on demand: each box's managed upstreams started and stopped as
`core.residency.plan` decides, in the line's own order (docs/operations.md, "Models loaded on
demand").

A managed upstream's replica takes grants only while its server is loaded and the plan does
not hold it (`Replica.resident`); its waiters wait in its line as any waiter does. Every change
of who waits or holds a slot on a managed upstream (`PositionedSemaphore.watcher`) and every
change of a server's state plans again, once per reactor turn. A waiting stream hears its
model's state in its queue frames (`waiting_state`), told again at once when it changes.

A managed upstream may share its line with always-loaded replicas (a model with `upstreams`):
it takes that line's waiters as its own, so it is loaded once they wait (the others are full),
and their frames carry no state (their model is loaded, only busy).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from twisted.internet.defer import Deferred, DeferredList
from twisted.internet.interfaces import IDelayedCall, IReactorProcess, IReactorTime
from twisted.logger import Logger

from homelab_gateway.config import BoxConfig, UpstreamConfig
from homelab_gateway.core.errors import GatewayError
from homelab_gateway.core.residency import HOLDING, Model, plan
from homelab_gateway.line.pool import Pool
from homelab_gateway.upstream.readiness import check
from homelab_gateway.upstream.servers import ManagedServer, ServerFailed, SleepingServer

log = Logger()

RUN_FOLDER = "run"
"""Under the working directory: each managed server's state file, for adoption after a crash."""


class Resident:
    """One managed upstream: its pool, its server, and what the plan needs to know of it."""

    def __init__(self, config: UpstreamConfig, pool: Pool, residency: Residency) -> None:
        self.config = config
        self.pool = pool
        self.residency = residency
        self.loaded_at: float | None = None
        self.loading_since: float | None = None
        self.idle_since: float | None = residency.clock.seconds()
        self.failed_starts = 0  # in a row
        self.cool_until: float | None = None
        self.new_start: tuple[str, ...] | None = None  # a reload's, once nothing runs
        # Since the gateway started, for the metrics: loads begun, unloads begun, and the
        # loads that ended loaded with the seconds they took.
        self.loads = self.unloads = self.loaded = 0
        self.load_seconds_total = 0.0
        self.server = self._server(config)
        pool.resident = self
        pool.replica.resident = False

    @property
    def name(self) -> str:
        return self.config.name

    def _server(self, config: UpstreamConfig) -> ManagedServer | SleepingServer:
        residency = self.residency

        def on_state(state: str, failure: ServerFailed | None) -> None:
            residency.state_changed(self, state, failure)

        if config.sleep_mode:
            return SleepingServer(
                config.name,
                config.url,
                residency.http,
                on_state,
                clock=residency.clock,
                load_timeout=config.load_timeout,
                stop_timeout=config.stop_timeout,
            )
        assert config.start is not None

        async def probe() -> str:
            health = await check(self.pool.upstream, self.pool.kind)
            return "ready" if health.ok else "loading"

        return ManagedServer(
            config.name,
            list(config.start),
            config.url,
            probe,
            on_state,
            reactor=residency.reactor,
            state_file=residency.workdir / RUN_FOLDER / f"{config.name}.json",
            stop_argv=list(config.stop) if config.stop is not None else None,
            load_timeout=config.load_timeout,
            stop_timeout=config.stop_timeout,
        )

    @property
    def state(self) -> str:
        """`loaded`, `loading`, `unloading`, `unloaded` or `failed` (while cooling down)."""
        if self.cool_until is not None:
            return "failed"
        state = self.server.state
        return "unloaded" if state == "failed" else state

    @property
    def load_seconds(self) -> float | None:
        return self.server.load_seconds

    def model(self, now: float) -> Model:
        line = self.pool.line
        running = self.pool.replica.held
        waiting = len(line.dispatch)  # its line's waiters, retries included
        if running or waiting:
            self.idle_since = None
        elif self.idle_since is None:
            self.idle_since = now
        return Model(
            self.name,
            self.config.memory or 0.0,
            self.state,
            running=running,
            waiting=waiting,
            head=line.dispatch.first(now),
            loaded_at=self.loaded_at,
            idle_since=self.idle_since,
            idle_unload=self.config.idle_unload,
        )


class Residency:
    """Every managed upstream of the gateway, by box, and the plan applied to them."""

    def __init__(
        self,
        clock: IReactorTime,
        reactor: IReactorProcess,
        http: object,
        workdir: Path,
        boxes: Mapping[str, BoxConfig],
    ) -> None:
        self.clock = clock
        self.reactor = reactor
        self.http = http  # treq-like: what sleep-mode servers are asked through
        self.workdir = workdir
        self.boxes = dict(boxes)
        self.residents: dict[str, Resident] = {}
        self._planned: IDelayedCall | None = None
        self._wake: IDelayedCall | None = None
        self.closing = False

    def sync(
        self,
        managed: Mapping[str, UpstreamConfig],
        pools: Mapping[str, Pool],
        boxes: Mapping[str, BoxConfig],
    ) -> None:
        """Make the managed upstreams those of a (new) config: a new one is taken in hand
        (adopting a server a crash of the gateway left running), a changed `start` takes effect
        when its server next has nothing running, one no longer managed is let go once
        unloaded."""
        self.boxes = dict(boxes)
        for name, config in managed.items():
            r = self.residents.get(name)
            if r is None:
                r = self.residents[name] = Resident(config, pools[name], self)
                r.server.adopt()
            elif config.start != r.config.start:
                r.new_start = config.start
            r.config = config
            pools[name].line.watcher = self.changed  # a reload may have made it a new line
        for name in [n for n in self.residents if n not in managed]:
            r = self.residents.pop(name)
            log.info("{upstream}: no longer loaded on demand", upstream=name)
            r.pool.resident = None
            r.server.unload().addBoth(lambda _, pool=r.pool: self._always_loaded(pool))
        self.changed()

    @staticmethod
    def _always_loaded(pool: Pool) -> None:
        pool.replica.resident = True
        pool.line.refresh()

    def changed(self) -> None:
        """Something changed: plan again, once, in the next reactor turn."""
        if self._planned is None and not self.closing:
            self._planned = self.clock.callLater(0, self._decide)

    def _decide(self) -> None:
        self._planned = None
        now = self.clock.seconds()
        wake: float | None = None
        for box in self.boxes.values():
            residents = [r for r in self.residents.values() if r.config.box == box.name]
            for r in residents:
                if r.cool_until is not None and now >= r.cool_until:
                    r.cool_until = None
                    r.pool.refusal = None
                    log.info("{upstream}: cool-down over, it may be started again", upstream=r.name)
                if r.new_start is not None:
                    self._restart(r)
            decided = plan(box.memory, box.min_resident, [r.model(now) for r in residents], now)
            for name in decided.unload:
                self._unload(self.residents[name], box, now)
            for name in decided.load:
                self._load(self.residents[name])
            for r in residents:
                self._grant_if(r, r.server.state == "loaded" and r.name not in decided.hold)
            if decided.wake is not None:
                wake = decided.wake if wake is None else min(wake, decided.wake)
            for r in residents:
                if r.cool_until is not None:
                    wake = r.cool_until if wake is None else min(wake, r.cool_until)
        if self._wake is not None and self._wake.active():
            self._wake.cancel()
        self._wake = None
        if wake is not None:
            self._wake = self.clock.callLater(max(0.0, wake - now), self.changed)

    def _load(self, r: Resident) -> None:
        log.info("{upstream}: loading (a request waits for it)", upstream=r.name)
        r.loads += 1
        r.server.load().addErrback(lambda _: None)  # told through state_changed

    def _unload(self, r: Resident, box: BoxConfig, now: float) -> None:
        idle = None if r.idle_since is None else now - r.idle_since
        if r.config.idle_unload and idle is not None and idle >= r.config.idle_unload:
            why = f"idle for {idle:.0f}s"
        else:
            why = f"another model on box {box.name} needs its memory"
        log.info("{upstream}: unloading ({why})", upstream=r.name, why=why)
        r.unloads += 1
        r.server.unload().addErrback(lambda _: None)

    def _restart(self, r: Resident) -> None:
        """A reload changed `start`: the server is stopped when it has nothing running, and the
        next load starts the new command."""
        server = r.server
        assert isinstance(server, ManagedServer) and r.new_start is not None
        if server.state in ("unloaded", "failed"):
            server.argv = list(r.new_start)
            r.new_start = None
        elif server.state == "loaded" and not r.pool.replica.held:
            log.info(
                "{upstream}: stopping, for its new start command (the next request starts it)",
                upstream=r.name,
            )
            self._grant_if(r, False)
            server.unload().addErrback(lambda _: None)

    @staticmethod
    def _grant_if(r: Resident, resident: bool) -> None:
        """Let the line grant on `r`'s replica or not; granting to its waiters at once."""
        replica = r.pool.replica
        if replica.resident == resident:
            return
        replica.resident = resident
        r.pool.line.refresh()

    def state_changed(self, r: Resident, state: str, failure: ServerFailed | None) -> None:
        now = self.clock.seconds()
        if state == "loading":
            r.loading_since = now
        elif state == "loaded":
            r.loaded_at = now
            r.failed_starts = 0
            seconds = r.server.load_seconds
            r.loaded += 1
            r.load_seconds_total += seconds or 0.0
            log.info(
                "{upstream}: loaded{took}",
                upstream=r.name,
                took=f" in {seconds:.1f}s" if seconds is not None else "",
            )
        elif state == "unloaded":
            r.loaded_at = None
            log.info("{upstream}: unloaded", upstream=r.name)
        elif state == "failed":
            started = r.loaded_at is None  # it failed to start, rather than exited once loaded
            r.loaded_at = None
            self._failed(r, failure, now, started)
        if state != "loaded":
            self._grant_if(r, False)
        r.pool.line.retell()  # the waiters' frames say the state
        self.changed()

    def _failed(self, r: Resident, failure: ServerFailed | None, now: float, started: bool) -> None:
        """A start that failed is tried again at once; the second in a row fails its waiters
        and refuses new requests for the upstream's `cooldown` (its line's waiters fail only
        if no other replica of their model is there to serve them). A server that exits once
        loaded is started again by the next request for it. (The server's own log line says
        why, with its last lines.)"""
        if not started:
            return
        r.failed_starts += 1
        if r.failed_starts < 2:
            return
        r.failed_starts = 0
        r.cool_until = now + r.config.cooldown
        log.error(
            "{upstream}: failed to start twice: its requests are refused for {cooldown:g}s",
            upstream=r.name,
            cooldown=r.config.cooldown,
        )
        short = failure.reason if failure is not None else "failed"
        error = GatewayError(
            503,
            f"upstream {r.name} failed to start twice: {short}; tried again in "
            f"{r.config.cooldown:g}s",
            retry_after=round(r.config.cooldown),
            outcome="upstream_error",
        )
        r.pool.refusal = error
        line = r.pool.line
        if all(getattr(m.owner, "refusal", None) is not None for m in line.members):
            line.source.fail_waiting(error)  # else another replica of the model serves them

    def close(self) -> Deferred[object]:
        """Stop every server the gateway started (the daemon's stop, after its drain)."""
        self.closing = True
        for call in (self._planned, self._wake):
            if call is not None and call.active():
                call.cancel()
        return DeferredList([r.server.unload() for r in self.residents.values()])


def waiting_state(pools: Sequence[Pool]) -> str | None:
    """What a request waiting for `pools` hears of its model: None where one of them is always
    loaded or is loaded; "loading" while one loads; else "unloaded"."""
    states = []
    for pool in pools:
        resident = pool.resident
        if resident is None:
            return None
        states.append(resident.state)
    if "loaded" in states:
        return None
    return "loading" if "loading" in states else "unloaded"


def load_wait(pools: Sequence[Pool], now: float) -> float | None:
    """The seconds until the model can be served, as its upstreams' last loads took (the
    quickest; less the time it has been loading); None before any load was seen."""
    waits = []
    for pool in pools:
        resident = pool.resident
        if not isinstance(resident, Resident) or resident.load_seconds is None:
            continue
        since = resident.loading_since
        loading = now - since if resident.state == "loading" and since is not None else 0.0
        waits.append(max(0.0, resident.load_seconds - loading))
    return min(waits) if waits else None


def boxes_status(pools: Mapping[str, Pool]) -> dict[str, dict[str, object]]:
    """Each box's memory, what its models hold (loaded, loading or unloading) and which are
    loaded, for `/llm/v1/status`; {} without managed upstreams."""
    residents = [p.resident for p in pools.values() if isinstance(p.resident, Resident)]
    if not residents:
        return {}
    boxes: dict[str, dict[str, object]] = {}
    for name, box in sorted(residents[0].residency.boxes.items()):
        on_box = [r for r in residents if r.config.box == name]
        boxes[name] = {
            "memory": box.memory,
            "used": sum(r.config.memory or 0.0 for r in on_box if r.server.state in HOLDING),
            "loaded": sorted(r.name for r in on_box if r.server.state == "loaded"),
        }
    return boxes
