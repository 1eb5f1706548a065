"""This gateway's link to the Redis that several gateways share their slots and lines through.

`[cluster]` in the config turns it on; without it nothing here runs and every line lives in the
process (`limiter.PositionedSemaphore`). With it, every line's source is a `shared.RedisSource`:
the line is a copy that changes only by replaying the events the Lua scripts in `scripts`
append to one Redis stream, in that stream's order, so every gateway's copy agrees.

What this module does: keep two connections (one for the scripts and the lease, one blocked
reading the stream), renew this gateway's lease (`lease` seconds; a gateway that stops renewing
is swept: its waiters leave, its slots are released), sweep for the others, and when Redis
cannot be reached, tell the lines (`lost`), then reconnect with back-off and rebuild them from
a snapshot (`rebuild`). Nothing blocks the reactor: txredisapi is Twisted-native.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping, Sequence
from contextlib import suppress
from typing import Any, Protocol

import orjson
import txredisapi
from twisted.internet.defer import CancelledError, Deferred, ensureDeferred, fail
from twisted.internet.defer import TimeoutError as DeferredTimeout
from twisted.internet.error import ConnectError
from twisted.internet.interfaces import IDelayedCall
from twisted.internet.ssl import optionsForClientTLS
from twisted.internet.task import LoopingCall, deferLater
from twisted.logger import Logger

from homelab_gateway.config import ClusterConfig
from homelab_gateway.core.liveness import Liveness
from homelab_gateway.line.refusals import Unavailable
from homelab_gateway.line.scripts import SHAS, SOURCES
from homelab_gateway.line.sentinel import Primary

log = Logger()
STREAM_LENGTH = 100_000
"""Events kept in the stream (about; Redis trims in whole nodes). A gateway that falls further
behind than this sees a gap in the numbers and rebuilds from a snapshot."""
READ_BLOCK_MS = 1000  # a blocked read returns at least this often, so a dead link shows
WATCH_STEP = 0.25  # seconds between the watchdog's turns (`core.liveness`)
READ_BATCH = 1000
BACKOFF = (0.2, 5.0)  # first and longest wait between attempts to reach Redis
WARN_EVERY = 60.0  # while Redis stays out of reach, a warning at most this often
SETTLE = BACKOFF[1] + 2.0
"""After Redis lost its data, no slot is granted for at least this long: every gateway that was
linked reconnects within its longest back-off (plus one attempt: `Cluster.settle`), rebuilds
and counts its running requests again first."""


LINK_FAILURES = (txredisapi.RedisError, ValueError, OSError, ConnectError, TimeoutError)
"""What a lost or refused link to Redis raises (txredisapi says "could not connect" with a
ValueError); anything else is a bug, logged with its traceback."""


class LineCopy(Protocol):
    """What the cluster asks of each line it links: one gateway's copy of a shared line
    (`shared.RedisSource`), named by its upstreams (`key`)."""

    key: str
    member_names: list[str]
    since: int  # the number of the last event its copy was rebuilt with

    def runs(self, w: str) -> bool: ...
    def refresh(self) -> None: ...
    def apply(self, event: Mapping[str, Any]) -> None: ...
    def applied(self) -> None: ...
    def lost(self) -> None: ...
    def outage_over(self, reason: Exception) -> None: ...
    def rebuild(
        self, now: float, waiting: Mapping[str, str], slots: Mapping[str, Mapping[str, str]]
    ) -> None: ...


class SharedClock:
    """The reactor's clock, set to Redis's: events are stamped by Redis, and the line compares
    those stamps with `seconds()` (ageing, hold times, estimates)."""

    def __init__(self, reactor: Any) -> None:
        self.reactor = reactor
        self.offset = 0.0

    def seconds(self) -> float:
        return self.reactor.seconds() + self.offset

    def callLater(self, delay: float, f: Any, *args: Any, **kwargs: Any) -> IDelayedCall:
        return self.reactor.callLater(delay, f, *args, **kwargs)

    def getDelayedCalls(self) -> Any:
        return self.reactor.getDelayedCalls()


class Watched:
    """A txredisapi connection whose every command is counted by a `Liveness`."""

    def __init__(self, connection: Any, liveness: Liveness) -> None:
        self.connection = connection
        self.liveness = liveness

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.connection, name)
        if name == "disconnect":
            return method

        def counted(*args: Any, **kwargs: Any) -> Deferred[Any]:
            self.liveness.asked()
            d: Deferred[Any] = method(*args, **kwargs)
            return d.addBoth(self._answered)

        return counted

    def _answered(self, result: Any) -> Any:
        self.liveness.answered()
        return result


class Cluster:
    """One gateway's membership of a cluster: its instance id, its connections, its lines."""

    def __init__(self, config: ClusterConfig, reactor: Any) -> None:
        self.config = config
        self.reactor = reactor
        # Unique per process: a gateway restarted under the same name is a new member, so the
        # leftovers of its previous life are swept, not mistaken for its own.
        self.instance = f"{config.instance}/{secrets.token_hex(4)}"
        self.lines: dict[str, LineCopy] = {}
        # New lines whose snapshot is on its way, and the events read for them meanwhile:
        # those the snapshot does not count yet are applied after it.
        self._awaiting: dict[LineCopy, list[dict[str, Any]]] = {}
        self._calls: dict[LineCopy, tuple[list[str], list[Any]]] = {}  # script keys, args
        self.live = False
        self.lost_at: float | None = None  # not linked since (None: linked, or not started)
        self._warned_at: float | None = None  # the last warning that the link is down
        self.last_error: str | None = None
        self._n = 0
        self._running = False
        self._commands: Any = None
        self._reader: Any = None
        self._watchdog: LoopingCall | None = None
        self._grace: IDelayedCall | None = None  # ends the outage's grace
        self._sweeps_from = 0.0  # no sweeps before this time (`_tick`)
        # Where Redis is: the config's, or the primary the Sentinels name (`sentinel`).
        self.address = (config.host, config.port)
        self._primary = Primary(config, reactor, self._switched) if config.sentinels else None
        self._failed_over = False  # linked to another primary than before: count again
        self._switch: tuple[tuple[str, int], float] | None = None  # the last told, and when
        self._connecting: Deferred[None] | None = None  # the attempt under way (`_connect`)
        # How long one attempt to reach Redis may take: the connection, and the Sentinels'
        # answer (their watch is subscribed once, long before a failover).
        self._attempt = min(5.0, config.lease / 2) + (config.lease if config.sentinels else 0.0)
        self._seq = 0
        self._last_id = "0-0"
        self._epoch: str | None = None
        self._renewal: LoopingCall | None = None
        self._run: Deferred[None] | None = None
        self._pause: Deferred[None] | None = None  # between attempts to reach Redis
        # Releases that could not be sent: sent when Redis is back, before anything else.
        self.unsent: dict[tuple[str, str], tuple[str, ...]] = {}

    @property
    def in_grace(self) -> bool:
        """Whether the link is lost since less than `outage_grace`: waiters wait it out."""
        return self._grace is not None

    @property
    def settle(self) -> float:
        """Seconds without grants after Redis lost data, and without sweeps after a (re)join:
        the longest back-off and one attempt, in which every gateway is back."""
        return SETTLE + self._attempt

    def key(self, *parts: str) -> str:
        return self.config.prefix + ":".join(parts)

    @property
    def lease_key(self) -> str:
        return self.key("lease", self.instance)

    def new_id(self) -> str:
        self._n += 1
        return f"{self.instance}/{self._n}"

    def running(self, w: str) -> bool:
        """Whether a request of this gateway runs on slot `w`, in any of its lines (a reload
        may have moved the slot's upstream to a new line, whose copy then learns it)."""
        return any(line.runs(w) for line in self._calls)  # a retired line's too

    def start(self) -> None:
        self._running = True
        self.lost_at = self.reactor.seconds()  # down until linked: a status says since when
        self._run = ensureDeferred(self._keep_connected())

    async def stop(self) -> None:
        """A clean stop: the lease goes at once and whatever this gateway still holds or
        awaits is swept now, so the others do not wait `lease` seconds for it (its own
        alone: a lease that ran out in a pause of Redis is renewed within its back-off)."""
        self._running = False
        _halt(self._renewal)
        if self._pause is not None:
            self._pause.cancel()
        if self._connecting is not None:  # the Sentinels, a connection: linked to nothing
            self._connecting.cancel()
        if self._watchdog is not None and self._watchdog.running:  # linked, or rejoining
            try:
                await self._commands.delete(self.lease_key)
                for line in list(self.lines.values()):
                    await self.line_call(line, "sweep", self.instance)
            except LINK_FAILURES as e:  # stopping anyway; the lease expires
                log.warn("could not give back this gateway's share at stop: {e}", e=e)
        self.live = False  # a stop, not a loss: nothing to tell the lines or the log
        self._end_grace()
        await self._disconnect()
        if self._run is not None:
            await self._run
        if self._primary is not None:
            await self._primary.close()

    async def _keep_connected(self) -> None:
        delay = BACKOFF[0]
        while self._running:
            try:
                self._connecting = Deferred.fromCoroutine(self._connect())
                try:
                    await self._connecting
                finally:
                    self._connecting = None
                await self._rejoin()
                delay = BACKOFF[0]
                await self._follow()
            except CancelledError:  # the attempt given up: a stop, or a failover (`_switched`)
                delay = BACKOFF[0]
            except LINK_FAILURES as e:
                if self._running:
                    self.last_error = str(e) or type(e).__name__
            except Exception as e:  # a bug must not end the gateway's link for good
                self.last_error = str(e) or type(e).__name__
                log.failure("the shared line's replay failed; rebuilding it")
            if not self._running:  # a stop, which gives back this gateway's share itself
                _halt(self._renewal)  # started by a rejoin the stop overtook
                self.live = False
                return
            self._set_lost()
            self._still_down()
            await self._disconnect()
            self._pause = deferLater(self.reactor, delay, lambda: None)
            with suppress(CancelledError):  # a stop during the pause
                await self._pause
            self._pause = None
            delay = min(delay * 2, BACKOFF[1])

    async def _connect(self) -> None:
        config = self.config
        if self._primary is not None:  # asked again before every connection
            await self._primary.watch()
            address = self._told() or await self._primary.find()
            if address != self.address and self.address[1]:
                self._failed_over = True
            self.address = address
        host, port = self.address
        options: dict[str, Any] = {
            "dbid": config.db,
            "reconnect": False,
            "password": config.password,
            "username": config.username,
            "convertNumbers": False,
            "connectTimeout": min(5.0, config.lease / 2),
            "ssl_context_factory": optionsForClientTLS(host) if config.tls else False,
        }
        # No reply timeout of txredisapi's own: a timer would judge the link by this reactor's
        # lag as much as by Redis; the watchdog judges it by Redis's answers (`Liveness`).
        commands = Liveness(config.lease / 2, WATCH_STEP)
        reader = Liveness(READ_BLOCK_MS / 1000 + config.lease / 2, WATCH_STEP)
        self._commands = Watched(await self._open(host, port, options), commands)
        self._reader = Watched(await self._open(host, port, options), reader)
        self._watchdog = LoopingCall(self._watch, commands, reader)
        self._watchdog.clock = self.reactor
        self._watchdog.start(WATCH_STEP)
        if self._primary is not None:
            role = await self._commands.execute_command("ROLE")
            if role[0] != "master":  # a Sentinel's answer from before a failover
                raise txredisapi.ConnectionError(f"{self._where()} is a {role[0]} now")

    async def _open(self, host: str, port: int, options: dict[str, Any]) -> Any:
        """One connection, ready (its AUTH and SELECT answered) within one attempt's time: a
        Redis that takes the connection and never answers is an attempt that failed."""
        connection = txredisapi.lazyConnection(host, port, **options)
        timeout = self._attempt + self.config.lease / 2
        try:  # `_connected`: the factory's Deferred of its first connection (txredisapi 1.6)
            await connection._connected.addTimeout(timeout, self.reactor)
        except BaseException as e:
            with suppress(Exception):
                await connection.disconnect()
            if isinstance(e, DeferredTimeout):
                raise TimeoutError(f"{host}:{port} did not answer in {timeout:g}s") from None
            raise
        return connection

    def _switched(self, told: tuple[str, int]) -> None:
        """A Sentinel promoted another primary: connect there. The link to another is dropped,
        a connection under way given up, a pause between two attempts cut short; once linked
        there, the other Sentinels' word (each tells the switch) changes nothing."""
        self._switch = (told, self.reactor.seconds())
        if told == self.address:
            return
        reason = "Sentinel switched the primary to {}:{}".format(*told)
        if self._pause is not None:  # between two attempts: the next is now
            self.last_error = reason
            self._pause.cancel()
            return
        if self._connecting is None:
            self.drop(reason)
            return
        log.info(
            "{reason} while connecting to {where}: connecting there instead",
            reason=reason,
            where=self._where(),
        )
        self.last_error = reason
        self._connecting.cancel()

    def _told(self) -> tuple[str, int] | None:
        """The primary the last `+switch-master` named, for a lease after it was told: a
        Sentinel yet to hear of the failover names the old one, which, awake again, calls
        itself primary until Sentinel turns it into a replica."""
        if self._switch is None:
            return None
        address, at = self._switch
        return address if self.reactor.seconds() - at < self.config.lease else None

    def _watch(self, *links: Liveness) -> None:
        """A turn of the watchdog: a connection whose command Redis left unanswered for its
        timeout is dropped, and the link with it (its commands fail, the reader's loop ends)."""
        now = self.reactor.seconds()
        if any([liveness.tick(now) for liveness in links]):
            self.drop(f"Redis did not answer for {self.config.lease / 2:g}s")

    def drop(self, reason: str) -> None:
        """Close the link (the reader's loop ends, and with it the link: `lost`), to connect
        and rebuild afresh: Redis is silent, or a reply was lost and a copy cannot know what
        ran."""
        _halt(self._watchdog)
        if self._reader is None:
            return
        self.last_error = reason
        for connection in (self._reader, self._commands):
            if connection is not None:
                connection.disconnect()

    async def _disconnect(self) -> None:
        _halt(self._watchdog)
        self._watchdog = None
        for connection in (self._reader, self._commands):
            if connection is not None:
                with suppress(Exception):  # already gone
                    await connection.disconnect()
        self._reader = self._commands = None

    async def _rejoin(self) -> None:
        """Take the lease, send what could not be sent, rebuild every line, renew."""
        await self._renew()
        await self._send_unsent()
        await self.rebuild()
        self.live = True
        self._end_grace()
        await self._send_unsent()  # slots given back while rebuilding
        if self.lost_at is not None and self._warned_at is not None:
            log.info(
                "the shared line at {url} is back after {seconds:.1f}s: its waiters are in "
                "their places again",
                url=self._where(),
                seconds=self.reactor.seconds() - self.lost_at,
            )
        self.lost_at = self._warned_at = None
        self._sweeps_from = self.reactor.seconds() + self.settle
        self._renewal = LoopingCall(self._tick)
        self._renewal.clock = self.reactor
        self._renewal.start(self.config.lease / 3, now=False).addErrback(self._renewal_failed)

    async def _send_unsent(self) -> None:
        """The releases that could not be sent while the link was down."""
        for (line_key, slot), args in list(self.unsent.items()):
            line = self.lines.get(line_key)
            if line is not None:
                await self.line_call(line, "release", slot, *args)
            del self.unsent[(line_key, slot)]

    def _where(self) -> str:
        host, port = self.address
        if self._primary is not None and not port:
            return f"redis {self.config.sentinel_master} (through Sentinel)"
        return f"redis {host}:{port}/{self.config.db}"

    async def _renew(self) -> None:
        await self._commands.set(
            self.lease_key, self.instance, pexpire=int(self.config.lease * 1000)
        )

    async def _tick(self) -> None:
        """Every third of a lease: renew it, sweep the silent, and let each line claim what
        its copy shows free (a claim lost to a race is retried here at the latest). Nobody is
        swept for `settle` seconds after this gateway (re)joins, nor after a renewal that took
        a quarter of a lease: Redis was away (paused) long enough for others' leases to run out
        meanwhile (2/3 of a lease; this renewal then waited a third at least), and every
        gateway renews its own within its back-off."""
        asked = self.reactor.seconds()
        await self._renew()
        now = self.reactor.seconds()
        if now - asked > self.config.lease / 4:
            self._sweeps_from = now + self.settle  # never earlier than a rejoin's
        sweep = now >= self._sweeps_from
        for line in list(self.lines.values()):
            if sweep:
                await self.line_call(line, "sweep")
            line.refresh()

    def _renewal_failed(self, failure: Any) -> None:
        """The lease could not be renewed: the link is down; the reader's end makes it so."""
        self.last_error = failure.getErrorMessage()
        if self._reader is not None:
            self._reader.disconnect()

    def _set_lost(self) -> None:
        _halt(self._renewal)
        self._renewal = None
        if not self.live:
            return
        self.live = False
        self.lost_at = self.reactor.seconds()
        grace = self.config.outage_grace
        self._grace = self.reactor.callLater(grace, self._grace_over)
        log.warn(
            "lost the shared line at {where} ({error}): nothing is granted until it is back; "
            "waiters keep their place for {grace:g}s, then get 529",
            where=self._where(),
            error=self.last_error,
            grace=grace,
        )
        self._warned_at = self.lost_at
        for line in list(self.lines.values()):
            line.lost()

    def _still_down(self) -> None:
        """An attempt to reach Redis failed: say so at the first (a cluster that never comes
        up is not silent) and at most once every `WARN_EVERY` seconds while it lasts."""
        now = self.reactor.seconds()
        if self._warned_at is not None and now - self._warned_at < WARN_EVERY:
            return
        down = now - (self.lost_at if self.lost_at is not None else now)
        if self._warned_at is None:
            log.warn(
                "cannot reach the shared line at {where} ({error}): {meanwhile} until it is "
                "up; trying again",
                where=self._where(),
                error=self.last_error,
                meanwhile="this gateway grants its fallback_share of the slots"
                if self.config.fallback_share
                else "its requests are refused as overloaded",
            )
        else:
            log.warn(
                "the shared line at {where} is still out of reach after {seconds:.0f}s ({error})",
                where=self._where(),
                seconds=down,
                error=self.last_error,
            )
        self._warned_at = now

    def _grace_over(self) -> None:
        self._grace = None
        grace = self.config.outage_grace
        log.warn(
            "the shared line at {where} has been out of reach for {grace:g}s ({error}): its "
            "waiters and new requests get 529 until it is back",
            where=self._where(),
            grace=grace,
            error=self.last_error,
        )
        reason = Unavailable(f"the shared line was out of reach for {grace:g}s")
        for line in list(self.lines.values()):
            line.outage_over(reason)

    def _end_grace(self) -> None:
        if self._grace is not None and self._grace.active():
            self._grace.cancel()
        self._grace = None

    async def _check_epoch(self) -> None:
        """Whether Redis lost its data since this gateway last saw it: then no slot is granted
        for `settle` seconds, while every gateway reconnects (within its back-off) and counts
        its running requests again, so a slot in use is never handed out as free."""
        epoch_key = self.key("epoch")
        await self._commands.set(epoch_key, secrets.token_hex(8), only_if_not_exists=True)
        epoch = await self._commands.get(epoch_key)
        lost_data = self._epoch is not None and epoch != self._epoch
        if self._failed_over:
            log.warn(
                "the shared line's Redis failed over to {where}, which may lack the last "
                "writes: counting running requests again",
                where=self._where(),
            )
        elif lost_data:
            log.warn("the shared line's Redis lost its data: counting running requests again")
        if self._failed_over or lost_data:
            await self._commands.set(self.key("settling"), "1", pexpire=int(self.settle * 1000))
        self._failed_over = False
        self._epoch = epoch

    def add(self, line: LineCopy) -> None:
        """A new line (start, or a reload that grouped upstreams anew): while linked, its copy
        is read from Redis at once, and events it already has are skipped (`since`)."""
        self.lines[line.key] = line
        waiting, slots = self._line_keys(line)
        self._calls[line] = (
            [self.key("events"), self.key("seq"), waiting, self.key("settling"), *slots],
            [
                STREAM_LENGTH,
                line.key,
                orjson.dumps(line.member_names).decode(),
                self.key("lease", ""),
            ],
        )
        if self.live:
            self._awaiting[line] = []
            ensureDeferred(self.rebuild([line])).addErrback(self._not_rebuilt)
        else:  # nothing is granted from it until Redis is back, as from the others
            line.lost()

    def _line_keys(self, line: LineCopy) -> tuple[str, list[str]]:
        """The keys of `line`'s waiters and of its upstreams' slots (see `scripts`)."""
        waiting = self.key("line", line.key, "waiting")
        return waiting, [self.key("upstream", name, "slots") for name in line.member_names]

    def _not_rebuilt(self, failure: Any) -> None:
        """The link failed while reading a new line: the reconnection rebuilds every line."""
        self.last_error = failure.getErrorMessage()

    async def rebuild(self, lines: Sequence[LineCopy] | None = None) -> None:
        """Read the lines' waiters and slots (every line's by default) and the last event's
        number in one step, and rebuild each copy from them; the stream is then followed from
        that event."""
        if lines is None:
            await self._check_epoch()
            every = list(self.lines.values())
        else:
            every = list(lines)
        keys = [self.key("events"), self.key("seq")]
        for line in every:
            waiting, slots = self._line_keys(line)
            keys += [waiting, *slots]
        reply = await self._eval("snapshot", keys, [])
        seq, last_id, now = int(reply[0]), reply[1], float(reply[2])
        if lines is None:
            self._seq, self._last_id = seq, last_id
        hashes = iter(reply[3:])
        for line in every:
            waiting = _pairs(next(hashes))
            slots = {name: _pairs(next(hashes)) for name in line.member_names}
            line.since = seq
            line.rebuild(now, waiting, slots)
            later = [e for e in self._awaiting.pop(line, ()) if int(e["n"]) > seq]
            for event in later:
                line.apply(event)
            if later:
                line.applied()

    async def _follow(self) -> None:
        """Replay the stream into the lines, in its order, until the link fails."""
        while self._running:
            reply = await self._reader.execute_command(
                "XREAD",
                "COUNT",
                READ_BATCH,
                "BLOCK",
                READ_BLOCK_MS,
                "STREAMS",
                self.key("events"),
                self._last_id,
            )
            if not reply:
                continue
            touched: dict[LineCopy, None] = {}
            for entry_id, fields in reply[0][1]:
                event = orjson.loads(fields[1])
                n = int(event["n"])
                if n <= self._seq:  # read before a rebuild that already counted it
                    continue
                if n != self._seq + 1:
                    log.info("gap in the shared line's events: rebuilding from Redis")
                    await self.rebuild()
                    break
                self._seq, self._last_id = n, entry_id
                line = self.lines.get(event["l"])
                if line in self._awaiting:
                    self._awaiting[line].append(event)  # type: ignore[index]
                elif line is not None and n > line.since:
                    line.apply(event)
                    touched[line] = None
            for line in touched:
                line.applied()

    async def _eval(self, name: str, keys: Sequence[str], args: Sequence[Any]) -> Any:
        try:
            return await self._commands.evalsha(SHAS[name], keys, args)
        except txredisapi.ScriptDoesNotExist:
            return await self._commands.eval(SOURCES[name], keys, args)

    def line_call(self, line: LineCopy, script: str, *args: Any) -> Deferred[Any]:
        """Run one of the line scripts for `line`; fails with Unavailable while not linked."""
        if line not in self._calls:
            return fail(Unavailable(f"the shared line {line.key} was retired"))
        keys, head = self._calls[line]
        return self.script(script, keys, [*head, *args])

    def script(self, name: str, keys: Sequence[str], args: Sequence[Any]) -> Deferred[Any]:
        """Run script `name` (`scripts`); fails with Unavailable while not linked."""
        if self._commands is None:
            return fail(Unavailable(f"the shared line at {self._where()} is unreachable"))
        return ensureDeferred(self._eval(name, keys, args))

    def remove(self, line: LineCopy) -> None:
        """`line` is retired (a reload regrouped its upstreams) and nothing runs or waits
        through it any more: it is neither swept nor replayed from now on."""
        if self.lines.get(line.key) is line:
            del self.lines[line.key]
        self._calls.pop(line, None)
        self._awaiting.pop(line, None)


def _halt(loop: LoopingCall | None) -> None:
    if loop is not None and loop.running:
        loop.stop()


def _pairs(flat: Sequence[str]) -> dict[str, str]:
    return dict(zip(flat[::2], flat[1::2], strict=True))
