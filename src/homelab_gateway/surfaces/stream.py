"""The client side of a streamed answer: `text/event-stream` frames, the keep-alive of a
silent stream, and the frames that tell a waiting stream its place in the line."""

from __future__ import annotations

from collections.abc import Callable

from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.web.http_headers import Headers
from twisted.web.iweb import IRequest

from homelab_gateway.core.sse import encode_event
from homelab_gateway.core.translator import Event

PING_FRAME = encode_event({"type": "ping"})
# Queue frames are the hot path while thousands wait: a template, not json.dumps. A test pins
# it to exactly what encode_event writes for {"type": "queue", "position": n}.
QUEUE_FRAME = b'event: queue\ndata: {"type":"queue","position":%d}\n\n'
ESTIMATED_QUEUE_FRAME = (
    b'event: queue\ndata: {"type":"queue","position":%d,"estimated_wait_s":%.1f}\n\n'
)
# On the OpenAI surfaces the same JSON goes in a comment line, which every SSE parser skips.
QUEUE_COMMENT = b': queue {"type":"queue","position":%d}\n\n'
ESTIMATED_QUEUE_COMMENT = b': queue {"type":"queue","position":%d,"estimated_wait_s":%.1f}\n\n'

QueueFrame = Callable[[int, float | None, str | None], bytes]
"""The bytes that tell a waiting stream its place, given the wait it means, where known, and
its model's state while that is not loaded (a model loaded on demand: "unloaded", "loading")."""


def templated(plain: bytes, estimated: bytes) -> QueueFrame:
    """A `QueueFrame` from two templates, without and with the estimate; a state goes last."""
    with_state = plain.replace(b"}\n\n", b',"state":"%s"}\n\n')
    estimated_with_state = estimated.replace(b"}\n\n", b',"state":"%s"}\n\n')

    def frame(position: int, estimate: float | None, state: str | None) -> bytes:
        if state is None:
            return plain % position if estimate is None else estimated % (position, estimate)
        if estimate is None:
            return with_state % (position, state.encode())
        return estimated_with_state % (position, estimate, state.encode())

    return frame


ANTHROPIC_QUEUE = templated(QUEUE_FRAME, ESTIMATED_QUEUE_FRAME)
OPENAI_QUEUE = templated(QUEUE_COMMENT, ESTIMATED_QUEUE_COMMENT)


class EventStream:
    """The client side of one streamed answer: `text/event-stream` frames, flushed per write.

    Nothing is sent before the first frame, so an upstream that refuses early can still get an
    HTTP error. While silent for `ping_interval` it repeats a keep-alive: the last queue frame
    while queued, `ping` once the answer has started (the `opening` event went out). It never
    writes to a gone client: the client leaving cancels the handler (`InFlight`), whose
    `finally` closes the stream, in the same turn, and twisted.web drops a write to a
    disconnected request (no `notifyFinish` of its own, which would be one more Deferred for
    each of thousands of waiters).
    """

    __slots__ = (
        "_frame",
        "_keepalive",
        "_opening",
        "_ping",
        "_position",
        "_timer",
        "clock",
        "estimator",
        "ping_interval",
        "request",
        "started",
        "waiting_state",
    )

    def __init__(
        self,
        request: IRequest,
        clock: IReactorTime,
        ping_interval: float,
        queue_frame: QueueFrame = ANTHROPIC_QUEUE,
        *,
        opening: str = "message_start",
        ping: bytes = PING_FRAME,
    ) -> None:
        self.request = request
        self._frame = queue_frame
        self._opening = opening
        self._ping = ping
        self.clock = clock
        self.ping_interval = ping_interval
        self.started = False
        self._keepalive: bytes | None = None  # once started: the ping
        self._timer: IDelayedCall | None = None
        # While queued: the place, whose frame is made again for each keep-alive (with a new
        # estimate), so no waiter holds a copy of its last frame.
        self._position: int | None = None
        # The wait a position means (`PositionedSemaphore.estimate`), where one is known.
        self.estimator: Callable[[int], float | None] | None = None
        # Its model's state while not loaded (`line.residency.waiting_state`), if loaded on
        # demand.
        self.waiting_state: Callable[[], str | None] | None = None

    def send(self, events: list[Event]) -> None:
        if not events:
            return
        if self._keepalive is None and any(e["type"] == self._opening for e in events):
            self._keepalive = self._ping
            self._position = None
        self._write(b"".join(map(encode_event, events)))

    def relay(self, data: bytes) -> None:
        """Bytes an upstream sent, as they are (the OpenAI surfaces): no keep-alive of the
        gateway's follows them, the upstream's own silence is its own."""
        if data:
            self._position = None
            self.close()
            self._write(data)

    def queue_position(self, position: int) -> None:
        self._position = position
        self._write(self._queue_frame(position))

    def _queue_frame(self, position: int) -> bytes:
        estimate = self.estimator(position) if self.estimator is not None else None
        state = self.waiting_state() if self.waiting_state is not None else None
        return self._frame(position, estimate, state)

    def _write(self, frames: bytes) -> None:
        if not self.started:
            self.started = True
            self.request.setResponseCode(200)
            self.request.setHeader(b"content-type", b"text/event-stream; charset=utf-8")
            self.request.setHeader(b"cache-control", b"no-cache")
            self.request.setHeader(b"x-accel-buffering", b"no")  # nginx: do not buffer SSE
            self.request.write(frames)
            # The head is on the wire and twisted.web never reads these headers again; a
            # queued stream would keep them (~1 KB) for its whole wait.
            self.request.responseHeaders = Headers()
        else:
            self.request.write(frames)
        if self._timer is not None and self._timer.active():
            self._timer.reset(self.ping_interval)
        elif self._keepalive is not None or self._position is not None:
            self._timer = self.clock.callLater(self.ping_interval, self._keep_alive)

    def _keep_alive(self) -> None:
        self._timer = None
        if self._position is not None:  # the same place, but time went by: a new estimate
            self._write(self._queue_frame(self._position))
        elif self._keepalive is not None:
            self._write(self._keepalive)

    def close(self) -> None:
        if self._timer is not None and self._timer.active():
            self._timer.cancel()
        self._timer = None
