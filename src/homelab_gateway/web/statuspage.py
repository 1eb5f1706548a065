"""The live status page: its files, and the server-sent events that feed it (Twisted layer).

`GET /status` is one static page shipped in the package (`static/`: HTML, a script and a style
sheet, no build step and nothing from the internet). The page reads `GET /status/events`, a
`text/event-stream` of `event: snapshot` frames, each a whole `snapshot.build` document.

Pushed, not polled, and free while nobody watches: a request starting or finishing marks the
snapshot stale (`changed`), and one timer sends a fresh one to every subscriber at most every
`min_interval` (coalesced: a burst of a thousand requests is one frame). While something is in
flight or waiting, the numbers move by themselves (tokens, waits), so a frame follows every
`live_interval`; when all is idle only a `heartbeat` frame every `heartbeat` seconds keeps the
connection and the page's uptime alive. With no subscriber there is no timer, and `changed` is
one attribute test.

A subscriber that stops reading (its socket buffer full) is skipped, not queued for: its last
missed frame is sent when it reads again, so a stalled tab costs one frame of memory. One that
stays so for `stall_timeout` (`[server] write_stall_timeout`) is cut off, as a stalled `/llm`
stream is (`upstream.Backpressure`), and at most `max_subscribers`
(`[server] max_status_subscribers`) are open at once: one more is answered 503 at once, so
watchers can take neither every file descriptor nor the reactor's time. 0 turns the stream off.

The charts' history does not ride on every frame. The gateway samples its slots, waiters and
tokens every `[server] status_sample_interval` whether or not anyone watches (`core.history`);
a stream's first snapshot carries the whole ring (`history`, ~14 KB), then each new sample
comes alone as an `event: sample` (<100 bytes). A stream that misses a sample while its reader
is stalled gets a snapshot with the whole ring again instead, so its chart has no hole. The
tokens per client per day come as an `event: usage`, read from the ledger on its own thread
when a stream opens and once a minute while any is open.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from importlib import metadata, resources
from typing import Any

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IDelayedCall, IPushProducer, IReactorTime
from twisted.internet.task import LoopingCall
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.iweb import IRequest
from zope.interface import implementer

from homelab_gateway.core import history, snapshot
from homelab_gateway.core.errors import GatewayError
from homelab_gateway.core.sse import encode_event
from homelab_gateway.line.pool import Pool
from homelab_gateway.telemetry import Telemetry
from homelab_gateway.web.respond import send_error

log = Logger()
MIN_INTERVAL = 0.3  # at most ~3 frames a second
LIVE_INTERVAL = 1.0
HEARTBEAT = 15.0
MAX_SUBSCRIBERS = 64  # [server] max_status_subscribers' default
STALL_TIMEOUT = 120.0  # [server] write_stall_timeout's default
FULL_RETRY_AFTER = 15  # seconds: the page's longest wait between tries; a place frees as one leaves
USAGE_INTERVAL = 60.0  # the per-day chart moves slowly: the ledger is read once a minute at most
SNAPSHOT, SAMPLE, USAGE = "snapshot", "sample", "usage"  # the stream's events
TokensByHour = Callable[[int], Coroutine[Any, Any, list[tuple[str, int, int, int]]]]
# What the page's files may do: its own script and style, reading its own event stream; no
# inline script, no frame, no form posted anywhere.
CONTENT_SECURITY_POLICY = (
    b"default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
    b"img-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
PAGE = "status.html"  # served at /status
PAGE_FILES = {"status.js", "status.css"}  # served at /status/NAME, beside it
CONTENT_TYPES = {
    "html": b"text/html; charset=utf-8",
    "js": b"text/javascript; charset=utf-8",
    "css": b"text/css; charset=utf-8",
}


def _version() -> str:
    try:
        return metadata.version("homelab-gateway")
    except metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown"


VERSION = _version()


def send_asset(request: IRequest, name: str) -> bytes:
    """Answer with one of the page's files, read from the installed package. They hold no
    data, so they need no key: the event stream does."""
    body = resources.files("homelab_gateway.web").joinpath("static", name).read_bytes()
    request.setHeader(b"content-type", CONTENT_TYPES[name.rpartition(".")[2]])
    request.setHeader(b"cache-control", b"no-cache")
    request.setHeader(b"content-security-policy", CONTENT_SECURITY_POLICY)
    request.setHeader(b"x-content-type-options", b"nosniff")
    request.setHeader(b"referrer-policy", b"no-referrer")
    return body


@implementer(IPushProducer)
@dataclass(eq=False)
class _Subscriber:
    """One open event stream: the producer behind its response, so a full socket buffer
    pauses it (frames are skipped, the newest of each event kept) instead of growing the
    gateway's memory. Paused for `stall_timeout`, it is cut off; the connection going away
    ends it too."""

    request: IRequest
    page: StatusPage
    stall_timeout: float
    paused: bool = False
    missed: dict[str, bytes] = field(default_factory=dict)  # by event
    stall: IDelayedCall | None = None

    def send(self, event: str, frame: bytes) -> None:
        if self.paused:
            self.missed[event] = frame
        else:
            self.request.write(frame)

    def pauseProducing(self) -> None:
        self.paused = True
        if self.stall is None:
            self.stall = self.page.clock.callLater(self.stall_timeout, self._stalled)

    def resumeProducing(self) -> None:
        self.cancel_stall()
        self.paused = False
        missed, self.missed = self.missed, {}
        if missed.pop(SAMPLE, None) is not None:  # a hole in its chart: the whole ring instead
            missed[SNAPSHOT] = self.page._frame(with_history=True)[0]
        for frame in missed.values():
            self.request.write(frame)

    def stopProducing(self) -> None:
        """The connection is gone (twisted.web stops the producer as it loses it)."""
        self.paused = True
        self.page._unsubscribe(self)

    def _stalled(self) -> None:
        self.stall = None
        self.page._unsubscribe(self)  # its place is free now, not once the abort lands
        channel = getattr(self.request, "channel", None)
        if channel is not None:
            channel.transport.abortConnection()

    def cancel_stall(self) -> None:
        if self.stall is not None and self.stall.active():
            self.stall.cancel()
        self.stall = None


class StatusPage:
    """The snapshot's inputs, read from the live objects, the charts' samples (`start` begins
    them, `stop` ends them), and the subscribers they go to. `tokens_by_hour` reads the
    ledger (`Ledger.tokens_by_hour`); without it there is no per-day chart."""

    def __init__(
        self,
        clock: IReactorTime,
        telemetry: Telemetry,
        pools: Mapping[str, Pool],
        document: Callable[[], dict[str, Any]],
        *,
        tokens_by_hour: TokensByHour | None = None,
        min_interval: float = MIN_INTERVAL,
        live_interval: float = LIVE_INTERVAL,
        heartbeat: float = HEARTBEAT,
        max_subscribers: int = MAX_SUBSCRIBERS,
        stall_timeout: float = STALL_TIMEOUT,
        sample_interval: float = history.INTERVAL,
    ) -> None:
        self.clock = clock
        self.telemetry = telemetry
        self.pools = pools
        self.document = document
        self.tokens_by_hour = tokens_by_hour
        self.min_interval = min_interval
        self.live_interval = live_interval
        self.heartbeat = heartbeat
        # Both may change on a reload: the cap applies to the next subscriber (those open stay,
        # even above a lower cap), the stall timeout to streams opened after it.
        self.max_subscribers = max_subscribers
        self.stall_timeout = stall_timeout
        self.started = clock.seconds()
        self.subscribers: set[_Subscriber] = set()
        self._timer: IDelayedCall | None = None
        self._last_sent = 0.0
        telemetry.on_change = self.changed
        self.history = history.History()
        self.sample_interval = sample_interval
        self._sampling = LoopingCall(self.sample)
        self._sampling.clock = clock
        self.usage_frame: bytes | None = None  # the last per-day chart read, for a new stream
        self._usage_timer: IDelayedCall | None = None
        self._reading = False

    def start(self) -> None:
        """Sample from now on, every `sample_interval`."""
        self._sampling.start(self.sample_interval, now=True)

    def stop(self) -> None:
        if self._sampling.running:
            self._sampling.stop()

    def set_sample_interval(self, interval: float) -> None:
        """A reload: the next sample `interval` from now, those taken kept."""
        if interval == self.sample_interval:
            return
        self.sample_interval = interval
        if self._sampling.running:
            self._sampling.stop()
            self._sampling.start(interval, now=False)

    def sample(self) -> None:
        """Take one sample, and send it to every subscriber."""
        pools = list(self.pools.values())
        input_tokens, output_tokens = self.telemetry.token_totals()
        sample = self.history.take(
            self.clock.seconds(),
            slots=sum(pool.replica.limit for pool in pools),
            in_use=sum(pool.replica.held for pool in pools),
            waiting=sum(len(line.waiting) for line in dict.fromkeys(p.line for p in pools)),
            input_tokens=input_tokens,
            output_tokens=output_tokens,
        )
        if self.subscribers:
            frame = encode_event({"type": SAMPLE, "sample": sample.row()})
            for subscriber in list(self.subscribers):
                subscriber.send(SAMPLE, frame)

    def snapshot(self) -> dict[str, Any]:
        now = self.clock.seconds()
        longest = {}
        for name, pool in self.pools.items():
            arrived = pool.line.line.oldest_arrival()
            if arrived is not None:  # on the line's clock (a shared line's is Redis's)
                longest[name] = pool.line.clock.seconds() - arrived
        return {
            "type": "snapshot",
            **snapshot.build(
                now=now,
                started=self.started,
                version=VERSION,
                status=self.document(),
                longest_wait=longest,
                in_flight=self.telemetry.active.values(),
                finished=self.telemetry.recent,
            ),
        }

    def subscribe(self, request: IRequest) -> Deferred[None] | bytes:
        """Start an event stream on `request`: the current snapshot at once, then as above.
        The Deferred never fires; cancelling it (the client left) ends the subscription.
        With `max_subscribers` open already, the answer is a 503 instead, at once."""
        refusal = self.refusal()
        if refusal is not None:
            # Closed once answered, not kept alive for another request: its descriptor back
            # at once, or refused watchers would still hold every one.
            request.setHeader(b"connection", b"close")
            if request.channel is not None:
                request.channel.persistent = False
            return send_error(request, refusal, shape="plain")
        # First: if it fails, nothing is kept for the stream.
        frame, active = self._frame(with_history=True)
        request.setHeader(b"content-type", b"text/event-stream; charset=utf-8")
        request.setHeader(b"cache-control", b"no-cache")
        request.setHeader(b"x-accel-buffering", b"no")  # nginx: do not buffer SSE
        subscriber = _Subscriber(request, self, self.stall_timeout)
        request.registerProducer(subscriber, True)
        self.subscribers.add(subscriber)
        subscriber.send(SNAPSHOT, frame)
        if self._timer is None:
            self._schedule(self.live_interval if active else self.heartbeat)
        if self.tokens_by_hour is not None:
            if self.usage_frame is not None:  # at once, until the fresh one is read
                subscriber.send(USAGE, self.usage_frame)
            self._read_usage()
            if self._usage_timer is None:
                self._usage_timer = self.clock.callLater(USAGE_INTERVAL, self._usage_tick)
        return Deferred(lambda _: self._unsubscribe(subscriber))

    def refusal(self) -> GatewayError | None:
        """Why one more subscriber is refused, if it is."""
        cap = self.max_subscribers
        if cap == 0:
            return GatewayError(
                503, "the status stream is turned off ([server] max_status_subscribers = 0)"
            )
        if len(self.subscribers) < cap:
            return None
        return GatewayError(
            503,
            f"the status stream has its {cap} subscribers already "
            f"([server] max_status_subscribers = {cap}); try again later",
            retry_after=FULL_RETRY_AFTER,
        )

    def _unsubscribe(self, subscriber: _Subscriber) -> None:
        """Idempotent: a cut, the connection's loss and Klein's cancel may each call it."""
        subscriber.cancel_stall()
        self.subscribers.discard(subscriber)
        if self.subscribers:
            return
        for timer in (self._timer, self._usage_timer):
            if timer is not None:
                timer.cancel()
        self._timer = self._usage_timer = None

    def _usage_tick(self) -> None:
        self._usage_timer = self.clock.callLater(USAGE_INTERVAL, self._usage_tick)
        self._read_usage()

    def _read_usage(self) -> None:
        """Read the per-day chart off the reactor, unless a read is under way already: its
        answer goes to every subscriber, one that just came included."""
        if self.tokens_by_hour is None or self._reading:
            return
        self._reading = True
        now = self.clock.seconds()
        reading = Deferred.fromCoroutine(self.tokens_by_hour(history.first_day(now)))
        reading.addCallbacks(self._usage_read, self._usage_failed, callbackArgs=(now,))

    def _usage_read(self, rows: list[tuple[str, int, int, int]], now: float) -> None:
        self._reading = False
        self.usage_frame = encode_event({"type": USAGE, **history.tokens_by_day(rows, now)})
        for subscriber in list(self.subscribers):
            subscriber.send(USAGE, self.usage_frame)

    def _usage_failed(self, failure: Failure) -> None:
        self._reading = False
        log.failure("status page: cannot read the usage ledger", failure)

    def changed(self) -> None:
        """Something moved: a frame within `min_interval` of the last one, if anyone listens."""
        if not self.subscribers:
            return
        now = self.clock.seconds()
        at = max(now, self._last_sent + self.min_interval)
        if self._timer is not None and self._timer.getTime() <= at:
            return
        self._schedule(at - now)

    def _schedule(self, delay: float) -> None:
        """A new call, not a `reset`: moving a call sooner makes Twisted's reactor look for it
        through its whole heap of timers (`_moveCallLaterSooner`), thousands in a long line;
        a cancel costs nothing."""
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self.clock.callLater(delay, self._push)

    def _frame(self, *, with_history: bool = False) -> tuple[bytes, bool]:
        """The current snapshot as a frame (with the charts' whole ring if `with_history`),
        and whether anything is in flight or waiting."""
        document = self.snapshot()
        if with_history:
            document["history"] = self.history.document(self.sample_interval)
        active = document["in_flight_total"] > 0 or any(
            entry.get("waiting") for entry in document["upstreams"].values()
        )
        return encode_event(document), active

    def _push(self) -> None:
        self._timer = None
        frame, active = self._frame()
        self._last_sent = self.clock.seconds()
        for subscriber in list(self.subscribers):
            subscriber.send(SNAPSHOT, frame)
        self._schedule(self.live_interval if active else self.heartbeat)
