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
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from importlib import metadata, resources
from typing import Any

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IDelayedCall, IPushProducer, IReactorTime
from twisted.web.iweb import IRequest
from zope.interface import implementer

from homelab_gateway.core import snapshot
from homelab_gateway.core.errors import GatewayError
from homelab_gateway.core.sse import encode_event
from homelab_gateway.line.pool import Pool
from homelab_gateway.telemetry import Telemetry
from homelab_gateway.web.respond import send_error

MIN_INTERVAL = 0.3  # at most ~3 frames a second
LIVE_INTERVAL = 1.0
HEARTBEAT = 15.0
MAX_SUBSCRIBERS = 64  # [server] max_status_subscribers' default
STALL_TIMEOUT = 120.0  # [server] write_stall_timeout's default
FULL_RETRY_AFTER = 15  # seconds: the page's longest wait between tries; a place frees as one leaves
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
    pauses it (frames are skipped, the newest kept) instead of growing the gateway's memory.
    Paused for `stall_timeout`, it is cut off; the connection going away ends it too."""

    request: IRequest
    page: StatusPage
    stall_timeout: float
    paused: bool = False
    missed: bytes | None = None
    stall: IDelayedCall | None = None

    def send(self, frame: bytes) -> None:
        if self.paused:
            self.missed = frame
        else:
            self.request.write(frame)

    def pauseProducing(self) -> None:
        self.paused = True
        if self.stall is None:
            self.stall = self.page.clock.callLater(self.stall_timeout, self._stalled)

    def resumeProducing(self) -> None:
        self.cancel_stall()
        self.paused = False
        frame, self.missed = self.missed, None
        if frame is not None:
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
    """The snapshot's inputs, read from the live objects, and the subscribers it goes to."""

    def __init__(
        self,
        clock: IReactorTime,
        telemetry: Telemetry,
        pools: Mapping[str, Pool],
        document: Callable[[], dict[str, Any]],
        *,
        min_interval: float = MIN_INTERVAL,
        live_interval: float = LIVE_INTERVAL,
        heartbeat: float = HEARTBEAT,
        max_subscribers: int = MAX_SUBSCRIBERS,
        stall_timeout: float = STALL_TIMEOUT,
    ) -> None:
        self.clock = clock
        self.telemetry = telemetry
        self.pools = pools
        self.document = document
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
        frame, active = self._frame()  # first: if it fails, nothing is kept for the stream
        request.setHeader(b"content-type", b"text/event-stream; charset=utf-8")
        request.setHeader(b"cache-control", b"no-cache")
        request.setHeader(b"x-accel-buffering", b"no")  # nginx: do not buffer SSE
        subscriber = _Subscriber(request, self, self.stall_timeout)
        request.registerProducer(subscriber, True)
        self.subscribers.add(subscriber)
        subscriber.send(frame)
        if self._timer is None:
            self._schedule(self.live_interval if active else self.heartbeat)
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
        if not self.subscribers and self._timer is not None:
            self._timer.cancel()
            self._timer = None

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

    def _frame(self) -> tuple[bytes, bool]:
        """The current snapshot as a frame, and whether anything is in flight or waiting."""
        document = self.snapshot()
        active = document["in_flight_total"] > 0 or any(
            entry.get("waiting") for entry in document["upstreams"].values()
        )
        return encode_event(document), active

    def _push(self) -> None:
        self._timer = None
        frame, active = self._frame()
        self._last_sent = self.clock.seconds()
        for subscriber in list(self.subscribers):
            subscriber.send(frame)
        self._schedule(self.live_interval if active else self.heartbeat)
